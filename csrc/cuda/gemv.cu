// The decode GEMV (gemv.cuh): one kernel for every decode projection (a template, specialised per format set and
// staging, see Stage), measured in dev/gemv_lab (issue 14).
//
// Layout of the work. A launch is a list of parts (one weight matrix, or one expert of a stacked tensor). In row
// mode (proj) the parts are stacked along the output rows and read one input row; in K mode (moe_down) they sit
// side by side along K (8 experts' down rows and the shared expert's, each with its own input segment and
// factor) and sum into the same rows. The input is cut into units of 32 elements; lane l of slice s owns unit
// 32 s + l, so the slices = ceil(units / 32) warps of a row group split K (split-K inside the block, partials
// summed in shared memory at the end: plain stores, deterministic). A warp streams tiles of kR = 4 rows: per tile
// and lane one 16-byte vector per row (4-bit; 8-bit two, bf16 four, fp32 eight), the next tile's loads issued
// before this tile's math (a register double buffer, no shared-memory ring: the bytes in flight come from many
// warps, 16 per SM). A dual segment's tile holds 2 gate rows and the same 2 up rows, so SiLU(gate) * up is
// applied in the block's epilogue. Each part's tiles start at a multiple of the tiles per warp (tpw), so no warp
// crosses a part; the host picks tpw to minimise the makespan over the resident block slots.
//
// Dequantisation without int -> float conversions. A code q placed in the mantissa of 1.0f at bit p is the float
// 1 + q 2^(p-23): 4-bit nibbles go to bits 16-19 (even nibbles: 1 + q/128) or 12-15 (odd: 1 + q/2048) with one
// LOP3 each (the shifted copies v << 8, v >> 8, rot16(v) hold all 8 nibbles at those windows), 8-bit bytes to
// bits 15-22 with a shift and a LOP3 (1 + q/256). Two accumulators per row (even / odd windows) take fma(f, x, acc), so
//   sum q x = 128 (acc_e - X_e) + 2048 (acc_o - X_o)   (4-bit),   256 (acc - X) (8-bit),
// with X_e, X_o the lane's sums of x over its unit's even / odd positions, computed once per lane; the group
// term is s * sum q x + b * X. x is fp32 in shared memory, lane-major ([slice][8 float4][lane]: a warp's LDS.128
// reads 512 consecutive bytes, conflict-free), already multiplied by the part's factor (K mode).
#include "cuda/gemv.cuh"
#include "cuda/gemv_lane.cuh"

namespace lily::cuda::gemv {
namespace {

constexpr int kR = 4;            // rows per tile (the transpose reduction below is written for 4)
constexpr int kMaxParts = 20;    // 16 expert slots + the MoE entry's router / shared / gate segments
constexpr int kBlockWarps = 8;
constexpr int kMaxSlices = 8;    // input length <= 8192
constexpr int kMaxTpw = 64;

// The kernel is specialised at compile time per launch kind, so a launch runs a short body of its own: one generic
// body for every format, staging and K mode was 302 KB of SASS, and Nsight Compute showed the short launches
// stalled on instruction fetch (53-80% of the samples, cold; benchmarks/results/decode_gemv_h200.md).
enum Stage : int32_t { kStageBf16 = kXBf16, kStageNorm = kXNorm, kStageK = 2, kStages = 3 };
enum FmtSet : int32_t { kSetQ4 = 0, kSetQ4Q8 = 1, kSetAny = 2, kSets = 3 };  // the parts' formats
struct Part {
  const uint8_t* w0;      // codes or dense elements of expert 0 (the stack's base)
  const uint16_t* s0;
  const uint16_t* b0;
  const uint8_t* w1;      // dual: the up matrix
  const uint16_t* s1;
  const uint16_t* b1;
  const bf16* xsrc;       // K mode: this part's input segment
  int64_t expert_bytes, expert_groups;
  int32_t row_bytes, row_groups;
  int32_t fmt, gsh;       // format; log2(group / 32)
  int32_t rows;           // output rows (row mode); input elements (K mode)
  int32_t tiles;          // row mode: tiles holding real rows
  int32_t first;          // row mode: first logical tile (a multiple of tpw); K mode: first unit along K
  int32_t seg, slot;      // row mode: segment and output slot
  int32_t expert;         // -1: expert 0; >= 0: the routing's slot `expert`
  int32_t dual;
  int32_t fac;            // K mode: 0 none, 1 routing weight of slot `expert`, 2 sigmoid(shared gate)
};

struct Launch {
  Part part[kMaxParts];
  int32_t nparts = 0, kmode = 0, units = 0, slices = 0, mwarps = 0, tpw = 1, rows = 0, route = 0;
  // staging
  int32_t xmode = kXBf16, in = 0;
  float eps = 0.f;
  const float* xf = nullptr;
  const float* nw = nullptr;
  const bf16* xb = nullptr;
  bf16* h_out = nullptr;
  // routing (row mode: the prologue; K mode: ids and weights from the previous kernel)
  const float* rlogits = nullptr;
  int32_t E = 0, top_k = 0, norm_topk = 0, pad_ = 0;
  int32_t* top_idx = nullptr;
  float* top_w = nullptr;
  const float* sgate = nullptr;
  // epilogue
  float* y[kMaxSegs] = {};
  bf16* yb[kMaxSegs] = {};
  int64_t y_step[kMaxSegs] = {};
  int32_t mode[kMaxSegs] = {};
  const float* conv_w = nullptr;
  float* conv_state = nullptr;
  float* u = nullptr;
  int32_t conv_dim = 0, conv_k = 0;
  unsigned long long* amax = nullptr;
  float* xacc = nullptr;  // K mode: the residual row
};
static_assert(sizeof(Launch) <= 4000, "Launch must fit the kernel parameter space");

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
      tot[i] = unit_dot<FMT>(q, 0u, 0u, x, 0.f, 0.f, 0.f);
    }
  }
};

__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t row) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<uint32_t>(row));
}

struct Smem {  // the statically sized part of the kernel's shared memory
  float red[kBlockWarps];
  float inv;
  float fac[kMaxParts];
  int32_t idx[kMaxTopK];
  float w[kMaxTopK];
  unsigned long long key;
};

// Staging, in two halves with a block barrier between them (the caller's): stage_prologue is what the routed
// parts' weight loads and the element loop depend on (the routing: the prologue in row mode or the previous
// kernel's ids in K mode; the K parts' factors; the norm's reduction); stage_rows writes the input row into shared
// memory (fp32, lane-major, zero past its end) with the producer's normalisation (same arithmetic as rms_norm_kernel:
// the value is rounded to bf16 as the unfused path rounds it). Between the two the routed parts issue their first
// weight loads, so those are in flight while the row is staged. The RMSNorm reads its row once: the thread's
// elements (one step of stage_fetch, at most kStageUnroll x 8, the host's check) are loaded before the prologue,
// which sums their squares, and stage_rows normalises them from registers (a second pass over the row from L2 cost
// the launch 1.2-1.7 us, check_decode's RMSNorm rows against the bf16 ones).
// 8 elements per thread and step (one 16-byte load of bf16, two of fp32), kStageUnroll steps' loads issued before
// any is used: a step that waited for its load before the next would pay an L2 round trip each.
constexpr int kStageUnroll = 2;
struct StageRaw {
  uint4 v[kStageUnroll][2];
  float fac[kStageUnroll];
};

// The loads of the step at group `base` (groups of 8 elements base + r * blockDim.x), zeros past the row's end.
template <int STAGE>
__device__ __forceinline__ void stage_fetch(const Launch& g, const Smem& sm, int base, StageRaw& raw) {
  const int nth = blockDim.x, n = STAGE == kStageK ? g.units * 32 : g.in, groups = g.slices * 128;
#pragma unroll
  for (int r = 0; r < kStageUnroll; ++r) {
    const int i = (base + r * nth) * 8;
    raw.fac[r] = 1.f;
    raw.v[r][0] = raw.v[r][1] = make_uint4(0u, 0u, 0u, 0u);
    if (base + r * nth >= groups || i >= n) continue;
    if constexpr (STAGE == kStageK) {
      int p = 0;
      while (p + 1 < g.nparts && (i >> 5) >= g.part[p + 1].first) ++p;
      raw.v[r][0] = *reinterpret_cast<const uint4*>(g.part[p].xsrc + (i - g.part[p].first * 32));
      raw.fac[r] = sm.fac[p];
    } else if constexpr (STAGE == kStageBf16) {
      raw.v[r][0] = *reinterpret_cast<const uint4*>(g.xb + i);
    } else {
      raw.v[r][0] = *reinterpret_cast<const uint4*>(g.xf + i);
      raw.v[r][1] = *reinterpret_cast<const uint4*>(g.xf + i + 4);
    }
  }
}

template <int STAGE>
__device__ void stage_prologue(const Launch& g, Smem& sm, const StageRaw& raw) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  if (g.route && warp == 0) {
    route_topk_warp(g.rlogits, g.E, g.top_k, g.norm_topk != 0, sm.idx, sm.w, lane);
    if (blockIdx.x == 0 && lane < g.top_k) g.top_idx[lane] = sm.idx[lane], g.top_w[lane] = sm.w[lane];  // its own slot
  }
  if constexpr (STAGE == kStageK) {
    if (tid < g.top_k) sm.idx[tid] = g.top_idx[tid];
    if (tid < g.nparts) {
      const Part& P = g.part[tid];
      sm.fac[tid] = P.fac == 1 ? g.top_w[P.expert] : P.fac == 2 ? 1.f / (1.f + expf(-g.sgate[0])) : 1.f;
    }
  } else if constexpr (STAGE == kStageNorm) {
    float ss = 0.f;
#pragma unroll
    for (int r = 0; r < kStageUnroll; ++r) {
      const uint32_t w8[8] = {raw.v[r][0].x, raw.v[r][0].y, raw.v[r][0].z, raw.v[r][0].w,
                              raw.v[r][1].x, raw.v[r][1].y, raw.v[r][1].z, raw.v[r][1].w};
#pragma unroll
      for (int k = 0; k < 8; ++k) ss = fmaf(__uint_as_float(w8[k]), __uint_as_float(w8[k]), ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) sm.red[warp] = ss;
    __syncthreads();
    if (warp == 0) {
      float v = lane < nw ? sm.red[lane] : 0.f;
      v = warp_sum(v);
      if (lane == 0) sm.inv = rsqrtf(v / static_cast<float>(g.in) + g.eps);
    }
  }
}

// The fetched step's elements (converted, scaled or normalised) into shared memory.
template <int STAGE>
__device__ __forceinline__ void stage_put(const Launch& g, float* xs, const Smem& sm, int base, const StageRaw& raw) {
  const int nth = blockDim.x, n = STAGE == kStageK ? g.units * 32 : g.in, groups = g.slices * 128;
  const bool write_h = g.h_out != nullptr && blockIdx.x == 0;
#pragma unroll
  for (int r = 0; r < kStageUnroll; ++r) {
    const int i = (base + r * nth) * 8;
    if (base + r * nth >= groups) continue;
    float v[8];
    const uint32_t w8[8] = {raw.v[r][0].x, raw.v[r][0].y, raw.v[r][0].z, raw.v[r][0].w,
                            raw.v[r][1].x, raw.v[r][1].y, raw.v[r][1].z, raw.v[r][1].w};
    if (i >= n) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = 0.f;
    } else if constexpr (STAGE == kStageK || STAGE == kStageBf16) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w8[k] << 16) * raw.fac[r];
        v[2 * k + 1] = __uint_as_float(w8[k] & 0xFFFF0000u) * raw.fac[r];
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const bf16 h = __float2bfloat16(__uint_as_float(w8[k]) * sm.inv * g.nw[i + k]);
        if (write_h) g.h_out[i + k] = h;
        v[k] = __bfloat162float(h);
      }
    }
    // lane-major: elements i..i+3 and i+4..i+7 are float4s 32 apart (xpos)
    float4* dst = reinterpret_cast<float4*>(xs) + ((i >> 10) * 8 + ((i & 31) >> 2)) * 32 + ((i >> 5) & 31);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[32] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

template <int STAGE>
__device__ void stage_rows(const Launch& g, float* xs, const Smem& sm, StageRaw& raw) {
  if constexpr (STAGE == kStageNorm) {
    stage_put<STAGE>(g, xs, sm, threadIdx.x, raw);  // fetched before the prologue: one step covers the row
  } else {
    for (int base = threadIdx.x; base < g.slices * 128; base += kStageUnroll * blockDim.x) {
      stage_fetch<STAGE>(g, sm, base, raw);
      stage_put<STAGE>(g, xs, sm, base, raw);
    }
  }
}

// This warp's tiles [t0, t1) of part P (local tile indices), partial sums into `partial`; the staging (all
// threads) happens in here, after the first loads: those of parts that do not depend on the routing go out before
// the PDL wait (overlapping the previous kernel's tail), the routed parts' once the prologue has the routing.
template <int FMT, int STAGE>
__device__ void run_warp(const Launch& g, const Part& P, int t0, int t1, int unit, int pslot, float* xs,
                         float* partial, Smem& sm) {
  using F = FmtTraits<FMT>;
  const int lane = threadIdx.x & 31;
  constexpr bool kQuant = FmtTraits<FMT>::kQuant;
  Cursor<FMT> cur;
  TileRegs<FMT> cur_t;
  const bool early = P.expert < 0 && t0 < t1;
  if (early) {
    cur.setup(P, 0, unit);
    if constexpr (kQuant) cur.load(t0, cur_t);
  }
  pdl_trigger();
  pdl_wait();  // everything below reads the previous kernels' outputs
  StageRaw raw;
  if constexpr (STAGE == kStageNorm) stage_fetch<STAGE>(g, sm, threadIdx.x, raw);
  stage_prologue<STAGE>(g, sm, raw);
  __syncthreads();
  // The routed parts' loads go out now that the expert is known, in flight while the row is staged. (ptxas
  // reports 4 bytes of spill for the kernel since this split, from the 8-bit path: it is 0 with that path
  // compiled out; the 8-bit launches are the router and the shared-expert gate.)
  if (!early && t0 < t1) {
    cur.setup(P, P.expert >= 0 ? sm.idx[P.expert] : 0, unit);
    if constexpr (kQuant) cur.load(t0, cur_t);
  }
  stage_rows<STAGE>(g, xs, sm, raw);
  __syncthreads();
  const int sl = (threadIdx.x >> 5) % g.slices;
  const float4* xl = reinterpret_cast<const float4*>(xs) + sl * 8 * 32 + lane;
  float x[32];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float4 t = xl[k * 32];
    x[4 * k] = t.x, x[4 * k + 1] = t.y, x[4 * k + 2] = t.z, x[4 * k + 3] = t.w;
  }
  float xe = 0.f, xo = 0.f;
#pragma unroll
  for (int k = 0; k < 32; k += 2) xe += x[k], xo += x[k + 1];
  // (opaque to the compiler, which otherwise recomputed the 32-term sums inside the tile loop to save registers)
  asm volatile("" : "+f"(xe), "+f"(xo));
  const float xa = xe + xo;
  // One tile's math and its row sums into `partial`.
  auto tile = [&](int t, const TileRegs<FMT>& tr) {
    float tot[kR];
    if constexpr (kQuant) {
#pragma unroll
      for (int i = 0; i < kR; ++i) tot[i] = unit_dot<FMT>(tr.q[i], tr.s[i], tr.b[i], x, xe, xo, xa);
    } else {
      cur.dense_dot(t, x, tot);
    }
    const float r = reduce_rows4(tot, lane);
    if ((lane & 7) == 0) partial[((pslot + (t - t0)) * kR + reduced_row(lane)) * g.slices + sl] = r;
  };
  if constexpr (F::kPrefetch) {
    // The register double buffer as two named tiles, the loop unrolled by two: the next tile's loads go out
    // before this tile's math, and no tile is copied between buffers (a conditional copy was 24 SELs per tile).
    TileRegs<FMT> nxt;
    for (int t = t0; t < t1; t += 2) {
      if (t + 1 < t1) cur.load(t + 1, nxt);
      tile(t, cur_t);
      if (t + 1 >= t1) break;
      if (t + 2 < t1) cur.load(t + 2, cur_t);
      tile(t + 1, nxt);
    }
  } else {
    for (int t = t0; t < t1; ++t) {
      tile(t, cur_t);
      if (kQuant && t + 1 < t1) cur.load(t + 1, cur_t);
    }
  }
}

__device__ __forceinline__ float silu_(float v) { return v / (1.f + expf(-v)); }

// Output row `row` of part P: v0 is the row's dot product (the gate's for a dual part), v1 the up projection's.
__device__ __forceinline__ void epilogue(const Launch& g, const Part& P, int64_t row, float v0, float v1,
                                         unsigned long long& key) {
  const int sg = P.seg;
  const int64_t o = P.slot * g.y_step[sg] + row;
  const int mode = g.mode[sg];
  if (mode == kOStore) {
    g.y[sg][o] = v0;
    key = max(key, argmax_key(v0, row));
  } else if (mode == kOAccum) {
    g.y[sg][o] += v0;
  } else if (mode == kODual) {
    g.yb[sg][o] = __float2bfloat16(silu_(v0) * v1);
  } else {  // DeltaNet causal conv of channel `row` + SiLU, state shifted by one
    const int K = g.conv_k;
    const int64_t C = g.conv_dim;
    const float* w = g.conv_w + row * K;
    float* cs = g.conv_state;
    float cv = 0.f;
    for (int j = 0; j < K - 1; ++j) cv += w[j] * cs[j * C + row];
    cv += w[K - 1] * v0;
    g.u[row] = cv / (1.f + expf(-cv));
    for (int r = 0; r < K - 1; ++r) cs[r * C + row] = r + 1 < K - 1 ? cs[(r + 1) * C + row] : v0;
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
  if constexpr (SET == kSetQ4) {
    run_warp<kQ4, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm);
  } else if constexpr (SET == kSetQ4Q8) {
    if (P.fmt == kQ8) run_warp<kQ8, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm);
    else run_warp<kQ4, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm);
  } else {
    switch (P.fmt) {
      case kQ4: run_warp<kQ4, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm); break;
      case kQ8: run_warp<kQ8, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm); break;
      case kBF16: run_warp<kBF16, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm); break;
      default: run_warp<kF32, STAGE>(g, P, t0, t1, u, pslot, xs, partial, sm); break;
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
      if (row < g.rows) g.xacc[row] += rowv[i];
    } else {
      int q = 0;
      while (q + 1 < g.nparts && T >= g.part[q + 1].first) ++q;
      const Part& Q = g.part[q];
      const int lt = T - Q.first;
      if (lt >= Q.tiles) continue;
      if (Q.dual) {
        if (r4 >= 2) continue;
        const int64_t row = 2 * lt + r4;
        if (row < Q.rows) epilogue(g, Q, row, rowv[i], rowv[i + 2], key);
      } else {
        const int64_t row = static_cast<int64_t>(lt) * kR + r4;
        if (row < Q.rows) epilogue(g, Q, row, rowv[i], 0.f, key);
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

int sm_count() {
  static int n = 0;
  if (!n) {
    int dev = 0;
    LILY_CUDA_CHECK(cudaGetDevice(&dev));
    LILY_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  }
  return n;
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
  const int64_t slots = static_cast<int64_t>(sm_count()) * blocks_per_sm(kind, geo.threads, 24 * 1024);
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
  return p.group >= 32 && (p.group & (p.group - 1)) == 0 && p.in % p.group == 0;
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
