// Shared by the kernel timing drivers (time_*.cu): the CUDA error check that stops the program, random inputs filled
// on the device (a hash of the index, so a driver's inputs cost no host time), random 4/8-bit weights, the median of
// event-timed launches, and the --once mode: every timed shape launched once, untimed (for compute-sanitizer and ncu,
// run.sh SANITIZE=memcheck). Correctness is tests/kernels' (test_cuda_*.py against lily.reference); these programs
// only time the kernels the engine calls.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda/common.cuh"

#define CK(x)                                                                                                   \
  do {                                                                                                          \
    const cudaError_t e_ = (x);                                                                                 \
    if (e_ != cudaSuccess) {                                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x);     \
      std::exit(2);                                                                                             \
    }                                                                                                           \
  } while (0)

namespace timing {

using lily::cuda::bf16;

inline bool g_once = false;  // --once: one untimed launch per shape

// Parses the driver's flags: --once (see above); returns the first other argument or nullptr.
inline const char* parse_args(int argc, char** argv) {
  const char* rest = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--once") == 0) g_once = true;
    else if (!rest) rest = argv[i];
  }
  return rest;
}

__device__ __forceinline__ uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Uniform in [lo, hi) from (seed, i).
__device__ __forceinline__ float hash_uniform(uint64_t seed, int64_t i, float lo, float hi) {
  const uint64_t z = mix(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull);
  return lo + (hi - lo) * static_cast<float>(z >> 40) * (1.f / 16777216.f);
}
template <class T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (sizeof(T) == 4 && !std::is_same_v<T, float>)
      p[i] = static_cast<T>(mix(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i)));
    else
      p[i] = static_cast<T>(hash_uniform(seed, i, lo, hi));
  }
}

template <class T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}
// n random values in [lo, hi) (floats and bf16), or random bits (32-bit integers).
template <class T>
T* drandom(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  T* p = dalloc<T>(n);
  fill_kernel<T><<<1024, 256>>>(p, static_cast<int64_t>(n), seed, lo, hi);
  CK(cudaGetLastError());
  return p;
}
template <class T>
T* dupload(const std::vector<T>& v) {
  T* p = dalloc<T>(v.size());
  if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// A device-only MLX affine weight [E, out, in] (group 64): random codes, scales ~ U(0.08, 0.2) / (2^bits - 1),
// biases centring the codes (weights ~ +-0.1), as a real checkpoint's.
struct DevWeight {
  lily::cuda::DLinear d;
  void make(int bits, int64_t E, int64_t out, int64_t in, uint64_t seed) {
    const int64_t words = E * out * in * bits / 32, groups = E * out * in / 64;
    const float q = static_cast<float>((1 << bits) - 1);
    d.p = lily::kp::LinearParams{0, bits, 64, 0, out, in, out * in * bits / 32, out * in / 64, out * in};
    d.codes = drandom<uint32_t>(words, seed);
    d.scales = reinterpret_cast<uint16_t*>(drandom<bf16>(groups, seed + 1, 0.08f / q, 0.2f / q));
    d.biases = reinterpret_cast<uint16_t*>(drandom<bf16>(groups, seed + 2, -0.13f, -0.03f));
  }
  void free_all() {
    cudaFree(const_cast<uint32_t*>(d.codes));
    cudaFree(const_cast<uint16_t*>(d.scales));
    cudaFree(const_cast<uint16_t*>(d.biases));
  }
};

// Median ms of `reps` event-timed launches on the legacy stream after `warm` untimed ones, launch(i) rotating its
// inputs so the 60 MB L2 does not hold them; --once: launch(0) once, untimed (returns 0).
inline double median_ms(const std::function<void(int)>& launch, int reps = 25, int warm = 3) {
  if (g_once) {
    launch(0);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0.0;
  }
  for (int i = 0; i < warm; ++i) launch(i);
  CK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(ev[2 * i]));
    launch(i);
    CK(cudaEventRecord(ev[2 * i + 1]));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

// Mean ms of `reps` back-to-back launches (no event between them: PDL launches overlap their tails, as in the decode
// step); --once: one untimed launch.
inline double mean_ms(const std::function<void(int)>& launch, int reps = 60, int warm = 3) {
  if (g_once) return median_ms(launch);
  for (int i = 0; i < warm; ++i) launch(i);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) launch(i);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms / reps;
}

inline void print_device(const char* program) {
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: device %s, %d SMs%s\n", program, prop.name, prop.multiProcessorCount,
              g_once ? " (--once: one untimed launch per shape)" : "");
}

}  // namespace timing
