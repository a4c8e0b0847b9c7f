// The decode sub-blocks over M = 1..8 rows of one stream at consecutive positions (issue 43: the speculative verify's
// rows; next, streams decoded together): decode_layers.cuh's chain on the M-row kernels (gemv_rows.cuh's projections,
// conv, routing, experts and combine; deltanet_step_rows; the tensor-core decode attention over M query rows), each
// row computed exactly as a one-row step of these kernels computes it. Not yet wired: backend_cuda's decode step and
// its exact rows still run decode_layers.cuh and the prefill path (the kernels below have not run on a device yet).
#pragma once
#include <cstdint>

#include "core/config.h"
#include "core/state.h"
#include "cuda/gemv_rows.cuh"
#include "cuda/weights_cuda.h"

namespace lily::cuda {

// Device buffers for up to rows::kMaxRows rows (a recorded step holds their addresses). H hidden, C conv channels,
// K conv taps, Hv / Dv / Dk DeltaNet heads and dims, Hq / Hkv / D attention heads and dim, E experts, k routed
// experts, I / Is expert and shared-expert widths, V vocabulary.
struct DecodeRowsBuffers {
  float* x = nullptr;                              // [M, H] the residual rows
  bf16* h = nullptr;                               // [M, H] the MoE's normed rows
  float *u = nullptr, *z = nullptr, *y = nullptr;  // [M, C] post-conv, [M, Hv*Dv] z, scan output
  bf16* yb = nullptr;                              // [M, Hv*Dv] the out-projection's input rows
  float *b = nullptr, *a = nullptr;                // [M, Hv]
  int32_t* head_done = nullptr;                    // [Hv] deltanet_step_rows' counters: zero, left zero
  float *qg = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;  // [M, Hq*2D], [M, Hq*D], [M, Hkv*D] x 2
  float* part = nullptr;                           // [M, Hq, max_splits, D + 2]
  int64_t max_splits = 0;
  bf16* ob = nullptr;                              // [M, Hq*D]
  float *router = nullptr, *top_w = nullptr, *sgate = nullptr;  // [M, E], [M, k], [M]
  int32_t* top_idx = nullptr;                      // [M, k]
  bf16 *act = nullptr, *sact = nullptr;            // [M, k, I], [M, Is]
  float *yx = nullptr, *ysh = nullptr;             // [M, k, H] the experts' downs, [M, H] the shared expert's
  float* logits = nullptr;                         // [M, V]
  unsigned long long* amax = nullptr;              // [rows::head_blocks(V), M] the head's block keys
  int32_t* tokens = nullptr;                       // [M] the greedy head's tokens
};

struct DecodeRowsLayers {
  const Config* cfg = nullptr;
  cudaStream_t st = nullptr;
  DecodeRowsBuffers b;
  int sm_count = 0;

  // Each x[0 .. M) += f(RMSNorm(x; norm)) queued on `st`; returns its launches.
  // conv_hist (nullable) fp32 [K-1+M, C]: the conv state before the rows, then the rows' pre-conv products (row t's
  // state: rows t+1 .. t+K-1); state_rows (nullable) fp32 [M, Hv, Dv, Dk]: the recurrent state after each row. The
  // layer's DeltaNetState ends after the last row either way (a rejected draft takes its row from these).
  int deltanet(const DeviceLayer& L, DeltaNetState& s, int M, float* conv_hist, float* state_rows) const;
  // Rows at positions *dpos .. *dpos + M - 1 (the cache holds capacity rows; the split plan is its one-row plan).
  int attention(const DeviceLayer& L, KVCache& kv, const int32_t* dpos, int M) const;
  int moe(const DeviceLayer& L, int M) const;
  // The head: logits[m] = RMSNorm(x[m]; final_norm) W_lm^T, tokens[m] its argmax (ties: the lowest id).
  int head_greedy(const DLinear& lm_head, const float* final_norm, int M) const;
};

}  // namespace lily::cuda
