// The Gated DeltaNet family (deltanet.cu, deltanet_seq.cu, deltanet_chunk.cu): conv, recurrence (prefill forms,
// one-token step), gated norm. Device pointers, stream-ordered.
#pragma once
#include "cuda/common.cuh"
#include "kernels/params.h"

namespace lily::cuda {

// Causal depthwise conv over [conv_state; qkv] + SiLU, then per-head l2 norm of q (times Dk^-0.5) and k.
// qkv: fp32 [S, C] -> u fp32 [S, C] (u aliases neither qkv nor conv_state); conv_w fp32 [C, K]; conv_state fp32
// [K-1, C] updated. C % 4 == 0, Dk % 4 == 0, 128 % Dk == 0 and 16-byte aligned qkv, u, conv_state (the model):
// one launch of float4 rows with the l2 norm fused, then the state copy; other shapes: a channel per thread, the
// state copy, a separate l2 norm launch. Same conv arithmetic (tap order, SiLU) either way.
void deltanet_conv(cudaStream_t st, const kp::DeltaNetParams& p, const float* qkv, const float* conv_w,
                   float* conv_state, float* u);
// Gated delta rule recurrence over S rows (docs/model.md §4.3 step 7); the state ssm: fp32 [Hv, Dv, Dk] is read and
// written in place; b, a: fp32 [S, Hv] raw (before sigmoid / softplus); y: fp32 [S, Hv*Dv] (before the gated
// norm). `form` selects the implementation (flag deltanet_form):
//   kScanSequential  exact fp32 sequential scan, 8 lanes per row, inputs staged by cp.async (deltanet_seq.cu);
//   kScanChunked     chunked WY form (chunk 64), Gram/state products on TF32 tensor cores (~5e-4 rel error,
//                    below the bf16 rounding of y that follows);
//   kScanAuto        kScanChunked when S >= kScanChunkMinRows, else kScanSequential (the default).
// The chunked form needs deltanet_chunk_scratch_bytes(p) bytes of device scratch: pass it (required under
// graph capture); otherwise a lazily grown internal buffer is used (cudaMalloc: synchronises once per growth).
enum DeltaNetScanForm : int { kScanAuto = 0, kScanSequential = 1, kScanChunked = 2 };
// Auto threshold, measured (benchmarks/kernels/time_deltanet.cu prints the crossover): on the H200 the chunked form
// (3 launches + ceil(S/64) sequential chunk steps) ties the sequential one at S = 128 and wins from 256 on.
constexpr int64_t kScanChunkMinRows = 128;
void deltanet_scan(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y, int form = kScanAuto,
                   float* scratch = nullptr, size_t scratch_bytes = 0);
// The form deltanet_scan runs for `form` at p.S (resolves kScanAuto).
int deltanet_scan_pick(const kp::DeltaNetParams& p, int form);
// deltanet_scan, then deltanet_gated_norm of its output (the prefill's order): out bf16 [S, Hv*Dv]
// = bf16(RMSNorm(y[t, h, :]; norm_w) * silu(z[t, h, :])), z fp32 [S, Hv*Dv], norm_w fp32 [Dv]; the other arguments
// as deltanet_scan. y fp32 [S, Hv*Dv] is scratch, its contents afterwards unspecified: when the chunked form runs
// and Dv <= kScanNormMaxDv, its output kernel applies the norm itself and never writes y (deltanet_scan_chunked_norm:
// one launch and a write and read of y through DRAM fewer); otherwise (sequential form, wider heads) y carries the
// scan's output into deltanet_gated_norm.
void deltanet_scan_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z,
                        const float* norm_w, bf16* out, int form = kScanAuto, float* scratch = nullptr,
                        size_t scratch_bytes = 0);
// deltanet_seq.cu, deltanet_chunk.cu (the prefill forms). Same arguments as deltanet_scan. Dk <= 128, Hv a multiple of Hk.
// Sequential: lanes_per_row (8 or 16) lanes own one state row; token inputs staged 32 tokens ahead by cp.async.
void deltanet_scan_seq(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                       const float* dt_bias, const float* a_log, float* ssm, float* y, int lanes_per_row = 8);
// Chunked (TF32 tensor cores, three launches): scratch fp32 of deltanet_chunk_scratch_bytes(p) bytes
// (Hv * ceil(S/64) * (64 * (Dk + Dv + 1) + Dv * Dk) floats: W, U/Delta, decays, the state at each chunk start).
size_t deltanet_chunk_scratch_bytes(const kp::DeltaNetParams& p);
void deltanet_scan_chunked(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b,
                           const float* a, const float* dt_bias, const float* a_log, float* ssm, float* y,
                           float* scratch);
// The chunked form with deltanet_gated_norm fused into its output kernel, which holds a row's Dv outputs of a value
// head in registers (two 64-wide slices): Dv <= kScanNormMaxDv. Writes out bf16 [S, Hv*Dv] (no y); z, norm_w,
// scratch as deltanet_scan_norm and deltanet_scan_chunked.
constexpr int kScanNormMaxDv = 128;
void deltanet_scan_chunked_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b,
                                const float* a, const float* dt_bias, const float* a_log, float* ssm, const float* z,
                                const float* norm_w, bf16* out, float* scratch);
// The gated norm's arithmetic for one element, y * inv * w * silu(z) with inv = 1 / sqrt(mean(y^2) + eps): the one
// formula of gated_norm_kernel, deltanet_step_kernel's fused norm and chunk_out_kernel's.
__device__ __forceinline__ float gated_out(float y, float inv, float w, float z) {
  return y * inv * w * (z / (1.f + expf(-z)));
}
// out[t, h, :] = bf16(RMSNorm(y[t, h, :]; w) * silu(z[t, h, :])).  y, z: fp32 [S, Hv*Dv]; w: fp32 [Dv].
void deltanet_gated_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* y, const float* z,
                         const float* w, bf16* out);

// One token (the decode step; deltanet.cu): the recurrence with the q/k l2 normalisation and the gated RMSNorm
// fused in. u [C] post-conv (q, k not yet l2-normalised), b/a [Hv] raw, ssm [Hv, Dv, Dk] updated, y [Hv*Dv] fp32
// (before the norm), z [Hv*Dv] fp32, norm_w [Dv] -> out [Hv*Dv] bf16 = bf16(RMSNorm(y_h; norm_w) * silu(z_h)) per
// head (deltanet_gated_norm's arithmetic). head_done: int32 [Hv] device counters, zero before the first launch and
// left zero by every launch (one array serves every layer of a stream). PDL launch.
void deltanet_step(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z, const float* norm_w,
                   bf16* out, int32_t* head_done);

// The step over M = p.S rows (1..8; deltanet_rows.cu): u [M, C], b / a [M, Hv], y / z [M, Hv*Dv], out bf16
// [M, Hv*Dv]; ssm ends as the state after the last row; state_rows (nullable) fp32 [M, Hv, Dv, Dk] gets the state
// after each row (the speculative verify's roll-back slots). Row t equals a one-token step on the state after row
// t - 1, bit for bit. head_done as deltanet_step. Not yet wired into the engine (issue 43).
void deltanet_step_rows(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z,
                        const float* norm_w, bf16* out, int32_t* head_done, float* state_rows);

}  // namespace lily::cuda
