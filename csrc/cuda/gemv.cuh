// The decode GEMVs (one token): fused projections of the CUDA backend's decode step, fewer launches per step and
// no host work inside it, so the whole step can be captured as one CUDA graph (backend_cuda.cu). Entry points:
// proj and moe_down (gemv.cu), which pick an implementation by `impl` (flag gemv_impl).
//
//   proj   : y = x W^T over up to kMaxSegs weight matrices that read the same input row ("segments", row
//            ranges of one launch), with the input staged in shared memory by a prologue that also does the
//            producer's normalisation: RMSNorm of the fp32 residual, the DeltaNet gated RMSNorm, or a plain
//            bf16 copy. Output per segment: store, accumulate (residual add), SiLU(gate)*up (bf16), or the
//            DeltaNet causal conv + SiLU with its state update. Optional routing prologue (softmax top-k
//            of the router logits; segment slot j reads expert top_idx[j]) and block argmax (greedy head).
//   down   : x[r] += sum_j w_j (act_j . Wdown[e_j][r]) + sigmoid(g) (sact . Wsh_down[r])  (MoE combine fused)
// (The one-token DeltaNet scan is deltanet.cu's deltanet_step; the greedy head's argmax sample.cu's
// argmax_from_block_keys.)
#pragma once
#include "cuda/common.cuh"

namespace lily::cuda::gemv {

constexpr int kMaxSegs = 4;
constexpr int kMaxTopK = 16;

enum XMode : int32_t { kXBf16 = 0, kXNorm = 1, kXGated = 2 };
enum OMode : int32_t { kOStore = 0, kOAccum = 1, kODual = 2, kOConv = 3 };

struct Seg {
  DLinear w0, w1;        // w1: the up projection of a DUAL segment (same shape and format as w0)
  float* y = nullptr;    // fp32 output (store / accumulate)
  bf16* yb = nullptr;    // bf16 output (dual)
  int32_t mode = kOStore;
  int32_t routed = 0;    // 1: slot j uses expert top_idx[j] (routing prologue); 0: expert 0
  int32_t slots = 1;     // copies of the segment over slots (experts); output slot j at y + j * y_step
  int32_t warp0 = 0;     // first global warp of the segment (filled by the launcher)
  int32_t warps_per_slot = 0;
  int32_t pad_ = 0;
  int64_t y_step = 0;
};

struct ProjArgs {
  Seg seg[kMaxSegs];
  int32_t nseg = 0;
  int32_t xmode = kXBf16;
  int32_t in = 0;          // input length (every segment's W.p.in)
  int32_t gdim = 0;        // gated: elements per head (Dv)
  float eps = 0.f;
  int32_t route = 0;       // routing prologue (segments with routed = 1 need it)
  const float* xf = nullptr;   // norm: fp32 residual row; gated: y
  const float* zf = nullptr;   // gated: z
  const float* nw = nullptr;   // norm weight
  const bf16* xb = nullptr;    // bf16 input row
  bf16* h_out = nullptr;       // norm: block 0 also writes the normed row (bf16) here
  // routing prologue: softmax over E router logits, top-k, optional renormalisation
  const float* rlogits = nullptr;
  int32_t E = 0, top_k = 0, norm_topk = 0, pad_ = 0;
  int32_t* top_idx = nullptr;  // block 0 writes the routing here for the down kernel
  float* top_w = nullptr;
  // conv epilogue (mode kOConv): u[c] = silu(sum_j w[c, j] X[j, c]), X = [state; y], state shifted
  const float* conv_w = nullptr;
  float* conv_state = nullptr;
  float* u = nullptr;
  int32_t conv_dim = 0, conv_k = 0;
  // greedy head: per-block max key of (logit, -row) written to amax[blockIdx.x]
  unsigned long long* amax = nullptr;
};

struct DownArgs {
  DLinear wd, ws;              // routed experts' down (stacked), shared expert's down
  const bf16* act = nullptr;   // [k, I]
  const bf16* sact = nullptr;  // [Is]
  const int32_t* top_idx = nullptr;
  const float* top_w = nullptr;
  const float* sgate = nullptr;  // [1] shared expert gate logit
  float* x = nullptr;            // [H] residual, accumulated
  int32_t k = 0;
};

// Launchers (stream-ordered, no synchronisation), all with programmatic dependent launch (PDL): a kernel may start
// while its predecessor finishes; every decode kernel waits before reading its inputs.
//   proj: 4-bit segments on the tensor cores in 16-row blocks (other formats on scalar lanes within the same
//   launch), or everything on scalar lanes. Returns the number of blocks launched: the length of the amax array the greedy head writes.
//   impl: 0 scalar lanes (gemv.cu), 1 tensor cores with register loads (gemv_tc.cu), 2 tensor cores fed by
//   the bulk copy engine (gemv_bulk.cu; falls back to 1 for launches it cannot take), 3 auto: the fastest
//   measured per kernel (rings for the projections but the routed experts on scalar lanes, bulk MoE down),
//   4 per-warp cp.async rings (gemv_ring.cu) for every projection and the bulk MoE down.
unsigned proj(cudaStream_t st, const ProjArgs& a, int impl);
unsigned proj_scalar(cudaStream_t st, const ProjArgs& a);
unsigned proj_tc(cudaStream_t st, const ProjArgs& a);
unsigned proj_bulk(cudaStream_t st, const ProjArgs& a);
unsigned proj_ring(cudaStream_t st, const ProjArgs& a);
bool ring_launch_ok(const ProjArgs& a);
bool bulk_launch_ok(const ProjArgs& a);
void moe_down(cudaStream_t st, const DownArgs& a, int impl);
void moe_down_scalar(cudaStream_t st, const DownArgs& a);
void moe_down_bulk(cudaStream_t st, const DownArgs& a);
void moe_down_tc(cudaStream_t st, const DownArgs& a);
bool bulk_down_ok(const DownArgs& a);
// Whether the tensor-core path takes this weight: MLX 4-bit, group 64.
bool tc_format(const DLinear& w);
// Upper bound of the blocks of the greedy head over either proj path (the size of the amax array).
int64_t head_blocks(int64_t rows);
}  // namespace lily::cuda::gemv
