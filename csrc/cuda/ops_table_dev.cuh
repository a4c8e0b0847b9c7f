// Internal to the CUDA op table (ops_table*.cu): the device allocations of one op call (freed when it returns, also
// when it throws), host <-> device copies, and the device view of a host weight. Everything runs on the legacy default
// stream, so plain cudaMemcpy / cudaMemset order with the launches.
#pragma once
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/weights.h"
#include "cuda/common.cuh"
#include "cuda/ops_table.h"

namespace lily::cuda::ops {

constexpr cudaStream_t kStream = nullptr;  // the legacy default stream

class Dev {
 public:
  Dev() = default;
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    for (void* p : ptrs_) cudaFree(p);
  }

  // n elements of T, every byte 0xFF (NaN in fp32 / bf16, -1 in int32) unless poison is false.
  template <class T>
  T* alloc(size_t n, bool poison = true) {
    void* p = nullptr;
    const size_t bytes = (n > 0 ? n : 1) * sizeof(T);
    check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    ptrs_.push_back(p);
    if (poison) LILY_CUDA_CHECK(cudaMemset(p, 0xFF, bytes));
    return static_cast<T*>(p);
  }
  // A device copy of h [n]; nullptr stays nullptr. pad: that many poisoned elements in front (an address offset).
  template <class T>
  T* put(const T* h, size_t n, size_t pad = 0) {
    if (h == nullptr) return nullptr;
    T* d = alloc<T>(n + pad, pad > 0) + pad;
    if (n) LILY_CUDA_CHECK(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  template <class T>
  T* put(const std::vector<T>& h) {
    return put(h.data(), h.size());
  }

  // The device view of a host weight (kernels/params.h encoding, lily::linear_params). sb_offset: scales and biases
  // start that many bf16 past their allocation's (256-byte aligned) start.
  DLinear linear(const Linear& l, int sb_offset = 0) {
    DLinear d;
    if (l.kind == Linear::Kind::None) return d;
    d.p = linear_params(l);
    const int64_t ne = l.experts > 0 ? l.experts : 1;
    if (l.kind == Linear::Kind::Quant) {
      d.codes = put(l.codes, ne * d.p.expert_words);
      d.scales = put(l.scales, ne * d.p.expert_groups, sb_offset);
      d.biases = put(l.biases, ne * d.p.expert_groups, sb_offset);
    } else if (l.kind == Linear::Kind::DenseBF16) {
      d.dense = put(static_cast<const uint16_t*>(l.dense), ne * d.p.expert_elems);
    } else {
      d.dense = put(static_cast<const float*>(l.dense), ne * d.p.expert_elems);
    }
    return d;
  }

 private:
  std::vector<void*> ptrs_;
};

template <class T>
void get(T* h, const T* d, size_t n) {
  if (h != nullptr && n) LILY_CUDA_CHECK(cudaMemcpy(h, d, n * sizeof(T), cudaMemcpyDeviceToHost));
}

// After the launches of one op: configuration errors and faults surface here (a fault is sticky: the process's later
// CUDA calls fail too, and the message says so).
inline void finish(const char* op) {
  const cudaError_t e = cudaGetLastError();
  const cudaError_t s = cudaDeviceSynchronize();
  if (e != cudaSuccess || s != cudaSuccess)
    throw std::runtime_error(std::string("[cuda_ops.") + op + "] " + cudaGetErrorString(e != cudaSuccess ? e : s));
}

inline const bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const bf16*>(p); }
inline bf16* as_bf16(uint16_t* p) { return reinterpret_cast<bf16*>(p); }

}  // namespace lily::cuda::ops
