// The decode GEMV's launch block (the kernel's one argument: every part of every segment, the staging, routing
// and epilogue settings) and its input staging, shared by the kernel's format paths (gemv.cu, included there only).
#pragma once
#include "cuda/gemv.cuh"

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
  int32_t xfac = 1;  // K mode: the staging scales each part's input by its factor (4-bit: the fold does, in fp32)
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

// A thread's first epilogue row's operands, loaded early: the DeltaNet conv's weights and state before the PDL wait
// (constants, and a state only this layer's previous step writes), an accumulated residual right after it (the
// previous kernels write it). Each was an L2 round trip inside the epilogue, after the tiles: loaded early, greedy
// decode 1.019-1.021x on the H200 (compare_builds_epilogue_h200.json).
constexpr int kMaxConvK = 4;
struct EpiPre {
  int kind = 0;      // 0 none, 1 conv, 2 accumulate
  int64_t idx = 0;   // conv: the row (channel); accumulate: the output element
  float* acc = nullptr;
  float w[kMaxConvK], st[kMaxConvK - 1], y = 0.f;
  __device__ __forceinline__ void after_wait() {
    if (kind == 2) y = acc[idx];
  }
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
      raw.fac[r] = g.xfac ? sm.fac[p] : 1.f;
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

// Everything before a warp's tiles: the first tile's loads of parts that do not depend on the routing go out
// before the PDL wait (overlapping the previous kernel's tail), then the staging (all threads), with the routed
// parts' first loads issued once the prologue has the routing, so they are in flight while the row is staged.
// load0(routed) issues the first loads (routed: the routing is known); `early` says whether they go before the wait.
template <int STAGE, typename Load0>
__device__ __forceinline__ void warp_prologue(const Launch& g, bool early, float* xs, Smem& sm, EpiPre& pre,
                                              Load0&& load0) {
  if (early) load0(false);
  pdl_trigger();
  pdl_wait();  // everything below reads the previous kernels' outputs
  pre.after_wait();
  StageRaw raw;
  if constexpr (STAGE == kStageNorm) stage_fetch<STAGE>(g, sm, threadIdx.x, raw);
  stage_prologue<STAGE>(g, sm, raw);
  __syncthreads();
  if (!early) load0(true);
  stage_rows<STAGE>(g, xs, sm, raw);
  __syncthreads();
}

}  // namespace
}  // namespace lily::cuda::gemv
