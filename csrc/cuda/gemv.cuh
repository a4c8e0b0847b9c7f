// The decode GEMVs (one token): fused projections of the CUDA backend's decode step, fewer launches per step and
// no host work inside it, so the whole step can be captured as one CUDA graph (backend_cuda.cu). One kernel
// (gemv.cu) serves both entry points:
//
//   proj     : y = x W^T over up to kMaxSegs weight matrices that read the same input row ("segments", row
//              ranges of one launch), with the input staged in shared memory by a prologue that also does the
//              producer's normalisation: RMSNorm of the fp32 residual, or a plain bf16 copy (the DeltaNet
//              gated RMSNorm is deltanet_step's, which writes the out-projection's bf16 row). Output per
//              segment: store, accumulate (residual add), SiLU(gate)*up (bf16), or the
//              DeltaNet causal conv + SiLU with its state update. Optional routing prologue (softmax top-k
//              of the router logits; segment slot j reads expert top_idx[j]) and block argmax (greedy head).
//   moe_down : x[r] += sum_j w_j (act_j . Wdown[e_j][r]) + sigmoid(g) (sact . Wsh_down[r])  (MoE combine fused):
//              the same kernel with the experts' rows side by side along K.
// (The one-token DeltaNet scan is deltanet.cu's deltanet_step; the greedy head's argmax sample.cu's
// argmax_from_block_keys.)
#pragma once
#include "cuda/common.cuh"

namespace lily::cuda::gemv {

constexpr int kMaxSegs = 4;
constexpr int kMaxTopK = 16;

enum XMode : int32_t { kXBf16 = 0, kXNorm = 1 };
enum OMode : int32_t { kOStore = 0, kOAccum = 1, kODual = 2, kOConv = 3 };

struct Seg {
  DLinear w0, w1;        // w1: the up projection of a DUAL segment (same shape and format as w0)
  float* y = nullptr;    // fp32 output (store / accumulate)
  bf16* yb = nullptr;    // bf16 output (dual)
  int32_t mode = kOStore;
  int32_t routed = 0;    // 1: slot j uses expert top_idx[j] (routing prologue); 0: expert 0
  int32_t slots = 1;     // copies of the segment over slots (experts); output slot j at y + j * y_step
  int32_t pad_ = 0;
  int64_t y_step = 0;
};

struct ProjArgs {
  Seg seg[kMaxSegs];
  int32_t nseg = 0;
  int32_t xmode = kXBf16;
  int32_t in = 0;          // input length (every segment's W.p.in)
  float eps = 0.f;
  int32_t route = 0;       // routing prologue (segments with routed = 1 need it)
  const float* xf = nullptr;   // norm: fp32 residual row
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

// Launchers (stream-ordered, no synchronisation), with programmatic dependent launch (PDL): a kernel starts while
// its predecessor finishes and issues its first weight loads (which never depend on it) before it waits.
// proj returns the number of blocks launched: the length of the amax array the greedy head writes.
unsigned proj(cudaStream_t st, const ProjArgs& a);
void moe_down(cudaStream_t st, const DownArgs& a);
// Whether the decode GEMV takes this weight: MLX affine 4-bit with a power-of-two group >= 64 (the tensor-core
// tile sums 64 elements under one scale) or 8-bit with one >= 32, or dense
// bf16 / fp32, and an input length that is a multiple of 32 (at most 8192).
bool fits(const DLinear& w);
// The RMSNorm staging takes inputs of at most this many elements (each thread's share fetched once).
constexpr int kMaxNormIn = 4096;
// Whether moe_down takes this pair (both fit and share one format: the kernel's lanes stream them side by side).
bool down_fits(const DLinear& wd, const DLinear& ws);
// Upper bound of the blocks proj launches for `rows` output rows (the size of the greedy head's amax array).
int64_t head_blocks(int64_t rows);
}  // namespace lily::cuda::gemv
