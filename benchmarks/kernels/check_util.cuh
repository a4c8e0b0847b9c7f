// Helpers shared by the kernel-check programs check_small.cu and check_sample.cu: the CUDA error check that
// throws (one case fails, the program goes on), the pass counters, printf-style formatting, per-case device
// allocations (NaN-poisoned by default), the copy back, and the per-case runner. The includer defines
// CHECK_FAMILY (the name in its "SUMMARY <family> <pass>/<total>" line) first.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef CHECK_FAMILY
#error "define CHECK_FAMILY before including check_util.cuh"
#endif

#define CK(x)                                                                                                   \
  do {                                                                                                          \
    const cudaError_t e_ = (x);                                                                                 \
    if (e_ != cudaSuccess)                                                                                      \
      throw std::runtime_error(std::string(#x) + " at line " + std::to_string(__LINE__) + ": " +               \
                               cudaGetErrorString(e_));                                                         \
  } while (0)

static std::mt19937_64 rng;
static int n_pass = 0, n_total = 0;

static std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char* f, ...) {
  char b[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(b, sizeof b, f, ap);
  va_end(ap);
  return b;
}

// Device allocations of one case, freed when it ends (also on a failure).
struct Dev {
  std::vector<void*> ptrs;
  ~Dev() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <class T>
  T* alloc(size_t n, bool poison = true) {
    void* p = nullptr;
    CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    if (poison) CK(cudaMemset(p, 0xFF, std::max<size_t>(n, 1) * sizeof(T)));  // NaN (fp32 / bf16), -1 (int32)
    return static_cast<T*>(p);
  }
  template <class T>
  T* put(const std::vector<T>& h) {
    T* d = alloc<T>(h.size(), false);
    if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
};

template <class T>
static std::vector<T> get(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Median microseconds of `reps` event-timed runs of f after two warm-ups (a speed line, not a check).
static double median_us(const std::function<void()>& f, int reps = 20) {
  f(), f();
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t(reps);
  for (auto& x : t) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaEventElapsedTime(&x, a, b));
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return 1e3 * t[reps / 2];
}

// Runs one case; an exception (CUDA error, launcher refusal) is one FAIL. A sticky CUDA error ends the program.
static void run_case(const std::string& name, const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    ++n_total;
    std::printf("FAIL %-52s exception: %s\n", name.c_str(), e.what());
    cudaGetLastError();
    if (cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("sticky CUDA error: stopping\nSUMMARY %s %d/%d\n", CHECK_FAMILY, n_pass, n_total);
      std::exit(1);
    }
  }
}
