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

// One linear layer y = x W^T, W [out, in] (per expert when stacked), the one encoding CUDA and Metal kernels read
// (lily::linear_params builds it). kind: 0 = MLX affine quantized (codes [E?, out, in*bits/32] u32,
// scales/biases [E?, out, in/group] bf16), 1 = dense bf16, 2 = dense f32.
struct LinearParams {
  int32_t kind;
  int32_t bits;
  int32_t group;
  int32_t pad_;
  int64_t out;
  int64_t in;
  int64_t expert_words;   // u32 words per expert (quantized)
  int64_t expert_groups;  // scale/bias entries per expert (quantized)
  int64_t expert_elems;   // weight elements per expert (dense)
};

// Row mapping of a GEMM over tiles of rows. Plain: tile t covers rows [t*BM, min(M, t*BM+BM)) of expert 0.
// Grouped (MoE): tile t covers sorted pairs [tile_row0[t], +tile_rows[t]) of expert tile_expert[t];
// n_tiles (device) says how many tiles exist, so the grid can be an upper bound launched without a sync.
struct GemmParams {
  int64_t M;        // rows (plain) or pairs (grouped)
  int64_t lda;      // elements between A rows (bf16)
  int64_t ldy;      // elements between output rows
  int32_t grouped;  // 0 plain, 1 grouped
  int32_t accumulate;  // y += result instead of y = result (fp32 output only)
};

// Multi-head attention partial results: one (m, l, o[D]) per (row, query head, split) for split-K.
struct AttnSplitParams {
  int32_t n_splits;
  int32_t split_len;    // keys per split (multiple of 32)
  int32_t rows_per_block;
  int32_t heads_per_block;  // CUDA decode kernel: query heads sharing a block's K/V loads; 0 = all of a KV head's
};

// ---- Metal kernels (metal/*.metal); fp32 activations, weights in checkpoint format ----

// Row-parallel GEMV: y[s, r] (+)= dot(W[r, :], x[s, :]) with s = threadgroup y (decode: S = 1).
struct GemvArgs {
  int32_t x_stride;    // floats between rows of x
  int32_t y_stride;    // floats between rows of y
  int32_t accumulate;  // 1: y += result (residual add fused)
  int32_t pad_;
};

// Y = A W^T on simdgroup matrices. Plain: tile t covers rows [t*BM, +BM) of M. Grouped (MoE): tile t
// covers sorted pairs [tile_row0[t], +tile_rows[t]) of expert tile_expert[t]; n_tiles comes from the
// device, so the grid is an upper bound (max_tiles) and spare threadgroups exit.
struct GemmArgs {
  int32_t M;           // rows of A (plain) or sorted (row, expert) pairs (grouped)
  int32_t grouped;     // 1: expert block map
  int32_t gather;      // 1: A row of pair p is row_index[p] (expert gate/up); 0: A row p
  int32_t epilogue;    // 0: Y = R, 1: Y += R, 2: Y = silu(R_gate) * R_up (two weights)
  int32_t lda;         // floats between rows of A
  int32_t ldy;         // floats between rows of Y
  int32_t max_tiles;   // grid.y (grouped: upper bound of the block map)
  int32_t pad_;
};

// Routing on the device: top-k, per-block expert histogram, offsets and block map, scatter.
struct RouteArgs {
  int32_t S;           // rows
  int32_t n_experts;   // E
  int32_t top_k;
  int32_t norm_topk;   // renormalise the top-k weights
  int32_t block_rows;  // rows per histogram block (32)
  int32_t n_blocks;    // ceil(S / block_rows)
  int32_t tile_rows;   // BM of the grouped GEMM the block map is built for
  int32_t max_tiles;   // capacity of the block map
};

// Fused MoE decode chains (one row): slots 0..top_k-1 are routed experts, slot top_k the shared expert.
struct MoeDecodeArgs {
  int32_t top_k;
  int32_t inter;         // I (routed)
  int32_t shared_inter;  // Is
  int32_t act_stride;    // floats between slots of the activation buffer (max(I, Is))
};

// RMSNorm over rows: y[s, :] = x[s, :] * rsqrt(mean(x^2) + eps) * w.
struct NormArgs {
  int32_t dim;
  float eps;
  int32_t x_stride;
  int32_t y_stride;
};

// Device sampling (metal/sample.metal; the semantics of csrc/cuda/sample.cuh): one generation's options and
// the step's row, the same struct for the three kernels. Bias entries, seen, counts, the uniform and the token
// slots are buffers.
struct SampleArgs {
  float inv_temperature;     // 1 / T (unused when greedy)
  int32_t greedy;            // 1: argmax of the processed logits
  int32_t top_k;             // <= 0 or >= V: off
  float top_p;               // >= 1: off
  float min_p;               // 0: off
  float repetition_penalty;  // 1: off
  float presence_penalty;
  float frequency_penalty;
  int32_t n_bias;            // entries in bias_ids / bias_vals (distinct ids)
  int32_t vocab;             // V >= 1
  int32_t token_slot;        // tokens[token_slot] receives the draw
  int32_t pad_;
};

}  // namespace kp
}  // namespace lily
