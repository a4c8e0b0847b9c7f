// The decode GEMV (gemv.cuh): one kernel for every decode projection (a template, specialised per format set and
// staging, see Stage), measured in dev/gemv_lab (issue 14).
//
// Layout of the work. A launch is a list of parts (one weight matrix, or one expert of a stacked tensor). In row
// mode (proj) the parts are stacked along the output rows and read one input row; in K mode (moe_down) they sit
// side by side along K (8 experts' down rows and the shared expert's, each with its own input segment and
// factor) and sum into the same rows. The input is cut into units of 32 elements; lane l of slice s owns unit
// 32 s + l, so the slices = ceil(units / 32) warps of a row group split K (split-K inside the block, partials
// summed in shared memory at the end: plain stores, deterministic). A warp streams tiles of kR = 4 rows: per tile
// and lane 16 bytes per row (4-bit: two 8-byte loads; 8-bit two 16-byte vectors, bf16 four, fp32 eight), the next
// 4-bit tile's loads issued before this tile's math (a register double buffer, no shared-memory ring: the bytes in
// flight come from many warps, 16 per SM). A dual segment's tile holds 2 gate rows and the same 2 up rows, so SiLU(gate) * up is
// applied in the block's epilogue. Each part's tiles start at a multiple of the tiles per warp (tpw), so no warp
// crosses a part; the host picks tpw to minimise the makespan over the resident block slots.
//
// 4-bit weights run on the tensor cores (gemv_lane.cuh: 16 mma.sync per tile, each lane holding 16 elements of two
// 64-element groups instead of a 32-element unit; the tile's rows and slices are the same): exact against the fp64
// twin to fp32 rounding, where the FFMA form it replaced (1 + q/2048 windows) erred by ~3e-5 absolute. 8-bit and dense
// weights take the FFMA lane: dequantisation without int -> float conversions, a byte q placed in the mantissa of
// 1.0f at bits 15-22 is 1 + q/256 (a shift and one LOP3), so sum q x = 256 (acc - X) with X the lane's sum of x;
// the group term is s * sum q x + b * X. x is fp32 in shared memory, lane-major ([slice][8 float4][lane]: a warp's
// LDS.128 reads 512 consecutive bytes, conflict-free), multiplied by the part's factor in K mode (8-bit; the 4-bit
// fold applies it in fp32).
#include "cuda/gemv.cuh"
#include "cuda/gemv_lane.cuh"
#include "cuda/gemv_launch.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda::gemv {
namespace {


// A lane's loads of one tile: kR rows x kVec vectors (+ scale and bias per row when quantized).
template <int FMT>
struct TileRegs {  // (dense formats stream row by row: Cursor::dense_dot)
  uint4 q[kR][FmtTraits<FMT>::kQuant ? FmtTraits<FMT>::kVec : 1];
  uint32_t s[kR], b[kR];
};

// A lane's position in one part: the bases of the rows it reads (the expert's matrices offset to the lane's unit
// and group), set once per warp, so a tile's row addresses are one 32-bit multiply and a 64-bit add each from a
// base (rows 0-1 of a tile: the gate matrix; rows 2-3: the up matrix of a dual part, the same matrix otherwise).
// The byte offsets of an expert's rows fit in 32 bits (check_row_offsets, at every launch).
template <int FMT>
struct Cursor {
  const uint8_t *wlo, *whi;  // codes or dense elements of rows 0-1 and 2-3 of a tile
  const uint16_t *slo, *shi, *blo, *bhi;
  int32_t row_bytes, row_groups, last, step, a2;  // last row; rows per tile (4, dual 2); row 2's offset (2, dual 0)

  __device__ __forceinline__ void setup(const Part& P, int64_t e, int unit) {
    const int64_t off = static_cast<int64_t>(unit) * 16 * FmtTraits<FMT>::kVec;
    const int64_t g = e * P.expert_groups + (unit >> P.gsh);
    wlo = P.w0 + e * P.expert_bytes + off;
    whi = (P.dual ? P.w1 : P.w0) + e * P.expert_bytes + off;
    if constexpr (FmtTraits<FMT>::kQuant) {
      slo = P.s0 + g, blo = P.b0 + g;
      shi = (P.dual ? P.s1 : P.s0) + g, bhi = (P.dual ? P.b1 : P.b0) + g;
    }
    row_bytes = P.row_bytes, row_groups = P.row_groups, last = P.rows - 1;
    step = P.dual ? 2 : kR, a2 = P.dual ? 0 : 2;
  }
  // Row i of tile lt: row 4 lt + i, or (dual) gate row 2 lt + i and up row 2 lt + i - 2; clamped to the last
  // row (the epilogue drops rows past it).
  __device__ __forceinline__ int row(int lt, int i) const {
    return min(step * lt + (i < 2 ? i : a2 + i - 2), last);
  }
  __device__ __forceinline__ const uint4* vec(int lt, int i) const {
    return reinterpret_cast<const uint4*>((i < 2 ? wlo : whi) + static_cast<uint32_t>(row(lt, i) * row_bytes));
  }
  __device__ __forceinline__ void load(int lt, TileRegs<FMT>& t) const {  // quantized formats
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const uint4* p = vec(lt, i);
#pragma unroll
      for (int v = 0; v < FmtTraits<FMT>::kVec; ++v) t.q[i][v] = ld_stream(p + v);
      const uint32_t gi = static_cast<uint32_t>(row(lt, i) * row_groups);
      t.s[i] = __ldg((i < 2 ? slo : shi) + gi);
      t.b[i] = __ldg((i < 2 ? blo : bhi) + gi);
    }
  }
  // Dense formats (test models): one row at a time, no tile held in registers.
  __device__ __forceinline__ void dense_dot(int lt, const float* x, float (&tot)[kR]) const {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      uint4 q[FmtTraits<FMT>::kVec];
      const uint4* p = vec(lt, i);
#pragma unroll
      for (int v = 0; v < FmtTraits<FMT>::kVec; ++v) q[v] = ld_stream(p + v);
      tot[i] = unit_dot<FMT>(q, 0u, 0u, x, 0.f);
    }
  }
};

__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t row) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<uint32_t>(row));
}

// 8-bit and dense weights: this warp's tiles [t0, t1) of part P (local tile indices), lane `unit` of the slice,
// partial sums into `partial`.
template <int FMT, int STAGE>
__device__ void run_warp(const Launch& g, const Part& P, int t0, int t1, int unit, int pslot, float* xs,
                         float* partial, Smem& sm, EpiPre& pre) {
  const int lane = threadIdx.x & 31;
  constexpr bool kQuant = FmtTraits<FMT>::kQuant;
  Cursor<FMT> cur;
  TileRegs<FMT> cur_t;
  warp_prologue<STAGE>(g, P.expert < 0, xs, sm, pre, [&](bool routed) {
    if (t0 >= t1) return;
    cur.setup(P, routed && P.expert >= 0 ? sm.idx[P.expert] : 0, unit);
    if constexpr (kQuant) cur.load(t0, cur_t);
  });
  const int sl = (threadIdx.x >> 5) % g.slices;
  const float4* xl = reinterpret_cast<const float4*>(xs) + sl * 8 * 32 + lane;
  float x[32];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float4 t = xl[k * 32];
    x[4 * k] = t.x, x[4 * k + 1] = t.y, x[4 * k + 2] = t.z, x[4 * k + 3] = t.w;
  }
  float xa = 0.f;
#pragma unroll
  for (int k = 0; k < 32; ++k) xa += x[k];
  for (int t = t0; t < t1; ++t) {
    float tot[kR];
    if constexpr (kQuant) {
#pragma unroll
      for (int i = 0; i < kR; ++i) tot[i] = unit_dot<FMT>(cur_t.q[i], cur_t.s[i], cur_t.b[i], x, xa);
      if (t + 1 < t1) cur.load(t + 1, cur_t);
    } else {
      cur.dense_dot(t, x, tot);
    }
    const float r = reduce_rows4(tot, lane);
    if ((lane & 7) == 0) partial[((pslot + (t - t0)) * kR + reduced_row(lane)) * g.slices + sl] = r;
  }
}

// 4-bit weights (gemv_lane.cuh's tensor-core tile): lane (gid, tig) of slice sl reads groups 2 gid + h of the
// slice, 8 bytes per row at element 16 tig of the group. In row mode both groups lie in the warp's part P; in K
// mode each group has its own part (an expert's segment along K may be a single group), found here.
template <int STAGE>
struct Q4Cursor {
  static constexpr bool kK = STAGE == kStageK;
  const uint8_t* w[2];        // row mode: rows 0-1 / 2-3 of a tile (gate / up of a dual part); K mode: group h's part
  const uint16_t *s[2], *b[2];
  int32_t rb[2], rg[2];       // their row bytes and row groups
  int32_t o[2], go[2];        // row mode: group h's byte and group offsets (K mode: inside w, s and b)
  int32_t last, step, a2;

  __device__ __forceinline__ void set(int k, const Part& P, const uint8_t* wm, const uint16_t* sm_, const uint16_t* bm,
                                      int64_t e, int u, int tig) {
    const int64_t gofs = e * P.expert_groups + (kK ? (u >> P.gsh) : 0);
    w[k] = wm + e * P.expert_bytes + (kK ? static_cast<int64_t>(u) * 16 : 0) + 8 * tig;
    s[k] = sm_ + gofs, b[k] = bm + gofs;
    rb[k] = P.row_bytes, rg[k] = P.row_groups;
  }
  // Row mode: part P, expert e, the lane's group units u[h] (32-element units within the part).
  __device__ __forceinline__ void setup_rows(const Part& P, int64_t e, const int (&u)[2], int tig) {
    set(0, P, P.w0, P.s0, P.b0, e, 0, tig);
    set(1, P, P.dual ? P.w1 : P.w0, P.dual ? P.s1 : P.s0, P.dual ? P.b1 : P.b0, e, 0, tig);
#pragma unroll
    for (int h = 0; h < 2; ++h) o[h] = u[h] * 16, go[h] = u[h] >> P.gsh;
    last = P.rows - 1, step = P.dual ? 2 : kR, a2 = P.dual ? 0 : 2;
  }
  // K mode: group h in part Ph[h] at unit u[h] of it, expert e[h].
  __device__ __forceinline__ void setup_k(const Part* const (&Ph)[2], const int64_t (&e)[2], const int (&u)[2], int rows,
                                          int tig) {
#pragma unroll
    for (int h = 0; h < 2; ++h) set(h, *Ph[h], Ph[h]->w0, Ph[h]->s0, Ph[h]->b0, e[h], u[h], tig), o[h] = go[h] = 0;
    last = rows - 1, step = kR, a2 = 2;
  }
  __device__ __forceinline__ int row(int lt, int i) const { return min(step * lt + (i < 2 ? i : a2 + i - 2), last); }
  // Tile lt's codes, and the scales and biases of its row `mine` (the lane's tig).
  __device__ __forceinline__ void load(int lt, int mine, Q4Tile& T) const {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int r = row(lt, i);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = kK ? h : i >> 1;
        T.q[i][h] = ld_stream8(w[k] + static_cast<uint32_t>(r * rb[k] + o[h]));
      }
    }
    const int r = row(lt, mine);
    const bool hi = mine >> 1;  // (selects, not an index: a runtime index puts the arrays in local memory)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = kK ? h : 0;
      const uint32_t gi = static_cast<uint32_t>(r * (kK || !hi ? rg[k] : rg[1]) + go[h]);
      T.s[h] = __ldg((kK || !hi ? s[k] : s[1]) + gi), T.b[h] = __ldg((kK || !hi ? b[k] : b[1]) + gi);
    }
  }
};

template <int STAGE>
__device__ void run_warp_q4(const Launch& g, const Part& P, int t0, int t1, int pslot, float* xs, float* partial,
                            Smem& sm, EpiPre& pre) {
  constexpr bool kK = STAGE == kStageK;
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int sl = (threadIdx.x >> 5) % g.slices;
  const bool odd = gid & 1;
  const int diag = 4 * gid + (gid >> 1);  // the lane holding this gid's diagonal
  // The lane's groups: units uc[h] of the launch's input (a group past its end reads unit 0; its x is zero).
  int uc[2], pk[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uc[h] = sl * 32 + 4 * gid + 2 * h;
    if (uc[h] >= g.units) uc[h] = 0;
    if constexpr (kK)
      while (pk[h] + 1 < g.nparts && uc[h] >= g.part[pk[h] + 1].first) ++pk[h];
  }
  Q4Cursor<STAGE> cur;
  Q4Tile cur_t, nxt;  // the register double buffer
  bool early = P.expert < 0;
  if constexpr (kK) early = g.part[pk[0]].expert < 0 && g.part[pk[1]].expert < 0;
  warp_prologue<STAGE>(g, early, xs, sm, pre, [&](bool routed) {
    if (t0 >= t1) return;
    if constexpr (kK) {
      const Part* Ph[2] = {&g.part[pk[0]], &g.part[pk[1]]};
      const int64_t e[2] = {routed && Ph[0]->expert >= 0 ? sm.idx[Ph[0]->expert] : 0,
                            routed && Ph[1]->expert >= 0 ? sm.idx[Ph[1]->expert] : 0};
      const int u[2] = {uc[0] - Ph[0]->first, uc[1] - Ph[1]->first};
      cur.setup_k(Ph, e, u, g.rows, tig);
    } else {
      cur.setup_rows(P, routed && P.expert >= 0 ? sm.idx[P.expert] : 0, uc, tig);
    }
    cur.load(t0, tig, cur_t);
  });
  // The B fragments (the lane's x at its k slots, packed to bf16 without rounding), the groups' sums of exactly
  // those values, and (K mode) the groups' factors.
  uint32_t bx[2][4][2];
  float X[2], X128[2], fac[2];
  {
    const float4* x4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float xv[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 t = x4[(sl * 8 + 4 * (tig & 1) + q) * 32 + 4 * gid + 2 * h + (tig >> 1)];
        xv[4 * q] = t.x, xv[4 * q + 1] = t.y, xv[4 * q + 2] = t.z, xv[4 * q + 3] = t.w;
      }
      float sum = 0.f;  // (the staged values are bf16 already: RMSNorm rounds, K mode leaves the factor to the fold)
#pragma unroll
      for (int m = 0; m < 16; ++m) sum += xv[m];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int w = q4_word(i), j0 = q4_j0(i);
        bx[h][i][0] = mma::pack_bf16x2(xv[8 * w + j0], xv[8 * w + j0 + 4]);
        bx[h][i][1] = mma::pack_bf16x2(xv[8 * w + j0 + 1], xv[8 * w + j0 + 5]);
      }
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      X[h] = sum, X128[h] = 128.f * sum;
      fac[h] = kK ? sm.fac[pk[h]] : 1.f;
    }
  }
  auto tile = [&](int t, const Q4Tile& T) {
    float tot = 0.f;  // row tig's sum over this lane's gid's groups
    float c[2][2][4] = {};  // [h][row pair]: four independent accumulator chains
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int w = q4_word(i), j0 = q4_j0(i);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t r0 = w ? T.q[2 * p][h].y : T.q[2 * p][h].x, r1 = w ? T.q[2 * p + 1][h].y : T.q[2 * p + 1][h].x;
          const uint32_t a[4] = {q4_pair(r0, j0), q4_pair(r1, j0), q4_pair(r0, j0 + 1), q4_pair(r1, j0 + 1)};
          mma::mma_bf16(c[h][p], a, bx[h][i][0], bx[h][i][1]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float d[kR];  // the diagonal's rows 0..3, from the diagonal lane
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const float* cp = c[h][r >> 1];
        d[r] = __shfl_sync(0xFFFFFFFFu, (r & 1) ? (odd ? cp[3] : cp[2]) : (odd ? cp[1] : cp[0]), diag);
      }
      const float D = tig == 0 ? d[0] : tig == 1 ? d[1] : tig == 2 ? d[2] : d[3];
      const float term = fmaf(u16f(T.s[h]), D - X128[h], u16f(T.b[h]) * X[h]);
      tot = kK ? fmaf(fac[h], term, tot) : tot + term;
    }
    tot += __shfl_xor_sync(0xFFFFFFFFu, tot, 4);
    tot += __shfl_xor_sync(0xFFFFFFFFu, tot, 8);
    tot += __shfl_xor_sync(0xFFFFFFFFu, tot, 16);
    if (lane < kR) partial[((pslot + (t - t0)) * kR + lane) * g.slices + sl] = tot;
  };
  // The register double buffer as two named tiles, the loop unrolled by two: the next tile's loads go out before
  // this tile's math, and no tile is copied between buffers (a conditional copy was 24 SELs per tile).
  for (int t = t0; t < t1; t += 2) {
    if (t + 1 < t1) cur.load(t + 1, tig, nxt);
    tile(t, cur_t);
    if (t + 1 >= t1) break;
    if (t + 2 < t1) cur.load(t + 2, tig, cur_t);
    tile(t + 1, nxt);
  }
}

__device__ __forceinline__ float silu_(float v) { return v / (1.f + expf(-v)); }

// Output row `row` of part P: v0 is the row's dot product (the gate's for a dual part), v1 the up projection's.
// `pre`: the row's operands loaded early (EpiPre), or null.
__device__ __forceinline__ void epilogue(const Launch& g, const Part& P, int64_t row, float v0, float v1,
                                         unsigned long long& key, const EpiPre* pre) {
  const int sg = P.seg;
  const int64_t o = P.slot * g.y_step[sg] + row;
  const int mode = g.mode[sg];
  if (mode == kOStore) {
    g.y[sg][o] = v0;
    key = max(key, argmax_key(v0, row));
  } else if (mode == kOAccum) {
    g.y[sg][o] = (pre && pre->kind == 2 ? pre->y : g.y[sg][o]) + v0;
  } else if (mode == kODual) {
    g.yb[sg][o] = __float2bfloat16(silu_(v0) * v1);
  } else {  // DeltaNet causal conv of channel `row` + SiLU, state shifted by one
    const int K = g.conv_k;
    const int64_t C = g.conv_dim;
    float* cs = g.conv_state;
    float cv = 0.f;
    if (pre && pre->kind == 1) {
#pragma unroll
      for (int j = 0; j < kMaxConvK - 1; ++j)
        if (j < K - 1) cv += pre->w[j] * pre->st[j];
#pragma unroll
      for (int j = 0; j < kMaxConvK; ++j)
        if (j == K - 1) cv += pre->w[j] * v0;
      g.u[row] = cv / (1.f + expf(-cv));
#pragma unroll
      for (int r = 0; r < kMaxConvK - 1; ++r)  // (the min only bounds the unrolled index: r + 1 < K - 1 <= 2 there)
        if (r < K - 1) cs[r * C + row] = r + 1 < K - 1 ? pre->st[min(r + 1, kMaxConvK - 2)] : v0;
      return;
    }
    const float* w = g.conv_w + row * K;
    for (int j = 0; j < K - 1; ++j) cv += w[j] * cs[j * C + row];
    cv += w[K - 1] * v0;
    g.u[row] = cv / (1.f + expf(-cv));
    for (int r = 0; r < K - 1; ++r) cs[r * C + row] = r + 1 < K - 1 ? cs[(r + 1) * C + row] : v0;
  }
}

// The epilogue row that thread `tid` handles first (i = tid of the epilogue loop), as that loop finds it: its part,
// row and whether the thread writes it; then its early operands (EpiPre).
template <bool kK>
__device__ __forceinline__ void epi_pre(const Launch& g, EpiPre& pre) {
  const int tid = threadIdx.x, nrow = g.mwarps * g.tpw * kR;
  if (tid >= nrow) return;
  const int T = blockIdx.x * g.mwarps * g.tpw + tid / kR, r4 = tid % kR;
  if constexpr (kK) {
    const int64_t row = static_cast<int64_t>(T) * kR + r4;
    if (row < g.rows) pre.kind = 2, pre.acc = g.xacc, pre.idx = row;
  } else {
    int q = 0;
    while (q + 1 < g.nparts && T >= g.part[q + 1].first) ++q;
    const Part& Q = g.part[q];
    const int lt = T - Q.first;
    if (lt >= Q.tiles || Q.dual) return;
    const int64_t row = static_cast<int64_t>(lt) * kR + r4;
    if (row >= Q.rows) return;
    const int mode = g.mode[Q.seg];
    if (mode == kOAccum) {
      pre.kind = 2, pre.acc = g.y[Q.seg], pre.idx = Q.slot * g.y_step[Q.seg] + row;
    } else if (mode == kOConv && g.conv_k <= kMaxConvK) {  // before the wait: constants and this layer's own state
      pre.kind = 1, pre.idx = row;
      const int K = g.conv_k;
#pragma unroll
      for (int j = 0; j < kMaxConvK; ++j) pre.w[j] = j < K ? g.conv_w[row * K + j] : 0.f;
#pragma unroll
      for (int j = 0; j < kMaxConvK - 1; ++j) pre.st[j] = j < K - 1 ? g.conv_state[j * static_cast<int64_t>(g.conv_dim) + row] : 0.f;
    }
  }
}

template <int SET, int STAGE>
__global__ void __launch_bounds__(kBlockWarps * 32, 2) gemv_kernel(const __grid_constant__ Launch g) {
  constexpr bool kK = STAGE == kStageK;
  extern __shared__ __align__(16) float smem[];
  __shared__ Smem sm;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int sl = warp % g.slices, m = warp / g.slices;
  const int unit = sl * 32 + (tid & 31);
  float* xs = smem;                                   // [slices * 1024]
  float* partial = smem + g.slices * 1024;            // [mwarps * tpw * kR][slices]
  const int nrow = g.mwarps * g.tpw * kR;
  float* rowv = partial + nrow * g.slices;            // [mwarps * tpw * kR]
  if (tid == 0) sm.key = 0ull;

  // This warp's part and tiles.
  const int wt0 = (blockIdx.x * g.mwarps + m) * g.tpw;  // first logical tile
  int p = 0, t0 = 0, t1 = 0, u = 0;
  if constexpr (kK) {
    const int uc = unit < g.units ? unit : 0;  // a lane past the end reads unit 0; its x is zero
    while (p + 1 < g.nparts && uc >= g.part[p + 1].first) ++p;
    u = uc - g.part[p].first;
    t0 = wt0, t1 = min(wt0 + g.tpw, (g.rows + kR - 1) / kR);
  } else {
    while (p + 1 < g.nparts && wt0 >= g.part[p + 1].first) ++p;
    u = unit < g.units ? unit : 0;
    t0 = wt0 - g.part[p].first;
    t1 = min(t0 + g.tpw, g.part[p].tiles);
  }
  if (t1 < t0) t1 = t0;
  const Part& P = g.part[p];
  const int pslot = m * g.tpw;
  EpiPre pre;
  epi_pre<kK>(g, pre);
  if constexpr (SET == kSetQ4) {
    run_warp_q4<STAGE>(g, P, t0, t1, pslot, xs, partial, sm, pre);
  } else if constexpr (SET == kSetQ4Q8) {
    if (P.fmt == kQ8) run_warp<kQ8, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm, pre);
    else run_warp_q4<STAGE>(g, P, t0, t1, pslot, xs, partial, sm, pre);
  } else {
    switch (P.fmt) {
      case kQ4: run_warp_q4<STAGE>(g, P, t0, t1, pslot, xs, partial, sm, pre); break;
      case kQ8: run_warp<kQ8, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm, pre); break;
      case kBF16: run_warp<kBF16, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm, pre); break;
      default: run_warp<kF32, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm, pre); break;
    }
  }
  __syncthreads();
  for (int i = tid; i < nrow; i += blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < g.slices; ++s) v += partial[i * g.slices + s];
    rowv[i] = v;
  }
  __syncthreads();
  unsigned long long key = 0ull;
  const int bt0 = blockIdx.x * g.mwarps * g.tpw;
  for (int i = tid; i < nrow; i += blockDim.x) {
    const int T = bt0 + i / kR, r4 = i % kR;
    if constexpr (kK) {
      const int64_t row = static_cast<int64_t>(T) * kR + r4;
      if (row < g.rows) g.xacc[row] = (i == tid && pre.kind == 2 ? pre.y : g.xacc[row]) + rowv[i];
    } else {
      int q = 0;
      while (q + 1 < g.nparts && T >= g.part[q + 1].first) ++q;
      const Part& Q = g.part[q];
      const int lt = T - Q.first;
      if (lt >= Q.tiles) continue;
      if (Q.dual) {
        if (r4 >= 2) continue;
        const int64_t row = 2 * lt + r4;
        if (row < Q.rows) epilogue(g, Q, row, rowv[i], rowv[i + 2], key, nullptr);
      } else {
        const int64_t row = static_cast<int64_t>(lt) * kR + r4;
        if (row < Q.rows) epilogue(g, Q, row, rowv[i], 0.f, key, i == tid ? &pre : nullptr);
      }
    }
  }
  if (g.amax) {  // block maximum of (logit, -row): the greedy head
    if (key) atomicMax(&sm.key, key);
    __syncthreads();
    if (tid == 0) g.amax[blockIdx.x] = sm.key;
  }
}

int fmt_of(const kp::LinearParams& p) {
  if (p.kind == 0) return p.bits == 4 ? kQ4 : kQ8;
  return p.kind == 1 ? kBF16 : kF32;
}

Part part_of(const DLinear& w, const DLinear& w1, bool dual) {
  const kp::LinearParams& q = w.p;
  Part P = {};
  P.fmt = fmt_of(q);
  if (q.kind == 0) {
    P.w0 = reinterpret_cast<const uint8_t*>(w.codes);
    P.w1 = reinterpret_cast<const uint8_t*>(w1.codes);
    P.s0 = w.scales, P.b0 = w.biases, P.s1 = w1.scales, P.b1 = w1.biases;
    P.expert_bytes = q.expert_words * 4;
    P.expert_groups = q.expert_groups;
    P.row_bytes = static_cast<int32_t>(q.in * q.bits / 8);
    P.row_groups = static_cast<int32_t>(q.in / q.group);
    int gsh = 0;
    while ((32 << gsh) < q.group) ++gsh;
    P.gsh = gsh;
  } else {
    const int eb = q.kind == 1 ? 2 : 4;
    P.w0 = static_cast<const uint8_t*>(w.dense);
    P.w1 = static_cast<const uint8_t*>(w1.dense);
    P.expert_bytes = q.expert_elems * eb;
    P.row_bytes = static_cast<int32_t>(q.in * eb);
  }
  P.dual = dual ? 1 : 0;
  P.expert = -1;
  return P;
}

// The kernel's row offsets within an expert's matrix are 32-bit (Cursor): a matrix must stay under 2^31 bytes.
void check_row_offsets(const Part& P, const DLinear& w) {
  const int64_t bytes = static_cast<int64_t>(P.rows) * P.row_bytes;
  if (bytes >= (int64_t{1} << 31))
    throw std::invalid_argument("[lily] cuda decode gemv: a " + std::to_string(w.p.out) + " x " +
                                std::to_string(w.p.in) + " matrix of " + std::to_string(bytes) +
                                " bytes, expected under 2^31");
}

struct Geometry {
  int threads = 0, grid = 0;
  size_t smem = 0;
  void (*kernel)(const Launch) = nullptr;  // the launch kind's instantiation
};

using Kernel = void (*)(const Launch);

// The instantiation for a launch: the smallest format set that holds its parts' formats, its staging.
struct KernelKind {
  int set, stage;
};
KernelKind kind_of(const Launch& g) {
  int set = kSetQ4;
  for (int p = 0; p < g.nparts; ++p)
    set = std::max<int>(set, g.part[p].fmt == kQ4 ? kSetQ4 : g.part[p].fmt == kQ8 ? kSetQ4Q8 : kSetAny);
  return {set, g.kmode ? static_cast<int>(kStageK) : g.xmode};
}
template <int SET>
Kernel kernel_in_set(int stage) {
  switch (stage) {
    case kStageBf16: return gemv_kernel<SET, kStageBf16>;
    case kStageNorm: return gemv_kernel<SET, kStageNorm>;
    default: return gemv_kernel<SET, kStageK>;
  }
}
Kernel kernel_of(const KernelKind& k) {
  return k.set == kSetQ4 ? kernel_in_set<kSetQ4>(k.stage)
                         : k.set == kSetQ4Q8 ? kernel_in_set<kSetQ4Q8>(k.stage) : kernel_in_set<kSetAny>(k.stage);
}

// Resident blocks per SM of kernel kind k for a block of `threads` threads and `smem` bytes of dynamic shared memory.
int blocks_per_sm(const KernelKind& k, int threads, size_t smem) {
  static int cache[kSets][kStages][kBlockWarps + 1][8] = {};
  const int sb = static_cast<int>(std::min<size_t>(7, smem / 8192));
  int& c = cache[k.set][k.stage][threads / 32][sb];
  if (!c) {
    int n = 0;
    LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel_of(k), threads, (sb + 1) * 8192));
    c = std::max(1, n);
  }
  return c;
}

size_t smem_for(const Launch& g) {
  const size_t nrow = static_cast<size_t>(g.mwarps) * g.tpw * kR;
  return (static_cast<size_t>(g.slices) * 1024 + nrow * g.slices + nrow) * sizeof(float);
}

// Split K into slices, pick the tiles per warp, lay the parts' tiles out at multiples of it; returns the grid.
Geometry plan(Launch& g, int64_t units) {
  if (units < 1 || units > kMaxSlices * 32)
    throw std::invalid_argument("[lily] cuda decode gemv: input of " + std::to_string(units * 32) +
                                " elements, expected 32 to 8192");
  g.units = static_cast<int32_t>(units);
  g.slices = static_cast<int32_t>((units + 31) / 32);
  g.mwarps = std::max(1, kBlockWarps / g.slices);
  Geometry geo;
  geo.threads = 32 * g.slices * g.mwarps;
  const KernelKind kind = kind_of(g);
  geo.kernel = kernel_of(kind);
  const int64_t slots = static_cast<int64_t>(device_sm_count()) * blocks_per_sm(kind, geo.threads, 24 * 1024);
  // makespan ~ waves x (tiles per warp + 1): the +1 is a warp's staging and epilogue, about one tile's time
  int64_t best = -1;
  for (int t = 1; t <= kMaxTpw; ++t) {
    int64_t warps = 0;
    if (g.kmode) warps = (g.rows + kR - 1) / kR;
    else
      for (int p = 0; p < g.nparts; ++p) warps += (g.part[p].tiles + t - 1) / t * t;
    warps = (warps + t - 1) / t;
    const int64_t blocks = (warps + g.mwarps - 1) / g.mwarps;
    const int64_t span = (blocks + slots - 1) / slots * (t + 1);
    if (best < 0 || span <= best) best = span, g.tpw = t;
  }
  int64_t tiles = 0;
  if (g.kmode) {
    tiles = (g.rows + kR - 1) / kR;
  } else {
    for (int p = 0; p < g.nparts; ++p) {
      g.part[p].first = static_cast<int32_t>(tiles);
      tiles += (g.part[p].tiles + g.tpw - 1) / g.tpw * g.tpw;
    }
  }
  geo.grid = static_cast<int>((tiles + static_cast<int64_t>(g.mwarps) * g.tpw - 1) / (static_cast<int64_t>(g.mwarps) * g.tpw));
  geo.smem = smem_for(g);
  return geo;
}

void launch(cudaStream_t st, const Launch& g, const Geometry& geo) {
  if (geo.smem > 48 * 1024) throw std::logic_error("[lily] cuda decode gemv: shared memory over 48 KB");
  launch_pdl(geo.kernel, dim3(geo.grid), dim3(geo.threads), geo.smem, st, g);
}

}  // namespace

bool fits(const DLinear& w) {
  const kp::LinearParams& p = w.p;
  if (p.in % 32 != 0 || p.in > kMaxSlices * 1024 || p.out < 1) return false;
  if (p.kind != 0) return p.kind == 1 || p.kind == 2;
  if (p.bits != 4 && p.bits != 8) return false;
  // 4-bit: the tensor-core tile sums 64 elements under one scale (gemv_lane.cuh)
  return p.group >= (p.bits == 4 ? 64 : 32) && (p.group & (p.group - 1)) == 0 && p.in % p.group == 0;
}

bool down_fits(const DLinear& wd, const DLinear& ws) {
  return fits(wd) && fits(ws) && fmt_of(wd.p) == fmt_of(ws.p) && wd.p.out == ws.p.out &&
         wd.p.in + ws.p.in <= kMaxSlices * 1024;
}

int64_t head_blocks(int64_t rows) { return (rows + kR - 1) / kR; }  // at most one block per tile

unsigned proj(cudaStream_t st, const ProjArgs& a) {
  Launch g;
  g.xmode = a.xmode, g.in = a.in, g.eps = a.eps;
  g.xf = a.xf, g.nw = a.nw, g.xb = a.xb, g.h_out = a.h_out;
  g.route = a.route, g.rlogits = a.rlogits, g.E = a.E, g.top_k = a.top_k, g.norm_topk = a.norm_topk;
  g.top_idx = a.top_idx, g.top_w = a.top_w;
  g.conv_w = a.conv_w, g.conv_state = a.conv_state, g.u = a.u, g.conv_dim = a.conv_dim, g.conv_k = a.conv_k;
  g.amax = a.amax;
  if (a.xmode != kXBf16 && a.xmode != kXNorm)
    throw std::invalid_argument("[lily] cuda decode gemv: staging mode " + std::to_string(a.xmode) + ", expected 0 (bf16) or 1 (RMSNorm)");
  if (a.route && (a.top_k < 1 || a.top_k > kMaxTopK)) throw std::invalid_argument("[lily] cuda decode gemv: top_k");
  for (int s = 0; s < a.nseg; ++s) {
    const Seg& sg = a.seg[s];
    if (sg.w0.p.in != a.in) throw std::invalid_argument("[lily] cuda decode gemv: segment input length mismatch");
    if (!fits(sg.w0)) throw std::invalid_argument("[lily] cuda decode gemv: segment weight format not supported");
    g.y[s] = sg.y, g.yb[s] = sg.yb, g.y_step[s] = sg.y_step, g.mode[s] = sg.mode;
    const bool dual = sg.mode == kODual;
    for (int j = 0; j < sg.slots; ++j) {
      if (g.nparts == kMaxParts) throw std::invalid_argument("[lily] cuda decode gemv: more than 20 parts");
      Part P = part_of(sg.w0, sg.w1, dual);
      P.rows = static_cast<int32_t>(sg.w0.p.out);
      check_row_offsets(P, sg.w0);
      P.tiles = static_cast<int32_t>(dual ? (sg.w0.p.out + 1) / 2 : (sg.w0.p.out + kR - 1) / kR);
      P.seg = s, P.slot = j;
      P.expert = sg.routed ? j : -1;
      g.part[g.nparts++] = P;
    }
  }
  const Geometry geo = plan(g, a.in / 32);
  if (a.xmode == kXNorm && g.slices * 128 > kStageUnroll * geo.threads)  // the norm's one fetch step (stage_rows)
    throw std::invalid_argument("[lily] cuda decode gemv: RMSNorm staging of " + std::to_string(a.in) +
                                " elements, expected at most " + std::to_string(kMaxNormIn));
  launch(st, g, geo);
  return static_cast<unsigned>(geo.grid);
}

void moe_down(cudaStream_t st, const DownArgs& a) {
  if (!down_fits(a.wd, a.ws)) throw std::invalid_argument("[lily] cuda decode gemv: MoE down formats not supported");
  if (a.k < 1 || a.k > kMaxTopK) throw std::invalid_argument("[lily] cuda decode gemv: top_k");
  Launch g;
  g.kmode = 1;
  g.rows = static_cast<int32_t>(a.wd.p.out);
  g.top_k = a.k, g.top_idx = const_cast<int32_t*>(a.top_idx), g.top_w = const_cast<float*>(a.top_w);
  g.sgate = a.sgate;
  g.xacc = a.x;
  g.xfac = fmt_of(a.wd.p) == kQ4 ? 0 : 1;
  int32_t unit = 0;
  for (int j = 0; j <= a.k; ++j) {
    const DLinear& w = j < a.k ? a.wd : a.ws;
    Part P = part_of(w, w, false);
    P.first = unit;
    P.xsrc = j < a.k ? a.act + static_cast<int64_t>(j) * a.wd.p.in : a.sact;
    P.expert = j < a.k ? j : -1;
    P.fac = j < a.k ? 1 : 2;
    P.rows = static_cast<int32_t>(w.p.out);
    check_row_offsets(P, w);
    unit += static_cast<int32_t>(w.p.in / 32);
    g.part[g.nparts++] = P;
  }
  const Geometry geo = plan(g, unit);
  launch(st, g, geo);
}

}  // namespace lily::cuda::gemv
