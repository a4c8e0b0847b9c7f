// Fused decode (one token) kernels of the CUDA backend: fewer launches per step and no host work inside a
// step, so the whole step can be captured as one CUDA graph (backend_cuda.cu).
//
//   proj   : y = x W^T over up to kMaxSegs weight matrices that read the same input row ("segments", row
//            ranges of one launch), with the input staged in shared memory by a prologue that also does the
//            producer's normalisation: RMSNorm of the fp32 residual, the DeltaNet gated RMSNorm, or a plain
//            bf16 copy. Output per segment: store, accumulate (residual add), SiLU(gate)*up (bf16), or the
//            DeltaNet causal conv + SiLU with its state update. Optional routing prologue (softmax top-k
//            of the router logits; segment slot j reads expert top_idx[j]) and block argmax (greedy head).
//   down   : x[r] += sum_j w_j (act_j . Wdown[e_j][r]) + sigmoid(g) (sact . Wsh_down[r])  (MoE combine fused)
//   scan   : DeltaNet recurrence for one token with the q/k l2 normalisation fused in.
//   finish : argmax over the head's block maxima -> the next step's token (device control block).
#pragma once
#include "cuda/common.cuh"

namespace lily::cuda::dec {

constexpr int kMaxSegs = 4;
constexpr int kMaxTopK = 16;

enum XMode : int32_t { kXBf16 = 0, kXNorm = 1, kXGated = 2 };
enum OMode : int32_t { kOStore = 0, kOAccum = 1, kODual = 2, kOConv = 3 };

// Device control block of the decode steps: two slots alternate by step parity (DecodeStep::index & 1). Step p
// reads its token, position and uniform from slot[p] (the host writes them, except a token the previous step drew)
// and writes the token it draws into slot[1 - p].token, the next step's input.
struct StepSlot {
  int32_t token;  // input token of the step
  int32_t pos;    // its position
  float uniform;  // device sampling: the step's draw in [0, 1)
  int32_t pad_;
};
struct StepCtl {
  StepSlot slot[2];
};

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
//   impl: 0 scalar lanes (decode.cu), 1 tensor cores with register loads (decode_tc.cu), 2 tensor cores fed by
//   the bulk copy engine (decode_bulk.cu; falls back to 1 for launches it cannot take), 3 auto: the fastest
//   measured per kernel (rings for the projections but the routed experts on scalar lanes, bulk MoE down),
//   4 per-warp cp.async rings (decode_ring.cu) for every projection and the bulk MoE down.
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
bool bulk_down_ok(const DownArgs& a);
// Whether the tensor-core path takes this weight: MLX 4-bit, group 64.
bool tc_format(const DLinear& w);
// DeltaNet decode scan: u [C] post-conv (q, k not yet l2-normalised), b/a [Hv], ssm updated, y [Hv*Dv].
void deltanet_scan(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y);
// Upper bound of the blocks of the greedy head over either proj path (the size of the amax array).
int64_t head_blocks(int64_t rows);
// *token = the argmax (lowest row on ties) over the head's block maxima amax[n].
void finish(cudaStream_t st, const unsigned long long* amax, int n, int32_t* token);

}  // namespace lily::cuda::dec
