// The decode GEMV over M = 1..8 input rows (issue 43: the speculative verify and batched streams): y[m] = x[m] W^T
// for up to kMaxSegs 4- or 8-bit weight matrices that read the same M rows ("segments", as gemv.cuh's proj), each weight
// fragment dequantised once for all M rows. Every row's sums run in an order that depends on the shapes alone, never
// on M, so row m of an M-row launch equals a one-row launch of x[m] bit for bit (the engine's exact rows).
//
// Layout (gemv_rows.cu): the tensor-core tile in its natural orientation, A = 16 weight rows x 16 elements (lane
// (gid, tig) holds rows gid and gid + 8), B = the same 16 elements of the M input rows (column gid = input row gid,
// zero past M), so D[row][m] is row `row`'s dot product with input row m: one mma serves all M rows at the cost of one.
// Staging: RMSNorm of fp32 rows (block 0 also writes the bf16 rows) or bf16 rows, packed in shared memory as the B
// fragments. Outputs per segment: store (fp32, optional per-row block argmax keys: the greedy head), accumulate
// (residual add), SiLU(gate) * up (bf16), the DeltaNet causal conv + SiLU over the M rows in order (its state kept);
// the routing prologue and the routed experts' gate/up (each distinct expert of the rows' choices read once).
//
// The experts' down: a routed store segment whose rows are each slot's activations (xrouted), beside the shared expert's
// down (a segment with its own input rows), then moe_combine. 8-bit weights (the router, the shared expert's gate: store
// and accumulate segments) split each code into its two nibbles on the same tile. Not here: dense weights (test models).
#pragma once
#include "cuda/common.cuh"

namespace lily::cuda::rows {

constexpr int kMaxRows = 8;  // M: the mma's n extent
constexpr int kMaxSegs = 4;
constexpr int kMaxTopK = 16;      // routed experts per row at most
constexpr int kMaxExperts = 256;  // experts of a routed segment at most (route_topk_warp: 8 a lane)

enum XMode : int32_t { kXBf16 = 0, kXNorm = 1 };
enum OMode : int32_t { kOStore = 0, kOAccum = 1, kODual = 2, kOConv = 3 };
constexpr int kMaxConvK = 4;  // conv taps at most

struct Seg {
  DLinear w0, w1;      // w1: the up projection of a dual segment (same shape and format as w0)
  float* y = nullptr;  // store / accumulate: fp32 [M, ldy]
  bf16* yb = nullptr;  // dual: bf16 [M, ldy]
  int64_t ldy = 0;     // row stride of the output (>= w0.p.out)
  int32_t mode = kOStore;
  // routed (a dual segment over stacked experts [E, out, in], the routing below): expert u of the rows' distinct
  // choices is streamed once for all of them; row m's slot j output at yb + (m * top_k + j) * ldy
  int32_t routed = 0;
  // own bf16 input rows [M, ldx] instead of the launch's (the shared expert's down beside the experts'); xrouted (a
  // routed store segment: the experts' down): row m's input for expert e is xb + (m * top_k + j) * ldx, j its slot
  const bf16* xb = nullptr;
  int64_t ldx = 0;
  int32_t xrouted = 0;
};

struct Args {
  Seg seg[kMaxSegs];
  int32_t nseg = 0;
  int32_t rows = 1;            // M, 1..kMaxRows
  int32_t in = 0;              // input length (every segment's W.p.in)
  int32_t xmode = kXBf16;
  float eps = 0.f;
  const bf16* xb = nullptr;    // bf16 rows [M, ldx]
  const float* xf = nullptr;   // norm: fp32 rows [M, ldx]
  const float* nw = nullptr;   // norm weight [in]
  int64_t ldx = 0;             // row stride of the input (>= in)
  bf16* h_out = nullptr;       // norm: block 0 also writes the normed rows bf16 [M, in]
  // greedy head (one store segment): per block and row the max key of (logit, -row), amax[block * M + m]
  unsigned long long* amax = nullptr;
  // conv epilogue (one kOConv segment, its rows the C = conv_dim channels): with X = [conv_state; y] ([K-1+M, C],
  // y the segment's products of the M rows) u[m][c] = silu(sum_j<K w[c][j] X[m + j][c]) (each row's window in the
  // one-row order), conv_state <- X's last K-1 rows, and conv_hist (nullable) <- X (row t's state: X[t+1 .. t+K-1],
  // a rejected draft's rollback)
  const float* conv_w = nullptr;  // fp32 [C, K]
  float* conv_state = nullptr;    // fp32 [K-1, C], in place
  float* u = nullptr;             // fp32 [M, C]
  float* conv_hist = nullptr;     // fp32 [K-1+M, C]
  int32_t conv_k = 0;
  // routing (a routed segment): softmax top-k of each row's E router logits (common.cuh's route_topk_warp), block 0
  // writes the choice
  const float* rlogits = nullptr;  // fp32 [M, E]
  int32_t E = 0, top_k = 0, norm_topk = 0;
  int32_t* top_idx = nullptr;  // [M, top_k]
  float* top_w = nullptr;      // [M, top_k]
  int32_t route_from_idx = 0;  // the routing read from top_idx (the experts' down after their gate/up)
};

// The MoE's combine after the experts' down (a routed store segment into yx) and the shared expert's (ysh):
// x[m] += sum_j top_w[m][j] yx[m][j] + sigmoid(sgate[m]) ysh[m], the slots in order (each row as M = 1 sums it).
struct CombineArgs {
  const float* yx = nullptr;     // [M, k, H]
  const float* ysh = nullptr;    // [M, H] (null: no shared expert)
  const float* top_w = nullptr;  // [M, k]
  const float* sgate = nullptr;  // [M] the shared expert's gate logits
  float* x = nullptr;            // [M, H] the residual, accumulated
  int32_t M = 1, k = 0, H = 0;
};
void moe_combine(cudaStream_t st, const CombineArgs& a);

// Launches (stream-ordered, PDL like gemv.cuh's proj); returns the blocks launched (amax holds blocks * M keys).
unsigned proj(cudaStream_t st, const Args& a);
// Whether the M-row GEMV takes this weight: MLX affine 4- or 8-bit with a power-of-two group >= 64 and an input length
// that is a multiple of 64, at most 8192.
bool fits(const DLinear& w);
// Upper bound of the blocks proj launches for `rows` output rows of one segment (the head's amax array / M).
int64_t head_blocks(int64_t rows);

}  // namespace lily::cuda::rows
