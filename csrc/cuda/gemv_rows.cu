// The decode GEMV over M = 1..8 input rows (gemv_rows.cuh).
//
// Work layout. A launch's segments are parts stacked along the output rows; a part's rows are cut into tiles of 16
// (a dual part: 8 gate rows and the same 8 up rows, so SiLU(gate) * up pairs up in the epilogue). The input is cut into
// k blocks of 64 elements (one scale at group 64) and chunks of 4 blocks; the chunks are spread over `slices` warps of
// a block (split-K, at most 8, a function of the input length only) and a warp's tiles walk its chunks. A block's
// mwarps x slices warps run in rounds: in round r warp (m, s) computes tile r of its run (tpw tiles, all in one part)
// over its chunks, writes its partial sums to shared memory, and after one barrier the block sums the slices in slice
// order and runs the epilogue for that round's tiles (the partial buffers alternate by round, so one barrier a round
// suffices). The next step's weights are loaded before this step's math (a register double buffer).
//
// The tile (lane gid = lane / 4, tig = lane % 4; mma_bf16.cuh's fragment layouts): per k block the lane loads 8 bytes
// (16 codes, elements 16 tig .. 16 tig + 15 of the block) of rows gid and gid + 8; its mma k slots hold them as gemv.cu's
// 4-bit tile does (mma i takes word i / 2, nibble pairs (j0, j0 + 4) and (j0 + 1, j0 + 5), j0 = 2 (i % 2), each as the
// exact bf16 128 + q), and B column gid holds input row gid at the same elements (packed once in shared memory by the
// staging; zero for gid >= M). So D[row][m] = 128 X[m] + sum q x[m] over the block, X the block's sum of x[m], and the
// block's term is s (D - 128 X) + b X = s D + (b - 128 s) X in fp32 (two FMA a value), summed over blocks and chunks
// in order. Nothing in a row's arithmetic depends on the other rows or on M (the mma's columns are independent), hence
// the exact rows.
#include "cuda/gemv_rows.cuh"
#include "cuda/gemv_rows_route.cuh"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "cuda/gemv_lane.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda::rows {
namespace {

using gemv::ld_stream8;
using gemv::q4_pair;

constexpr int kTile = 16;       // weight rows per tile: the mma's m extent
constexpr int kBlk = 64;        // elements per k block
constexpr int kChunkBlks = 4;   // k blocks per chunk (a warp's step)
constexpr int kWarps = 8;       // warps per block at most
constexpr int kMaxTpw = 256;
constexpr int kMaxIn = 8192;

struct Part {
  const uint8_t *w0, *w1;
  const uint16_t *s0, *b0, *s1, *b1;
  int32_t row_bytes, row_groups, rows, tiles, first, seg, dual, gsh;  // gsh: log2(group / 64)
  int32_t q8;                           // 8-bit codes: a tile is 8 rows, each as its high and low nibbles
  int32_t routed, tpe;                  // routed: tiles = (max distinct experts) x tpe, a warp's run in one expert
  int32_t xrouted;                      // (routed) row m's input: its slot's row of xsrc for the block's expert
  int64_t expert_bytes, expert_groups;  // per expert of a stacked weight
  const bf16* xsrc;                     // own bf16 input rows (null: the launch's); a block holds one part then
  int64_t ldx;                          // xsrc's row stride
};

struct Launch {
  Part part[kMaxSegs];
  int32_t nparts = 0, M = 1, in = 0, nblk = 0, nchunk = 0, slices = 1, cps = 1, mwarps = 1, tpw = 1;
  int32_t xmode = kXBf16, sbvec = 0;
  float eps = 0.f;
  const bf16* xb = nullptr;
  const float* xf = nullptr;
  const float* nw = nullptr;
  int64_t ldx = 0;
  bf16* h_out = nullptr;
  float* y[kMaxSegs] = {};
  bf16* yb[kMaxSegs] = {};
  int64_t ldy[kMaxSegs] = {};
  int32_t mode[kMaxSegs] = {};
  unsigned long long* amax = nullptr;
  const float* conv_w = nullptr;
  float *conv_state = nullptr, *u = nullptr, *conv_hist = nullptr;
  int32_t conv_k = 0, conv_part = -1;  // the conv segment's part (-1: none)
  RouteArgs route = {};   // (a routed segment's; route_from_idx: read from top_idx, the experts' down)
  int32_t routed_part = -1;  // the routed segment's part (-1: none)
  int32_t own_inputs = 0;    // parts read their own input rows (block_row): a block lies in one part
};

struct Smem {
  float red[kWarps][kMaxRows];
  float inv[kMaxRows];
  unsigned long long key[kMaxRows];
  const bf16* xrow[kMaxRows];  // own_inputs launches: the block's bf16 input rows (null: a zero row)
  Route rt;
};

// Shared memory: the B fragments xs uint4 [nblk][2 words][M][4 tig], the block sums xsum fp32 [nblk][8] (zero past
// M), the partial sums fp32 [2 rounds][mwarps * 16 * M][slices].
__host__ __device__ size_t xs_bytes(int nblk, int M) { return static_cast<size_t>(nblk) * 2 * M * 4 * 16; }
__host__ __device__ size_t xsum_bytes(int nblk) { return static_cast<size_t>(nblk) * 8 * 4; }
__host__ __device__ size_t partial_floats(const Launch& g) { return static_cast<size_t>(g.mwarps) * kTile * g.M * g.slices; }
size_t smem_bytes(const Launch& g) { return xs_bytes(g.nblk, g.M) + xsum_bytes(g.nblk) + 2 * partial_floats(g) * 4; }

__device__ __forceinline__ float bits_f(uint32_t h16) { return __uint_as_float(h16 << 16); }

// One thread's 8 consecutive input elements e .. e + 7 of row m, as the B fragment words of lane (m, tig) for word w
// of its block (e = 64 blk + 16 tig + 8 w): word j = bf16x2(x[e + j], x[e + j + 4]) (gemv_lane.cuh's k slots).
// Every row is staged the same way whatever M is: its norm sums its elements in the order of threads and warps,
// and a block's sum X is a fixed tree over its 8 threads.
// units a thread has in flight while staging (their loads issued together): 8 bf16 or 4 fp32 (32 registers)
template <int XMODE>
constexpr int kStageBatch = XMODE == kXNorm ? 4 : 8;

// Units (row m, elements e .. e + 7) of the flattened [M][in / 8] index i = tid + j * blockDim.x: a row's units land on
// the same threads whatever M is (the row's offset m * in / 8 does not depend on M).
struct StageUnit {
  int m, e;
  bool on;
};
__device__ __forceinline__ StageUnit stage_unit(int i, int total, int n8) {
  const bool on = i < total;
  return {on ? i / n8 : 0, on ? 8 * (i % n8) : 0, on};
}

// One thread's 8 consecutive input elements e .. e + 7 of row m, as the B fragment words of lane (m, tig) for word w
// of its block (e = 64 blk + 16 tig + 8 w): word j = bf16x2(x[e + j], x[e + j + 4]) (gemv_lane.cuh's k slots).
// Every row is staged the same way whatever M is: its norm sums its elements in the order of threads and warps,
// and a block's sum X is a fixed tree over its 8 threads. Loads go out kStageBatch units at a time.
template <int XMODE>
__device__ void stage(const Launch& g, uint4* xs, float* xsum, Smem& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nth = blockDim.x, nw = nth >> 5;
  const int n8 = g.in / 8, total = g.M * n8;  // total: a multiple of 8, so a block's 8 units share a warp and a batch
  float4 held[kStageBatch<XMODE>][2];          // the norm's last batch of fp32 rows (all of them when `kept` below)
  if constexpr (XMODE == kXNorm) {
    float ss[kMaxRows];
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) ss[m] = 0.f;
    for (int j0 = 0; j0 * nth < total; j0 += kStageBatch<XMODE>) {
      float4 (&raw)[kStageBatch<XMODE>][2] = held;
#pragma unroll
      for (int b = 0; b < kStageBatch<XMODE>; ++b) {
        const StageUnit u = stage_unit(tid + (j0 + b) * nth, total, n8);
        const float4* p = reinterpret_cast<const float4*>(g.xf + u.m * g.ldx + u.e);
        raw[b][0] = u.on ? p[0] : make_float4(0.f, 0.f, 0.f, 0.f);
        raw[b][1] = u.on ? p[1] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < kStageBatch<XMODE>; ++b) {
        const StageUnit u = stage_unit(tid + (j0 + b) * nth, total, n8);
        const float v[8] = {raw[b][0].x, raw[b][0].y, raw[b][0].z, raw[b][0].w,
                            raw[b][1].x, raw[b][1].y, raw[b][1].z, raw[b][1].w};
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) q = fmaf(v[k], v[k], q);
#pragma unroll
        for (int m = 0; m < kMaxRows; ++m)
          if (u.on && m == u.m) ss[m] += q;
      }
    }
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m >= g.M) break;
      const float t = warp_sum(ss[m]);
      if (lane == 0) sm.red[warp][m] = t;
    }
    __syncthreads();
    if (tid < g.M) {
      float v = 0.f;
      for (int w = 0; w < nw; ++w) v += sm.red[w][tid];
      sm.inv[tid] = rsqrtf(v / static_cast<float>(g.in) + g.eps);
    }
    __syncthreads();
  }
  const bool write_h = XMODE == kXNorm && g.h_out != nullptr && blockIdx.x == 0;
  // the norm's second pass reads the rows again unless the first pass's one batch held them all (kept below)
  const bool kept = XMODE == kXNorm && kStageBatch<XMODE> * nth >= total;
  for (int j0 = 0; j0 * nth < total; j0 += kStageBatch<XMODE>) {
    uint4 raw[kStageBatch<XMODE>][XMODE == kXNorm ? 2 : 1];
#pragma unroll
    for (int b = 0; b < kStageBatch<XMODE>; ++b) {
      if constexpr (XMODE == kXNorm) {
        if (kept) {
          raw[b][0] = *reinterpret_cast<const uint4*>(&held[b][0]);
          raw[b][1] = *reinterpret_cast<const uint4*>(&held[b][1]);
          continue;
        }
      }
      const StageUnit u = stage_unit(tid + (j0 + b) * nth, total, n8);
      if constexpr (XMODE == kXNorm) {
        const uint4* p = reinterpret_cast<const uint4*>(g.xf + u.m * g.ldx + u.e);
        raw[b][0] = u.on ? p[0] : make_uint4(0u, 0u, 0u, 0u);
        raw[b][1] = u.on ? p[1] : make_uint4(0u, 0u, 0u, 0u);
      } else {
        const bf16* row = !u.on ? nullptr : g.own_inputs ? sm.xrow[u.m] : g.xb + u.m * g.ldx;
        raw[b][0] = row ? *reinterpret_cast<const uint4*>(row + u.e) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int b = 0; b < kStageBatch<XMODE>; ++b) {
      if ((j0 + b) * nth >= total) break;  // (uniform: the block's threads leave together)
      const StageUnit u = stage_unit(tid + (j0 + b) * nth, total, n8);
      float v[8];
      if constexpr (XMODE == kXNorm) {
        const uint32_t r[8] = {raw[b][0].x, raw[b][0].y, raw[b][0].z, raw[b][0].w,
                               raw[b][1].x, raw[b][1].y, raw[b][1].z, raw[b][1].w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const bf16 h = __float2bfloat16(__uint_as_float(r[k]) * sm.inv[u.m] * (u.on ? g.nw[u.e + k] : 0.f));
          if (write_h && u.on) g.h_out[u.m * static_cast<int64_t>(g.in) + u.e + k] = h;
          v[k] = __bfloat162float(h);
        }
      } else {
        const uint32_t w4[4] = {raw[b][0].x, raw[b][0].y, raw[b][0].z, raw[b][0].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) v[2 * k] = bits_f(w4[k] & 0xFFFFu), v[2 * k + 1] = __uint_as_float(w4[k] & 0xFFFF0000u);
      }
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) s += v[k];
      s += __shfl_xor_sync(0xFFFFFFFFu, s, 1);  // (commutative pairs: the 8 lanes end with the same bits)
      s += __shfl_xor_sync(0xFFFFFFFFu, s, 2);
      s += __shfl_xor_sync(0xFFFFFFFFu, s, 4);
      if (!u.on) continue;
      const int blk = u.e / kBlk, tig = (u.e % kBlk) / 16, w = (u.e % 16) / 8;
      xs[(blk * 2 + w) * g.M * 4 + u.m * 4 + tig] =
          make_uint4(mma::pack_bf16x2(v[0], v[4]), mma::pack_bf16x2(v[1], v[5]), mma::pack_bf16x2(v[2], v[6]),
                     mma::pack_bf16x2(v[3], v[7]));
      if ((tid & 7) == 0) xsum[blk * 8 + u.m] = s;
    }
  }
  for (int i = tid; i < g.nblk * 8; i += nth)
    if (i % 8 >= g.M) xsum[i] = 0.f;
}

// A lane's loads of one step: rows gid / gid + 8 (h), the chunk's 4 blocks (8 bytes each), and the rows' scales and
// biases of those blocks (bf16 pairs: blocks 0-1 in .x, 2-3 in .y).
struct Step {
  uint2 q[2][kChunkBlks];
  uint2 s[2], b[2];
};

struct Cursor {
  const uint8_t* w[2];
  const uint16_t *s[2], *b[2];
  int32_t row_bytes, row_groups, last, gsh, step, blk_bytes, r[2];

  // Part P (expert e of a stacked weight; 0 otherwise). 4-bit: h = 0 / 1 are the tile's rows gid / gid + 8 (a dual
  // part: the gate's and the up's row gid), 8 bytes a block each; 8-bit: bytes 0-7 / 8-15 of row gid's 16 a block.
  __device__ __forceinline__ void setup(const Part& P, int64_t e, int gid, int tig) {
    const int64_t wo = e * P.expert_bytes + (P.q8 ? 16 : 8) * tig, go = e * P.expert_groups;
    w[0] = P.w0 + wo, s[0] = P.s0 + go, b[0] = P.b0 + go;
    w[1] = (P.dual ? P.w1 : P.w0) + wo + (P.q8 ? 8 : 0);
    s[1] = (P.dual ? P.s1 : P.s0) + go, b[1] = (P.dual ? P.b1 : P.b0) + go;
    row_bytes = P.row_bytes, row_groups = P.row_groups, last = P.rows - 1, gsh = P.gsh;
    step = P.dual || P.q8 ? kTile / 2 : kTile;
    blk_bytes = P.q8 ? 64 : 32;
    r[0] = gid, r[1] = P.dual || P.q8 ? gid : gid + 8;
  }
  // Step (tile lt, chunk c of nb blocks); rows past the part's last are clamped (the epilogue drops them).
  __device__ __forceinline__ void load(int lt, int c, int nb, bool sbvec, Step& S) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int R = min(step * lt + r[h], last);
      const uint8_t* p = w[h] + static_cast<uint32_t>(R * row_bytes) + kChunkBlks * blk_bytes * c;
#pragma unroll
      for (int k = 0; k < kChunkBlks; ++k) S.q[h][k] = k < nb ? ld_stream8(p + blk_bytes * k) : make_uint2(0u, 0u);
      const uint32_t g0 = static_cast<uint32_t>(R * row_groups);
      if (sbvec) {  // group 64, 4 groups a chunk, 8-byte aligned
        S.s[h] = __ldg(reinterpret_cast<const uint2*>(s[h] + g0 + 4 * c));
        S.b[h] = __ldg(reinterpret_cast<const uint2*>(b[h] + g0 + 4 * c));
      } else {
        uint32_t sv[kChunkBlks], bv[kChunkBlks];
#pragma unroll
        for (int k = 0; k < kChunkBlks; ++k) {
          const uint32_t gi = g0 + ((kChunkBlks * c + (k < nb ? k : 0)) >> gsh);
          sv[k] = __ldg(s[h] + gi), bv[k] = __ldg(b[h] + gi);
        }
        S.s[h] = make_uint2(sv[0] | sv[1] << 16, sv[2] | sv[3] << 16);
        S.b[h] = make_uint2(bv[0] | bv[1] << 16, bv[2] | bv[3] << 16);
      }
    }
  }
};

__device__ __forceinline__ float half_of(const uint2& v, int k) {
  const uint32_t w = k >> 1 ? v.y : v.x;
  return __uint_as_float(k & 1 ? (w & 0xFFFF0000u) : (w << 16));
}

// One step's math. 4-bit: tot[(row gid, col 2 tig), (gid, 2 tig + 1), (gid + 8, 2 tig), (gid + 8, 2 tig + 1)] += the
// chunk's blocks in order. 8-bit (Q8): row gid's 16 codes a block (elements 16 tig + b, b = 0..15: bytes 0-7 in
// S.q[0], 8-15 in S.q[1]) as two 4-bit rows, its high nibbles in mma row gid and its low ones in row gid + 8, each exact
// as bf16 128 + n in the 4-bit tile's k slots; with q = 16 hi + lo the block's term is
// s (16 D_hi + D_lo - 2176 X) + b X = s (16 D_hi + D_lo) + (b - 2176 s) X, into tot[0] / tot[1] (row gid, columns 2 tig
// and 2 tig + 1). NB > 0: the blocks of a whole chunk as a constant (every chunk but a short last one), so the blocks'
// independent mma chains interleave (a runtime count's early exit kept each block's 4 dependent mma apart: the "wait"
// stalls); each block's sums run in the same order either way.
template <int NB, bool Q8>
__device__ __forceinline__ void step_math(const Launch& g, const Step& S, int c, int nb, const uint4* xs,
                                          const float* xsum, int gid, int tig, float (&tot)[4]) {
  const int lane = gid * 4 + tig;
  const int n = NB > 0 ? NB : nb;
  float d[kChunkBlks][4];
#pragma unroll
  for (int k = 0; k < kChunkBlks; ++k) {
    if (NB == 0 && k >= n) break;
    const int blk = kChunkBlks * c + k;
    uint4 h0 = make_uint4(0u, 0u, 0u, 0u), h1 = h0;
    if (gid < g.M) h0 = xs[(blk * 2) * g.M * 4 + lane], h1 = xs[(blk * 2 + 1) * g.M * 4 + lane];
    const uint32_t bx[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const uint32_t u[4] = {S.q[0][k].x, S.q[0][k].y, S.q[1][k].x, S.q[1][k].y};
    d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int w = i >> 1, j0 = 2 * (i & 1);
      uint32_t a[4];
      if constexpr (Q8) {  // bytes j and j + 4 of the 8-element word w at bits 0-7 and 16-23 (byte b: word b / 4)
        const uint32_t p0 = __byte_perm(u[2 * w], u[2 * w + 1], j0 | (4 + j0) << 8);
        const uint32_t p1 = __byte_perm(u[2 * w], u[2 * w + 1], (j0 + 1) | (5 + j0) << 8);
        a[0] = q4_pair(p0, 1), a[1] = q4_pair(p0, 0), a[2] = q4_pair(p1, 1), a[3] = q4_pair(p1, 0);
      } else {  // rows gid / gid + 8: u[w] / u[2 + w]
        a[0] = q4_pair(u[w], j0), a[1] = q4_pair(u[2 + w], j0), a[2] = q4_pair(u[w], j0 + 1);
        a[3] = q4_pair(u[2 + w], j0 + 1);
      }
      mma::mma_bf16(d[k], a, bx[2 * i], bx[2 * i + 1]);
    }
  }
#pragma unroll
  for (int k = 0; k < kChunkBlks; ++k) {
    if (NB == 0 && k >= n) break;
    const int blk = kChunkBlks * c + k;
    const float2 X = *reinterpret_cast<const float2*>(xsum + blk * 8 + 2 * tig);
    const float s0 = half_of(S.s[0], k), b0 = half_of(S.b[0], k);
    if constexpr (Q8) {
      const float c0 = fmaf(-2176.f, s0, b0);
      tot[0] = fmaf(s0, fmaf(16.f, d[k][0], d[k][2]), fmaf(c0, X.x, tot[0]));
      tot[1] = fmaf(s0, fmaf(16.f, d[k][1], d[k][3]), fmaf(c0, X.y, tot[1]));
    } else {
      // s (D - 128 X) + b X = s D + (b - 128 s) X: two FMA a value (the 128 s X inside s D cancels against c X)
      const float s1 = half_of(S.s[1], k), b1 = half_of(S.b[1], k);
      const float c0 = fmaf(-128.f, s0, b0), c1 = fmaf(-128.f, s1, b1);
      tot[0] = fmaf(s0, d[k][0], fmaf(c0, X.x, tot[0]));
      tot[1] = fmaf(s0, d[k][1], fmaf(c0, X.y, tot[1]));
      tot[2] = fmaf(s1, d[k][2], fmaf(c1, X.x, tot[2]));
      tot[3] = fmaf(s1, d[k][3], fmaf(c1, X.y, tot[3]));
    }
  }
}

__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t row) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | (0xFFFFFFFFull - static_cast<uint32_t>(row));
}

// The block's bf16 input row m (a block lies in one part where parts have their own inputs): the launch's, the part's,
// or for an expert's part (xrouted) the row's slot that chose the block's expert (its first such slot: a row that
// chose one expert in several slots (a non-finite row) made the same row for each); null where row m chose another.
__device__ __forceinline__ const bf16* block_row(const Launch& g, const Smem& sm, int m) {
  if (m >= g.M) return nullptr;
  const int Tb = blockIdx.x * g.mwarps * g.tpw;
  int q = 0;
  while (q + 1 < g.nparts && Tb >= g.part[q + 1].first) ++q;
  const Part& P = g.part[q];
  if (!P.xsrc) return g.xb ? g.xb + m * g.ldx : nullptr;
  if (!P.xrouted) return P.xsrc + m * P.ldx;
  const int u = (Tb - P.first) / P.tpe;
  const uint32_t mask = u < sm.rt.U ? sm.rt.slots[u][m] : 0u;
  return mask ? P.xsrc + (static_cast<int64_t>(m) * g.route.top_k + __ffs(mask) - 1) * P.ldx : nullptr;
}

// Output row `row` of input row `col` (tile lt of part P) to y (bf16 for a dual part, fp32 otherwise): a routed part's
// tile lies in expert u = lt / tpe, and the value goes to each slot of row col that chose it (none: another row's).
template <class T>
__device__ __forceinline__ void slot_out(const Launch& g, const Part& P, T* y, int lt, int col, int64_t row, T v,
                                         const Smem& sm) {
  const int64_t ld = g.ldy[P.seg];
  if (!P.routed) {
    y[col * ld + row] = v;
    return;
  }
  const int u = lt / P.tpe;
  if (u >= sm.rt.U) return;
  for (uint32_t mask = sm.rt.slots[u][col]; mask; mask &= mask - 1)
    y[(static_cast<int64_t>(col) * g.route.top_k + __ffs(mask) - 1) * ld + row] = v;
}

// A store / accumulate part's output (the greedy head's keys on a store).
__device__ __forceinline__ void row_out(const Launch& g, const Part& P, int lt, int col, int64_t row, float v, Smem& sm) {
  const int sg = P.seg;
  if (g.mode[sg] == kOAccum) {
    g.y[sg][col * g.ldy[sg] + row] += v;
    return;
  }
  slot_out(g, P, g.y[sg], lt, col, row, v, sm);
  if (g.amax) atomicMax(&sm.key[col], argmax_key(v, row));
}

// The conv segment's channels of round r (their M products in pb[item * slices], item = (slot * 16 + t16) * M + m):
// with X = [state; y] ([K-1+M, C]) row m's u = silu(sum_j w[c][j] X[m + j][c]) in the one-row step's order (taps 0..K-2,
// then the newest), X to conv_hist, and the state <- X's last K-1 rows (one thread a channel, after every read of it).
__device__ void conv_epilogue(const Launch& g, const float* pb, int r) {
  const Part& P = g.part[g.conv_part];
  const int K = g.conv_k, M = g.M, n = g.mwarps * kTile * M;
  const int64_t C = P.rows;
  float* cs = g.conv_state;
  __syncthreads();  // every item's product is in pb
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int slot = i / (kTile * M), t16 = (i / M) % kTile, m = i % M;
      const int T = (blockIdx.x * g.mwarps + slot) * g.tpw + r, lt = T - P.first;
      if (lt < 0 || lt >= P.tiles) continue;
      const int64_t c = static_cast<int64_t>(lt) * kTile + t16;
      if (c >= C) continue;
      const float* yc = pb + (i - m) * g.slices;  // this channel's row 0; row j at yc[j * slices]
      auto X = [&](int t) { return t < K - 1 ? cs[t * C + c] : yc[(t - (K - 1)) * g.slices]; };
      if (pass == 0) {
        const float* w = g.conv_w + c * K;
        float cv = 0.f;
        for (int j = 0; j < K - 1; ++j) cv += w[j] * X(m + j);
        cv += w[K - 1] * yc[m * g.slices];
        g.u[m * C + c] = cv / (1.f + expf(-cv));
        if (g.conv_hist) {
          g.conv_hist[(K - 1 + m) * C + c] = yc[m * g.slices];
          for (int t = m; t < K - 1; t += M) g.conv_hist[t * C + c] = cs[t * C + c];
        }
      } else if (m == 0) {  // rows ascending: row t reads X[M + t], which no earlier write touched
        for (int t = 0; t < K - 1; ++t) cs[t * C + c] = X(M + t);
      }
    }
    __syncthreads();  // pass 1 rewrites the state pass 0 read
  }
}

// Round r's epilogue: the slices' partial sums in slice order, then each (row, input row) to its segment's output.
__device__ void epilogue(const Launch& g, float* pb, int r, Smem& sm) {
  const int n = g.mwarps * kTile * g.M;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int slot = i / (kTile * g.M), t16 = (i / g.M) % kTile, col = i % g.M;
    const int T = (blockIdx.x * g.mwarps + slot) * g.tpw + r;
    int q = 0;
    while (q + 1 < g.nparts && T >= g.part[q + 1].first) ++q;
    const Part& P = g.part[q];
    const int lt = T - P.first;
    if (lt >= P.tiles) continue;
    float v = 0.f;
    for (int s = 0; s < g.slices; ++s) v += pb[i * g.slices + s];
    const int sg = P.seg;
    if (P.dual) {
      if (t16 >= kTile / 2) continue;
      const int64_t row = static_cast<int64_t>(P.routed ? lt % P.tpe : lt) * (kTile / 2) + t16;
      if (row >= P.rows) continue;
      float u = 0.f;
      const int iu = i + (kTile / 2) * g.M;
      for (int s = 0; s < g.slices; ++s) u += pb[iu * g.slices + s];
      slot_out(g, P, g.yb[sg], lt, col, row, __float2bfloat16(v / (1.f + expf(-v)) * u), sm);
      continue;
    }
    const int64_t row = static_cast<int64_t>(P.routed ? lt % P.tpe : lt) * (P.q8 ? kTile / 2 : kTile) + t16;
    if ((P.q8 && t16 >= kTile / 2) || row >= P.rows) continue;
    if (g.mode[sg] == kOConv) {  // the conv's phases below read every row's product of the channel
      pb[i * g.slices] = v;      // (only this thread reads item i's partials)
      continue;
    }
    row_out(g, P, lt, col, row, v, sm);
  }
  if (g.conv_part >= 0) conv_epilogue(g, pb, r);
}

// A whole-row warp's outputs (one slice): lane (gid, tig) holds rows gid and gid + 8 of tile lt for input rows 2 tig and
// 2 tig + 1 (a dual part: the gate in row gid, the up in row gid + 8, of output row 8 lt + gid).
__device__ __forceinline__ void lane_epilogue(const Launch& g, const Part& P, int lt, int gid, int tig,
                                              const float (&tot)[4], Smem& sm) {
  const int sg = P.seg;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int col = 2 * tig + c;
    if (col >= g.M) break;
    if (P.q8) {  // row gid of an 8-row tile
      const int64_t row = static_cast<int64_t>(P.routed ? lt % P.tpe : lt) * (kTile / 2) + gid;
      if (row < P.rows) row_out(g, P, lt, col, row, tot[c], sm);
      continue;
    }
    if (P.dual) {
      const int64_t row = static_cast<int64_t>(P.routed ? lt % P.tpe : lt) * (kTile / 2) + gid;
      const float v = tot[c], u = tot[2 + c];
      if (row < P.rows) slot_out(g, P, g.yb[sg], lt, col, row, __float2bfloat16(v / (1.f + expf(-v)) * u), sm);
      continue;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = static_cast<int64_t>(P.routed ? lt % P.tpe : lt) * kTile + gid + 8 * h;
      if (row < P.rows) row_out(g, P, lt, col, row, tot[2 * h + c], sm);
    }
  }
}

template <int XMODE>
__global__ void __launch_bounds__(kWarps * 32, 2) rows_kernel(const __grid_constant__ Launch g) {
  extern __shared__ __align__(16) uint4 dsm[];
  __shared__ Smem sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int sl = warp % g.slices, mw = warp / g.slices;
  uint4* xs = dsm;
  float* xsum = reinterpret_cast<float*>(reinterpret_cast<char*>(dsm) + xs_bytes(g.nblk, g.M));
  float* partial = xsum + g.nblk * 8;
  const size_t psize = partial_floats(g);
  if (tid < kMaxRows) sm.key[tid] = 0ull;

  // This warp's run: tiles T0 .. T0 + tpw - 1 of one part, chunks c0 .. c0 + nc - 1.
  const int T0 = (blockIdx.x * g.mwarps + mw) * g.tpw;
  int p = 0;
  while (p + 1 < g.nparts && T0 >= g.part[p + 1].first) ++p;
  const Part& P = g.part[p];
  const int lt0 = T0 - P.first;
  int nvalid = max(0, min(g.tpw, P.tiles - lt0));
  const int c0 = sl * g.cps, nc = max(0, min(g.cps, g.nchunk - c0));
  int nsteps = nvalid * nc;
  auto blocks_of = [&](int c) { return min(kChunkBlks, g.nblk - kChunkBlks * c); };
  Cursor cur;
  Step S, N;
  int lt_off = 0;  // a routed run's first tile of its expert
  if (!P.routed) {
    cur.setup(P, 0, gid, tig);
    if (nsteps > 0) cur.load(lt0, c0, blocks_of(c0), g.sbvec != 0, S);  // weights: before the wait
  }
  pdl_trigger();
  pdl_wait();
  if (g.routed_part >= 0) route_rows(g.route, sm.rt);
  if (g.own_inputs) {  // (uniform: a launch of the launch's own rows needs no table and no barrier)
    if (tid < kMaxRows) sm.xrow[tid] = block_row(g, sm, tid);
    __syncthreads();
  }
  stage<XMODE>(g, xs, xsum, sm);
  __syncthreads();
  if (P.routed) {  // this run's expert: the u-th distinct choice (none past U)
    const int u = lt0 / P.tpe;
    if (u >= sm.rt.U) nvalid = 0, nsteps = 0;
    else lt_off = u * P.tpe, cur.setup(P, sm.rt.uexp[u], gid, tig);
    if (nsteps > 0) cur.load(lt0 - lt_off, c0, blocks_of(c0), g.sbvec != 0, S);
  }

  int s = 0;
  for (int r = 0; r < g.tpw; ++r) {
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    if (r < nvalid) {
      for (int cc = 0; cc < nc; ++cc, ++s) {
        if (s + 1 < nsteps) {
          const int rn = cc + 1 < nc ? r : r + 1, cn = c0 + (cc + 1 < nc ? cc + 1 : 0);
          cur.load(lt0 - lt_off + rn, cn, blocks_of(cn), g.sbvec != 0, N);
        }
        const int nb = blocks_of(c0 + cc);
        if (P.q8) {
          if (nb == kChunkBlks) step_math<kChunkBlks, true>(g, S, c0 + cc, nb, xs, xsum, gid, tig, tot);
          else step_math<0, true>(g, S, c0 + cc, nb, xs, xsum, gid, tig, tot);
        } else if (nb == kChunkBlks) {
          step_math<kChunkBlks, false>(g, S, c0 + cc, nb, xs, xsum, gid, tig, tot);
        } else {
          step_math<0, false>(g, S, c0 + cc, nb, xs, xsum, gid, tig, tot);
        }
        S = N;
      }
    }
    if (g.slices == 1 && g.conv_part < 0) {  // whole rows in this warp: its lanes' sums are the outputs, no barrier
      if (r < nvalid) lane_epilogue(g, P, lt0 + r, gid, tig, tot, sm);
      continue;
    }
    float* pb = partial + (r & 1) * psize;
    if (nc > 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int t16 = gid + (k >> 1) * 8, col = 2 * tig + (k & 1);
        if (col < g.M) pb[((mw * kTile + t16) * g.M + col) * g.slices + sl] = tot[k];
      }
    }
    __syncthreads();
    epilogue(g, pb, r, sm);
  }
  if (g.amax) {
    __syncthreads();
    if (tid < g.M) g.amax[static_cast<int64_t>(blockIdx.x) * g.M + tid] = sm.key[tid];
  }
}

using Kernel = void (*)(const Launch);
Kernel kernel_of(int xmode) { return xmode == kXNorm ? rows_kernel<kXNorm> : rows_kernel<kXBf16>; }

// The kernels may take more than 48 KB of dynamic shared memory (the staged rows: 2 M bytes an input element).
void allow_smem(Kernel k, int xmode) {
  static bool done[2] = {false, false};
  if (done[xmode]) return;
  int dev = 0, max_optin = 0;
  LILY_CUDA_CHECK(cudaGetDevice(&dev));
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  LILY_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin - static_cast<int>(sizeof(Smem))));
  done[xmode] = true;
}

Part part_of(const DLinear& w, const DLinear& w1, bool dual) {
  const kp::LinearParams& q = w.p;
  Part P = {};
  P.w0 = reinterpret_cast<const uint8_t*>(w.codes);
  P.w1 = reinterpret_cast<const uint8_t*>(w1.codes);
  P.s0 = w.scales, P.b0 = w.biases, P.s1 = w1.scales, P.b1 = w1.biases;
  P.row_bytes = static_cast<int32_t>(q.in * q.bits / 8);
  P.q8 = q.bits == 8 ? 1 : 0;
  P.row_groups = static_cast<int32_t>(q.in / q.group);
  int gsh = 0;
  while ((kBlk << gsh) < q.group) ++gsh;
  P.gsh = gsh;
  P.rows = static_cast<int32_t>(q.out);
  P.dual = dual ? 1 : 0;
  P.expert_bytes = q.expert_words * 4;
  P.expert_groups = q.expert_groups;
  if (static_cast<int64_t>(q.out) * P.row_bytes >= (int64_t{1} << 31))
    throw std::invalid_argument("[lily] cuda rows gemv: a " + std::to_string(q.out) + " x " + std::to_string(q.in) +
                                " matrix over 2^31 bytes");
  return P;
}

bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7) == 0; }

}  // namespace

bool fits(const DLinear& w) {
  const kp::LinearParams& p = w.p;
  return p.kind == 0 && (p.bits == 4 || p.bits == 8) && p.group >= kBlk && (p.group & (p.group - 1)) == 0 && p.in % p.group == 0 &&
         p.in % kBlk == 0 && p.in >= kBlk && p.in <= kMaxIn && p.out >= 1;
}

int64_t head_blocks(int64_t rows) { return (rows + kTile - 1) / kTile; }  // at most one block per tile

unsigned proj(cudaStream_t st, const Args& a) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("[lily] cuda rows gemv: " + m); };
  if (a.rows < 1 || a.rows > kMaxRows) fail("rows " + std::to_string(a.rows) + ", expected 1 to 8");
  if (a.nseg < 1 || a.nseg > kMaxSegs) fail("1 to 4 segments");
  if (a.xmode != kXBf16 && a.xmode != kXNorm) fail("staging mode " + std::to_string(a.xmode));
  if (a.ldx < a.in || a.ldx % 8 != 0) fail("input row stride must be >= in and a multiple of 8");
  if (a.amax && (a.nseg != 1 || a.seg[0].mode != kOStore)) fail("the head's keys need one store segment");
  Launch g;
  g.M = a.rows, g.in = a.in, g.xmode = a.xmode, g.eps = a.eps;
  g.xb = a.xb, g.xf = a.xf, g.nw = a.nw, g.ldx = a.ldx, g.h_out = a.h_out, g.amax = a.amax;
  bool sbvec = true, own_inputs = false;
  for (int s = 0; s < a.nseg; ++s) {
    const Seg& sg = a.seg[s];
    if (sg.w0.p.in != a.in) fail("segment input length mismatch");
    if (!fits(sg.w0) || (sg.mode == kODual && (!fits(sg.w1) || sg.w1.p.out != sg.w0.p.out)))
      fail("segment weight format not supported (4- or 8-bit, group >= 64)");
    if (sg.mode != kOStore && sg.mode != kOAccum && sg.mode != kODual && sg.mode != kOConv)
      fail("output mode " + std::to_string(sg.mode));
    if (sg.mode == kOConv) {
      if (g.conv_part >= 0) fail("one conv segment at most");
      if (a.conv_k < 2 || a.conv_k > kMaxConvK) fail("conv taps " + std::to_string(a.conv_k) + ", expected 2 to 4");
      if (!a.conv_w || !a.conv_state || !a.u) fail("a conv segment needs conv_w, conv_state and u");
      g.conv_part = g.nparts, g.conv_k = a.conv_k, g.conv_w = a.conv_w, g.conv_state = a.conv_state, g.u = a.u;
      g.conv_hist = a.conv_hist;
    } else if (sg.ldy < sg.w0.p.out) {
      fail("output row stride below the segment's rows");
    }
    const bool dual = sg.mode == kODual;
    Part P = part_of(sg.w0, dual ? sg.w1 : sg.w0, dual);
    if (P.q8 && (dual || sg.mode == kOConv || sg.routed)) fail("8-bit weights take plain store and accumulate segments");
    const int tile_rows = dual || P.q8 ? kTile / 2 : kTile;
    P.tiles = static_cast<int32_t>((P.rows + tile_rows - 1) / tile_rows);
    P.seg = s;
    if (sg.xb) {
      if (a.xmode != kXBf16) fail("a segment's own input rows are bf16 (xmode 0)");
      if (sg.ldx < a.in || sg.ldx % 8 != 0) fail("a segment's input row stride must be >= in and a multiple of 8");
      P.xsrc = sg.xb, P.ldx = sg.ldx, P.xrouted = sg.xrouted;
      own_inputs = true;
    }
    if (sg.xrouted && (!sg.routed || !sg.xb)) fail("xrouted: a routed segment with its own input rows [M, top_k, in]");
    if (sg.routed) {
      if (!dual && sg.mode != kOStore) fail("a routed segment is dual (the experts' gate and up) or a store (down)");
      if (!dual && !sg.xrouted) fail("a routed store segment reads each slot's rows (xrouted)");
      if (g.routed_part >= 0) fail("one routed segment at most");
      if (a.E < 1 || a.E > kMaxExperts) fail("E " + std::to_string(a.E) + ", expected 1 to 256");
      if (a.top_k < 1 || a.top_k > kMaxTopK || a.top_k > a.E) fail("top_k " + std::to_string(a.top_k));
      if (a.route_from_idx ? !a.top_idx : (!a.rlogits || !a.top_idx || !a.top_w))
        fail("a routed segment needs rlogits, top_idx and top_w (or top_idx alone with route_from_idx)");
      g.routed_part = g.nparts;
      g.route = RouteArgs{a.rows, a.E, a.top_k, a.norm_topk, a.route_from_idx, a.rlogits, a.top_idx, a.top_w};
      P.routed = 1, P.tpe = P.tiles;
      P.tiles = std::min(a.E, a.rows * a.top_k) * P.tpe;  // at most this many distinct experts
    }
    sbvec = sbvec && P.gsh == 0 && P.row_groups % kChunkBlks == 0 && aligned8(P.s0) && aligned8(P.b0) &&
            aligned8(P.s1) && aligned8(P.b1) && P.expert_groups % 4 == 0;
    g.part[g.nparts++] = P;
    g.y[s] = sg.y, g.yb[s] = sg.yb, g.ldy[s] = sg.ldy, g.mode[s] = sg.mode;
  }
  g.sbvec = sbvec ? 1 : 0;
  g.own_inputs = own_inputs ? 1 : 0;
  // K split: a function of the input length only (so every row's sums keep one order whatever M is)
  g.nblk = a.in / kBlk;
  g.nchunk = (g.nblk + kChunkBlks - 1) / kChunkBlks;
  // One chunk a slice where the block's warps can take them (the finest split: the most warps streaming a mid-size
  // launch; 1,024 elements a slice, as gemv.cu's, was 1.2-1.6x slower at 2,048 x 4,096 on an H100), or whole rows
  // per warp where the tiles alone fill the GPU's warp slots twice over (the head): no partial sums, no round
  // barriers. Both depend on the shapes and the device only.
  int64_t all_tiles = 0;  // (a routed part counted at 8 rows' distinct experts, so the split does not follow M)
  for (int q = 0; q < g.nparts; ++q)
    all_tiles += g.part[q].routed ? int64_t{std::min(a.E, kMaxRows * a.top_k)} * g.part[q].tpe : g.part[q].tiles;
  const bool whole_rows = all_tiles >= int64_t{2} * device_sm_count() * 2 * kWarps;
  g.cps = whole_rows ? g.nchunk : (g.nchunk + kWarps - 1) / kWarps;
  g.slices = (g.nchunk + g.cps - 1) / g.cps;
  g.mwarps = kWarps / g.slices;
  // a block inside one expert where the parts have their own inputs: mwarps divides the expert's tiles
  if (own_inputs && g.routed_part >= 0) g.mwarps = std::gcd(g.mwarps, static_cast<int>(g.part[g.routed_part].tpe));
  const int threads = 32 * g.slices * g.mwarps;
  const Kernel k = kernel_of(a.xmode);
  allow_smem(k, a.xmode);
  // tiles per warp: the makespan ~ waves x (tpw + 1) over the resident block slots (the +1: staging and epilogue)
  int bps = 0;
  g.tpw = 1;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, k, threads, smem_bytes(g)));
  if (bps < 1) fail("no block fits an SM (" + std::to_string(smem_bytes(g)) + " bytes of shared memory)");
  const int64_t slots = static_cast<int64_t>(device_sm_count()) * bps;
  int64_t best = -1;
  for (int t = 1; t <= kMaxTpw; ++t) {
    // a run in one expert; a block in one part and expert where parts have their own inputs
    if (g.routed_part >= 0 && g.part[g.routed_part].tpe % (own_inputs ? t * g.mwarps : t) != 0) continue;
    int64_t runs = 0;
    for (int q = 0; q < g.nparts; ++q) runs += (g.part[q].tiles + t - 1) / t;
    const int64_t blocks = (runs + g.mwarps - 1) / g.mwarps;
    const int64_t span = (blocks + slots - 1) / slots * (t + 1);
    if (best < 0 || span < best) best = span, g.tpw = t;
    if (runs <= g.mwarps) break;  // one block holds everything: longer runs only add rounds
  }
  const int64_t per_block = static_cast<int64_t>(g.mwarps) * g.tpw, align = own_inputs ? per_block : g.tpw;
  int64_t tiles = 0;
  for (int q = 0; q < g.nparts; ++q) {
    g.part[q].first = static_cast<int32_t>(tiles);
    tiles += (g.part[q].tiles + align - 1) / align * align;
  }
  const int grid = static_cast<int>((tiles + per_block - 1) / per_block);
  launch_pdl(k, dim3(grid), dim3(threads), smem_bytes(g), st, g);
  return static_cast<unsigned>(grid);
}

}  // namespace lily::cuda::rows
