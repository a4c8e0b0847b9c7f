// Launchers of the non-GEMM kernel families (misc.cu, routing.cu, deltanet.cu, deltanet_chunk.cu, attention.cu).
// All pointers are device pointers; all launches go to stream `st` and never synchronise.
#pragma once
#include "cuda/common.cuh"
#include "kernels/params.h"

namespace lily::cuda {

// misc.cu
// x[s, :] = E[ids[s], :] (dequantized rows).  ids: int32 [S], x: fp32 [S, E.in].
void embed(cudaStream_t st, const DLinear& E, const int32_t* ids, int64_t S, float* x);
// y[r, :] = bf16(x[r, :] * rsqrt(mean(x[r]^2) + eps) * w).  x: fp32 [rows, n], w: fp32 [n], y: bf16 [rows, n].
void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, bf16* y);
// Fills n bytes with 0xFF (NaN in fp32 and bf16): debug poisoning of scratch buffers.
void poison(cudaStream_t st, void* p, size_t n);

// routing.cu
// Router softmax (fp32) over E experts, top-k by repeated argmax (ties -> lower index), optional renorm.
// logits: fp32 [S, E] -> top_idx int32 [S, k], top_w fp32 [S, k].
void moe_route(cudaStream_t st, const kp::MoeParams& p, const float* logits, int32_t* top_idx, float* top_w);
// Groups the S*k (token, expert) pairs by expert and cuts each group into tiles of at most tile_rows:
//   pair_row[P] (token row), pair_id[P] (s*k + j), pair_w[P]; tiles: n_tiles[1], tile_expert/row0/rows[max_tiles].
// One block, no host synchronisation; max_tiles = ceil(S*k / tile_rows) + E.
void moe_sort(cudaStream_t st, const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows,
              int32_t* pair_row, int32_t* pair_id, float* pair_w, int32_t* n_tiles, int32_t* tile_expert,
              int32_t* tile_row0, int32_t* tile_rows_out);
// x[s, :] += sigmoid(gate[s]) * sh[s, :] + sum_j d[s*k + j, :].  sh, d (fp32 [S, H], [S*k, H]), gate fp32 [S].
void moe_combine(cudaStream_t st, const kp::MoeParams& p, const float* sh, const float* gate, const float* d, float* x);

// deltanet.cu
// Causal depthwise conv over [conv_state; qkv] + SiLU, then per-head l2 norm of q (times Dk^-0.5) and k.
// qkv: fp32 [S, C] -> u fp32 [S, C]; conv_w fp32 [C, K]; conv_state fp32 [K-1, C] updated.
void deltanet_conv(cudaStream_t st, const kp::DeltaNetParams& p, const float* qkv, const float* conv_w,
                   float* conv_state, float* u);
// Gated delta rule recurrence over S rows (model.md §4.3 step 7); the state ssm: fp32 [Hv, Dv, Dk] is read and
// written in place; b, a: fp32 [S, Hv] raw (before sigmoid / softplus); y: fp32 [S, Hv*Dv] (before the gated
// norm). `form` selects the implementation (flag dn_form):
//   kScanSequential  exact fp32 sequential scan, 8 lanes per row, inputs staged by cp.async (deltanet_chunk.cu);
//   kScanChunked     chunked WY form (chunk 64), Gram/state products on TF32 tensor cores (~5e-4 rel error,
//                    below the bf16 rounding of y that follows);
//   kScanAuto        kScanChunked when S >= kScanChunkMinRows, else kScanSequential (the default).
// The chunked form needs deltanet_chunk_scratch_bytes(p) bytes of device scratch: pass it (required under
// graph capture); otherwise a lazily grown internal buffer is used (cudaMalloc: synchronises once per growth).
enum DeltaNetScanForm : int { kScanAuto = 0, kScanSequential = 1, kScanChunked = 2 };
// Auto threshold, predicted (chunked ~= 2 launches + ceil(S/64) chunk steps of ~2.5 us vs ~0.125 us per token
// sequential); benchmarks/kernels/check_deltanet.cu prints the measured crossover.
constexpr int64_t kScanChunkMinRows = 128;
void deltanet_scan(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y, int form = kScanAuto,
                   float* scratch = nullptr, size_t scratch_bytes = 0);
// The form deltanet_scan runs for `form` at p.S (resolves kScanAuto).
int deltanet_scan_pick(const kp::DeltaNetParams& p, int form);
// deltanet_chunk.cu. Same arguments as deltanet_scan. Dk <= 128, Hv a multiple of Hk.
// Sequential: lanes_per_row (8 or 16) lanes own one state row; token inputs staged 32 tokens ahead by cp.async.
void deltanet_scan_seq(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                       const float* dt_bias, const float* a_log, float* ssm, float* y, int lanes_per_row = 8);
// Chunked (TF32 tensor cores): scratch fp32 of deltanet_chunk_scratch_bytes(p) bytes
// (Hv * ceil(S/64) * 64 * (Dk + Dv + 65) floats).
size_t deltanet_chunk_scratch_bytes(const kp::DeltaNetParams& p);
void deltanet_scan_chunked(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b,
                           const float* a, const float* dt_bias, const float* a_log, float* ssm, float* y,
                           float* scratch);
// out[t, h, :] = bf16(RMSNorm(y[t, h, :]; w) * silu(z[t, h, :])).  y, z: fp32 [S, Hv*Dv]; w: fp32 [Dv].
void deltanet_gated_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* y, const float* z,
                         const float* w, bf16* out);

// attention.cu
// q/k RMSNorm + partial RoPE; k, v appended to the bf16 cache at rows pos0..pos0+S-1.
// qg: fp32 [S, Hq, 2D] ([query | gate] per head) -> q fp32 [S, Hq, D]; k, v fp32 [S, Hkv*D];
// k_cache, v_cache bf16 [capacity, Hkv*D].
void attention_prep(cudaStream_t st, const kp::AttentionParams& p, const float* qg, const float* k, const float* v,
                    const float* q_norm, const float* k_norm, float* q, bf16* k_cache, bf16* v_cache,
                    const int32_t* dpos = nullptr);
// Split plan for S rows at pos0: how many key splits keep the GPU busy; partials hold
// S * Hq * n_splits * (D + 2) floats. S > 1 plans for attention_mma, S == 1 for the decode kernels (attn_kernel's
// plan, which the tensor-core decode kernel also takes). part must hold what the plan says.
kp::AttnSplitParams attention_plan(const kp::AttentionParams& p, int sm_count);
// Causal GQA attention over the cache (keys 0..pos0+t for row t), then o = bf16(softmax(qK^T) V * sigmoid(gate)).
// part: fp32 scratch [S, Hq, n_splits, D + 2]; o: bf16 [S, Hq*D].
// dpos (prep and attention): when set, pos0 is read from the device (decode graphs) and the split length is
// derived there from the key count over the fixed sp.n_splits (empty splits write m = -inf, l = 0).
// Kernels: prefill chunks (S > 1, dpos null) the tensor-core flash attention (attention_mma.cu); one row with
// tensor_core_decode and 8 query heads per KV head (head_dim 128 / 256) the tensor-core decode kernel
// (attention_decode_tc.cu); anything else the CUDA-core attn_kernel (its sp.heads_per_block: the GQA packing).
void attention(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
               const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o,
               const int32_t* dpos = nullptr, bool tensor_core_decode = false);

// attention_decode_tc.cu (called by attention() with tensor_core_decode): one query row on the tensor cores, 8 query heads
// per KV head, head_dim 128 or 256; writes the split partials for attn_combine_kernel (any n_splits).
bool attention_decode_tc_supported(const kp::AttentionParams& p);
void attention_decode_tc(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                         const bf16* k_cache, const bf16* v_cache, float* part, const int32_t* dpos);

// attention_mma.cu (called by attention(); exposed for the check program)
// Whether attention_mma handles this shape (D in {32, 64, 128, 256}, Hq a multiple of Hkv).
bool attention_mma_supported(const kp::AttentionParams& p);
// Split plan for attention_mma: splits keys only when the 128-row tiles leave SMs idle (small S, long cache).
kp::AttnSplitParams attention_mma_plan(const kp::AttentionParams& p, int sm_count);
// Causal GQA flash attention (mma.sync bf16, fp32 softmax) over keys 0..pos0+t for row t. q fp32 [S, Hq, D]
// is rounded to bf16. n_splits == 1: writes o bf16 [S, Hq*D] = softmax(qK^T)V * sigmoid(gate), gate from
// qg fp32 [S, Hq, 2D]; n_splits > 1: writes part fp32 [S, Hq, n_splits, D + 2] (attn_kernel's layout) and
// the caller merges with the combine kernel.
void attention_mma(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                   const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o);

}  // namespace lily::cuda
