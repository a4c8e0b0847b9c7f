// The fused decode sub-blocks of one token: the layers of the CUDA backend's decode step (backend_cuda.cu records the
// whole step as one CUDA graph). Each is a few launches of the decode GEMV (gemv.cuh: the norm folded into the
// projection, projections that read one row in one launch, the conv into the in-projection, the MoE combine into the
// down projection) and its neighbours, on buffers dedicated to the step.
#pragma once
#include <cstdint>

#include "core/config.h"
#include "core/state.h"
#include "cuda/gemv.cuh"
#include "cuda/weights_cuda.h"
#include "kernels/params.h"

namespace lily::cuda {

// The step's buffers: device, one token, fixed for the backend's lifetime (a recorded step holds their addresses).
struct DecodeBuffers {
  float* x = nullptr;                                             // [H] the residual stream
  bf16* h = nullptr;                                              // [H] the MoE's normed row
  float *u = nullptr, *z = nullptr, *y = nullptr;                 // [C] post-conv q/k/v, [Hv*Dv] z, scan output
  bf16* yb = nullptr;                                             // [Hv*Dv] the out-projection's input row
  float *b = nullptr, *a = nullptr;                               // [Hv]
  int32_t* head_done = nullptr;                                   // [Hv] deltanet_step's counters: zero, left zero
  float *qg = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;  // [Hq, 2D], [Hq*D], [Hkv*D], [Hkv*D]
  float* part = nullptr;                                          // [Hq, max_splits, D + 2] the split partials
  int64_t max_splits = 0;
  bf16* ob = nullptr;                                             // [Hq*D] the o-projection's input row
  float *router = nullptr, *top_w = nullptr, *sgate = nullptr;    // [E] logits, [k], [1]
  int32_t* top_idx = nullptr;                                     // [k]
  bf16 *act = nullptr, *sact = nullptr;                           // [k, I], [Is]
};

// The kernels' parameters for a config: prefill (S rows from pos0) and decode (S = 1) alike.
kp::DeltaNetParams deltanet_params(const Config& cfg, int64_t S);
kp::AttentionParams attention_params(const Config& cfg, int64_t pos0, int64_t S);

// A segment of a decode GEMV launch: weight w, output mode, fp32 output y or bf16 output yb.
gemv::Seg decode_seg(const DLinear& w, int mode, float* y, bf16* yb = nullptr);

// The sub-blocks, each x += f(RMSNorm(x)) on the buffers' residual, queued on `st`; each returns its launches.
struct DecodeLayers {
  const Config* cfg = nullptr;
  cudaStream_t st = nullptr;
  DecodeBuffers b;
  int sm_count = 0;

  // A launch staging RMSNorm(x; w), the segments left to the caller (the head uses it too).
  gemv::ProjArgs norm_args(const float* w) const;
  int deltanet(const DeviceLayer& L, DeltaNetState& s) const;
  // dpos: the step's position in the device control block; split_k, gqa_pack: the backend's ablation switches (1, 1:
  // keys split over blocks, the 8 query heads of a KV head in one tensor-core block).
  int attention(const DeviceLayer& L, KVCache& kv, const int32_t* dpos, int split_k, int gqa_pack) const;
  int moe(const DeviceLayer& L) const;
};

}  // namespace lily::cuda
