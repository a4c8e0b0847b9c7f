// Plain argument structs per kernel family, shared by host C++, CUDA (.cu) and Metal (.metal) code.
// Only fixed-width scalars: no pointers (buffers are bound separately), no std types, no vector types
// (their size differs between MSL and C++); 64-bit fields 8-byte aligned, so layouts agree everywhere.
#pragma once
#if defined(__METAL_VERSION__)
#include <metal_stdlib>  // fixed-width integer types in MSL
#else
#include <stdint.h>
#endif

namespace lily {
namespace kp {

// Gated full attention over the KV cache; new rows sit at positions pos0 .. pos0+S-1.
struct AttentionParams {
  int32_t n_heads;      // Hq
  int32_t n_kv_heads;   // Hkv (query head h reads KV head h / (Hq/Hkv))
  int32_t head_dim;     // D
  int32_t rotary_dim;   // first rotary_dim dims rotate, half-split pairs (i, i + rotary_dim/2)
  float rope_theta;
  float eps;            // q/k RMSNorm eps
  float scale;          // D^-0.5
  int32_t pad_;
  int64_t pos0;
  int64_t S;
};

// Gated DeltaNet: conv + recurrence + gated norm. Value head h reads key head h / (Hv/Hk).
struct DeltaNetParams {
  int32_t k_heads;      // Hk
  int32_t v_heads;      // Hv
  int32_t k_dim;        // Dk
  int32_t v_dim;        // Dv
  int32_t conv_kernel;  // K
  int32_t conv_dim;     // C = 2*Hk*Dk + Hv*Dv
  float norm_eps;       // gated RMSNorm eps
  float qk_eps;         // inside sqrt(sum(x^2) + eps) of the q/k l2 normalisation
  int64_t S;
};

// Sparse MoE routing and expert FFN.
struct MoeParams {
  int32_t hidden;        // H
  int32_t n_experts;     // E
  int32_t top_k;
  int32_t inter;         // I
  int32_t shared_inter;  // Is
  int32_t norm_topk_prob;
  int64_t S;
};

}  // namespace kp
}  // namespace lily
