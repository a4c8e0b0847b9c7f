// Linear layers on the GPU: y = x W^T with bf16 activations, weights dequantized on the fly, fp32 accumulate.
// One row (outside the fused decode step) takes the warp-per-row GEMV; prefill a tensor-core GEMM: on Hopper the
// wgmma one of gemm_wgmma.cu for 4-bit weights and tiles of 64+ rows, else the mma.sync one of gemm_mma.cu (raw codes
// pipelined, dequantized in registers) where gemm_mma_supported, else the wmma one that dequantizes each weight
// tile into shared memory (dense weights, other groups). All three also run the MoE experts (expert ids read on
// the device).
#pragma once
#include "cuda/common.cuh"

namespace lily::cuda {

// Rows of A, weights and outputs of a grouped (MoE) GEMM; all device pointers.
struct GroupMap {
  const int32_t* n_tiles = nullptr;      // [1] tiles in use
  const int32_t* tile_expert = nullptr;  // [max_tiles]
  const int32_t* tile_row0 = nullptr;    // [max_tiles] first sorted pair of the tile
  const int32_t* tile_rows = nullptr;    // [max_tiles] pairs in the tile (<= the tile_rows given to moe_sort)
  const int32_t* a_rows = nullptr;       // [pairs] row of A per sorted pair (nullptr: A is in sorted order)
  const int32_t* y_rows = nullptr;       // [pairs] output row per sorted pair (nullptr: sorted order)
  const float* scale = nullptr;          // [pairs] multiplies the result (routing weight), or nullptr
  int64_t max_tiles = 0;                 // grid bound
};

// The 4-bit dequantisation both tensor-core GEMMs use, one bf16x2 register of weights at a time.
__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Codes 2p, 2p+1 of a 4-bit word as bf16x2 s*q + b (low half = lower k): the exact value rounded once to
// bf16, as the wmma path stores it. w4 = w >> 4 puts code 2p+1 in the low nibble of byte p. (q | 0x4300) is
// the bf16 128 + q exactly; subtracting 128 is exact too, so only the final fma rounds.
__device__ __forceinline__ uint32_t dequant4_pair(uint32_t w, uint32_t w4, int p, uint32_t s2, uint32_t b2) {
  const uint32_t sel = p | (p << 4) | ((4 + p) << 8) | ((4 + p) << 12);
  const uint32_t v = (__byte_perm(w, w4, sel) & 0x000F000Fu) | 0x43004300u;
  return bf16x2_fma(bf16x2_fma(v, 0x3F803F80u, 0xC300C300u), s2, b2);
}

// Rows per tile of the wmma GEMM (the fallback for weights the mma GEMM does not take: dense, other groups); also
// the most rows per expert tile it holds.
constexpr int kGemmBM = 64;

// Rows of GEMM block tile blockIdx.x: plain tiles cover rows [t*bm, +bm) of M; grouped tiles read their expert,
// first sorted pair and row count from the tile map. False when the tile is past the device's tile count.
__device__ __forceinline__ bool gemm_tile_rows(const kp::GemmParams& gp, const GroupMap& g, int bm, int64_t& r0,
                                               int64_t& e, int& nrows, int t = -1) {
  if (t < 0) t = blockIdx.x;  // (the persistent wgmma GEMM passes its work item's tile)
  e = 0;
  if (gp.grouped) {
    if (t >= *g.n_tiles) return false;
    e = g.tile_expert[t];
    r0 = g.tile_row0[t];
    nrows = g.tile_rows[t];
  } else {
    r0 = static_cast<int64_t>(t) * bm;
    nrows = static_cast<int>(min64(bm, gp.M - r0));
  }
  return true;
}

// Tests and timing only: every GEMM of this process takes the wmma fallback (true) or the normal dispatch (false), so
// tests/kernels/test_cuda_linear.py checks the fallback too and benchmarks/kernels/time_gemm.cu times it.
void force_gemm_fallback(bool on);

// Rows per expert tile (16, 32, 64 or 128) for `pairs` routed pairs over n_experts: the same value must go to
// moe_sort and to grouped_gate_up / grouped_down.
int pick_expert_tile(int64_t pairs, int n_experts);
// Capacity of the tile map (GroupMap::max_tiles) for tiles of tile_rows pairs.
int64_t grouped_max_tiles(int64_t pairs, int n_experts, int tile_rows);

// y[s*ldy + r] (=|+=) sum_i x[s*ldx + i] W[r, i] for s < S, r < W.out. x: bf16 [S, ldx], y: fp32 [S, ldy].
void linear(cudaStream_t st, const DLinear& W, const bf16* x, int64_t ldx, int64_t S, float* y, int64_t ldy,
            bool accumulate = false);
// One output row (gemm_one.cu; linear() takes it for S > 1): y[s*ldy] (=|+=) x[s] . W[0], one warp per token row.
// Supported: quantized 4/8-bit, group % 8 == 0, in % 8 == 0, x rows 16-byte aligned (ldx % 8 == 0).
bool one_output_supported(const DLinear& W, const bf16* x, int64_t ldx);
void linear_one_output(cudaStream_t st, const DLinear& W, const bf16* x, int64_t ldx, int64_t S, float* y, int64_t ldy,
                       bool accumulate);
// A concatenated projection: parts[i] (i < n_parts <= kMaxConcat) are consecutive row views of `concat` (one
// format), y[i] fp32 [S, ldy[i]]: y[i][s * ldy[i] + r] = x[s] . parts[i][r]. One GEMM over the concatenated rows
// where the wgmma or the mma GEMM takes it (their store epilogues route each feature to its part), else one
// linear() per part (concat may then be empty: codes == nullptr).
void linear_concat(cudaStream_t st, const DLinear& concat, const DLinear* parts, int n_parts, const bf16* x,
                    int64_t ldx, int64_t S, float* const* y, const int64_t* ldy);
// y[s, r] = bf16(silu(x W0^T) * (x W1^T)) for s < S; y: bf16 [S, ldy] (gate/up pair of an FFN).
void linear_silu_mul(cudaStream_t st, const DLinear& W0, const DLinear& W1, const bf16* x, int64_t ldx, int64_t S,
                     bf16* y, int64_t ldy);

// Decode MoE, one token: for slot j < k, expert e = ids[j]:
//   act[j, :] = bf16(silu(x W0[e]^T) * (x W1[e]^T))           x: bf16 [H], act: bf16 [k, I]
void experts_gate_up(cudaStream_t st, const DLinear& W0, const DLinear& W1, const int32_t* ids, int k, const bf16* x,
                     bf16* act);
//   d[j, :] = bf16(w[j] * (act[j] W2[e]^T))                    d: bf16 [k, H]
void experts_down(cudaStream_t st, const DLinear& W2, const int32_t* ids, const float* w, int k, const bf16* act,
                  bf16* d);

// Prefill MoE over sorted (token, expert) pairs and the tile map of `g`, built by moe_sort with tile_rows
// (16, 32, 64 or 128; the wmma fallback takes at most kGemmBM):
//   gate/up: act[p, :] = bf16(silu(h[a_rows[p]] W0[e]^T) * (h[a_rows[p]] W1[e]^T))   act: bf16 [pairs, I]
void grouped_gate_up(cudaStream_t st, const DLinear& W0, const DLinear& W1, const GroupMap& g, const bf16* h,
                     int64_t ldh, bf16* act, int tile_rows = kGemmBM);
//   down: d[y_rows[p], :] = bf16(scale[p] * (act[p] W2[e]^T))                          d: bf16 [pairs, H]
// d is bf16 because it is the widest tensor of a prefill layer (pairs = 8 tokens): in fp32 its write (the down's
// epilogue) and its read (moe_combine) were ~270 MB each per layer of a 4K prefill. The model computes its
// expert outputs in bf16 too (mlx-lm's SwitchGLU); the sum over experts stays fp32 (moe_combine).
void grouped_down(cudaStream_t st, const DLinear& W2, const GroupMap& g, const bf16* act, bf16* d,
                  int tile_rows = kGemmBM);

// ---- the mma.sync GEMM (the prefill default) ----
// Tensor-core prefill GEMM for MLX affine-quantized weights (4- or 8-bit codes, group 64): mma.sync m16n8k16
// bf16 -> fp32, a 4-stage cp.async pipeline that copies raw codes + scales/biases (not dequantized bf16),
// and dequantization from shared memory straight into the B fragment registers.
// linear() and grouped_*() (gemm.cu) dispatch here (gemm_mma.cu) wherever gemm_mma_supported and keeps the wmma GEMM as the fallback for the rest.
// The outputs of a concatenated projection (weights_cuda.h: several weights that read one input, stored as
// consecutive rows of one matrix): feature n of part i (begin[i] <= n < begin[i + 1]) lands in
// y[i][row * ldy[i] + n - begin[i]]. parts == 0: one output (GemmMmaArgs::y, gp.ldy). begin[i] past the last part
// is INT64_MAX (linear_concat), so part() needs no part count.
constexpr int kMaxConcat = 4;
struct ConcatOut {
  int parts = 0;
  int64_t begin[kMaxConcat + 1] = {};
  float* y[kMaxConcat] = {};
  int64_t ldy[kMaxConcat] = {};
  __device__ __forceinline__ int part(int64_t n) const {  // the part holding feature n < begin[parts]
    int q = 0;
#pragma unroll
    for (int k = 1; k < kMaxConcat; ++k) q += n >= begin[k];
    return q;
  }
};

// Arguments of gemm_mma_kernel. Plain or grouped rows per gp/g exactly as the wmma GEMM:
//   y[orow, n] (=|+=) scale * (A[arow] . W0[e, n])     fp32 epilogue (store / accumulate)
//   yb[orow, n] = bf16(scale * (A[arow] . W0[e, n]))   bf16 store (yb set, not dual: no accumulate, no concat)
//   yb[orow, n] = bf16(silu(A[arow] . W0[e, n]) * (A[arow] . W1[e, n]))   dual epilogue (FFN gate/up)
struct GemmMmaArgs {
  DLinear W0;                // [E?, out, in] quantized, in % 64 == 0
  DLinear W1;                // dual only: same shape and format as W0
  kp::GemmParams gp;
  GroupMap g;                // grouped only
  const bf16* A = nullptr;   // [rows, lda] bf16, lda % 8 == 0, 16-byte aligned
  float* y = nullptr;        // [rows, ldy] fp32 (store / accumulate)
  bf16* yb = nullptr;        // [rows, ldy] bf16 (dual, or the bf16 store; y is then unused)
  ConcatOut so;             // plain store only: the concatenation's parts' outputs instead of y
};

// Output columns col, col + 1 of a bf16 row (dst = &row[col]): one bf16x2 store when vec (4-byte aligned pairs) and both
// are inside n columns, else the ones inside, one by one. The GEMMs' bf16 epilogues (dual and plain store).
__device__ __forceinline__ void store_bf16_pair(bf16* dst, float o0, float o1, bool vec, int64_t col, int64_t n) {
  if (vec && col + 1 < n) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(o0, o1);
  } else {
    if (col < n) dst[0] = __float2bfloat16(o0);
    if (col + 1 < n) dst[1] = __float2bfloat16(o1);
  }
}

// The bf16 store (yb set, not dual) takes neither accumulate nor a concatenation's parts: throws naming `who`.
inline void check_bf16_store(const GemmMmaArgs& a, bool dual, const char* who) {
  if (!dual && a.yb && (a.gp.accumulate || a.so.parts > 0))
    throw std::invalid_argument(std::string("[lily] ") + who + ": the bf16 store takes neither accumulate nor concatenated outputs");
}

// True when the mma path runs this product: kind 0, 4 or 8 bits, group 64, in % 64 == 0, 16-byte aligned
// codes and A rows; W1 (dual, may be nullptr) must match W0. Otherwise callers use the wmma GEMM.
bool gemm_mma_supported(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda);

// Rows per block tile (16/32/64/128) of a plain GEMM with M rows and `cols` output columns.
int gemm_mma_plain_rows(int64_t M, int64_t cols, bool dual);

// Launches the kernel with `bm` rows per tile (16, 32, 64 or 128). Grouped tiles must hold <= bm rows.
void gemm_mma(cudaStream_t st, const GemmMmaArgs& a, bool dual, int bm);

// ---- the wgmma GEMM (gemm_wgmma.cu; the prefill GEMM for 4-bit weights on Hopper) ----
// The same products and epilogues as gemm_mma (GemmMmaArgs), the weights as warpgroup MMA's register operand:
// 4-bit, group 64, in % 64 == 0, 16-byte aligned codes and A rows, compute capability 9.0 built for sm_90a.
// linear() / linear_silu_mul() take it from 64 rows, grouped_*() for expert tiles of more than 32 rows; smaller
// products (bandwidth-bound: few rows per weight) and 8-bit weights keep the mma.sync GEMM.
bool gemm_wgmma_supported(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda);
// Launches with `tokens` (64 or 128) rows of A per tile; grouped tiles must hold <= tokens rows.
void gemm_wgmma(cudaStream_t st, const GemmMmaArgs& a, bool dual, int tokens);

}  // namespace lily::cuda
