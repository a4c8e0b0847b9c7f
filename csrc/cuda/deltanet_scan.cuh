// Internal to the Gated DeltaNet prefill forms (deltanet_seq.cu: sequential; deltanet_chunk.cu: chunked): their
// shared arguments, block size, launch attribute and cp.async helpers (commit / wait: mma_bf16.cuh's).
#pragma once
#include <stdexcept>
#include <string>

#include "cuda/deltanet.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda::dn_scan {

constexpr int kThreads = 256;  // both forms' blocks (8 warps) unless a kernel says otherwise

struct ScanArgs {
  kp::DeltaNetParams p;
  const float* u;        // [S, C]: q | k | v after conv, SiLU and l2 norm
  const float* b;        // [S, Hv] raw (beta = sigmoid(b))
  const float* a;        // [S, Hv] raw (g = exp(-exp(a_log) softplus(a + dt_bias)))
  const float* dt_bias;  // [Hv]
  const float* a_log;    // [Hv]
  float* ssm;            // [Hv, Dv, Dk] fp32, updated in place
  float* y;              // [S, Hv*Dv]
  bool vec4;             // u, scratch rows 16-byte aligned (Dk, Dv, C multiples of 4): float4 tile loads
};

__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
using mma::cp_async_commit;
using mma::cp_async_wait;

template <typename Kernel>
inline void set_smem(Kernel k, size_t bytes) {
  LILY_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

inline void check_shape(const kp::DeltaNetParams& p, const char* who) {
  if (p.k_dim < 1 || p.k_dim > 128 || p.v_dim < 1 || p.k_heads < 1 || p.v_heads % p.k_heads != 0)
    throw std::invalid_argument(std::string("[lily] cuda ") + who +
                                ": needs 1 <= Dk <= 128, Dv >= 1 and Hv a multiple of Hk");
}

}  // namespace lily::cuda::dn_scan
