// The decode GEMVs' entry points (proj, moe_down) and their scalar-lane kernels: any weight format, one warp per
// few rows; the tensor-core implementations are gemv_tc.cu, gemv_ring.cu and gemv_bulk.cu.
#include "cuda/gemv.cuh"
#include "cuda/gemv_stage.cuh"
#include "cuda/gemv_tc.cuh"

namespace lily::cuda::gemv {
namespace {

static_assert(sizeof(ProjArgs) <= 4000, "ProjArgs must fit the kernel parameter space");
static_assert(sizeof(DownArgs) <= 4000, "DownArgs must fit the kernel parameter space");

// ---- one 16-byte chunk of quantized codes against the staged activations -------------------------------
// Codes become floats without I2F: (code << shift) | 0x3F800000 is the float 1 + code/2^bits, and
//   sum_i (s q_i + b) x_i = s 2^bits sum_i (1 + q_i/2^bits) x_i + (b - s 2^bits) sum_i x_i   (as gemm.cu).
template <int BITS>
__device__ __forceinline__ float chunk_x(const bf16* xs, float* x) {  // x[128 / BITS]; returns sum x
  constexpr int VPC = 128 / BITS;
  float sx = 0.f;
#pragma unroll
  for (int u = 0; u < VPC / 8; ++u) {
    const uint4 xv = reinterpret_cast<const uint4*>(xs)[u];
    const uint32_t w4[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[8 * u + 2 * j] = __uint_as_float(w4[j] << 16);
      x[8 * u + 2 * j + 1] = __uint_as_float(w4[j] & 0xFFFF0000u);
      sx += x[8 * u + 2 * j] + x[8 * u + 2 * j + 1];
    }
  }
  return sx;
}

template <int BITS>
__device__ __forceinline__ float chunk_d(const uint4& q, const float* x) {
  constexpr int VPW = 32 / BITS;
  constexpr uint32_t MASK = ((1u << BITS) - 1u) << (23 - BITS);
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  float d = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int j = 0; j < VPW; ++j) {
      const int sh = (23 - BITS) - BITS * j;
      const uint32_t m = (sh >= 0 ? qw[w] << sh : qw[w] >> -sh) & MASK;
      d += __uint_as_float(m | 0x3F800000u) * x[w * VPW + j];
    }
  return d;
}

template <int BITS>
__device__ __forceinline__ float chunk_term(float d, float sx, float s, float b) {
  constexpr float SCALE = static_cast<float>(1 << BITS);
  return s * SCALE * d + (b - SCALE * s) * sx;
}

// Lane-strided dot of one weight row (any format) with xs; the lane's partial (reduce over the warp).
__device__ float row_dot(const DLinear& W, int64_t e, int64_t row, const bf16* xs, int lane) {
  const kp::LinearParams& p = W.p;
  float acc = 0.f;
  if (p.kind == 0) {
    const int64_t gpr = p.in / p.group;
    const uint16_t* sc = W.scales + e * p.expert_groups + row * gpr;
    const uint16_t* bi = W.biases + e * p.expert_groups + row * gpr;
    if (p.bits == 4) {
      const int64_t cpr = p.in / 32;
      const int cpg = p.group / 32;
      const uint4* c = reinterpret_cast<const uint4*>(W.codes + e * p.expert_words + row * (p.in / 8));
      for (int64_t ch = lane; ch < cpr; ch += 32) {
        float x[32];
        const float sx = chunk_x<4>(xs + ch * 32, x);
        acc += chunk_term<4>(chunk_d<4>(__ldg(c + ch), x), sx, bf2f(sc[ch / cpg]), bf2f(bi[ch / cpg]));
      }
    } else {
      const int64_t cpr = p.in / 16;
      const int cpg = p.group / 16;
      const uint4* c = reinterpret_cast<const uint4*>(W.codes + e * p.expert_words + row * (p.in / 4));
      for (int64_t ch = lane; ch < cpr; ch += 32) {
        float x[16];
        const float sx = chunk_x<8>(xs + ch * 16, x);
        acc += chunk_term<8>(chunk_d<8>(__ldg(c + ch), x), sx, bf2f(sc[ch / cpg]), bf2f(bi[ch / cpg]));
      }
    }
  } else if (p.kind == 1) {
    const uint16_t* d = static_cast<const uint16_t*>(W.dense) + e * p.expert_elems + row * p.in;
    for (int64_t k = lane; k < p.in; k += 32) acc += bf2f(d[k]) * bf2f(xs[k]);
  } else {
    const float* d = static_cast<const float*>(W.dense) + e * p.expert_elems + row * p.in;
    for (int64_t k = lane; k < p.in; k += 32) acc += d[k] * bf2f(xs[k]);
  }
  return acc;
}

// NR quantized weight rows of one warp: each step issues U 16-byte chunk loads per row per lane (load) before
// any is used (compute), so 16 * NR * U bytes per lane are in flight. Dual segments put the gate rows in
// slots [0, NR/2) and the up rows in [NR/2, NR).
template <int NR, int BITS, int U>
struct QRows {
  static constexpr int VPC = 128 / BITS;
  const uint4* cp[NR];
  const uint16_t* sp[NR];
  const uint16_t* bp[NR];
  int cpr = 0, cpg = 1;
  uint4 q[U][NR];
  float s[U][NR], b[U][NR];

  __device__ __forceinline__ void setup(const DLinear& w0, const DLinear& w1, bool dual, int64_t e, int64_t row0) {
    const kp::LinearParams& p = w0.p;
    const int64_t wpr = p.in * BITS / 32, gpr = p.in / p.group;
    cpr = static_cast<int>(p.in / VPC);
    cpg = p.group / VPC;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const bool second = dual && i >= NR / 2;
      const DLinear& w = second ? w1 : w0;
      const int64_t row = min64(row0 + (second ? i - NR / 2 : i), p.out - 1);
      cp[i] = reinterpret_cast<const uint4*>(w.codes + e * p.expert_words + row * wpr);
      sp[i] = w.scales + e * p.expert_groups + row * gpr;
      bp[i] = w.biases + e * p.expert_groups + row * gpr;
    }
  }
  __device__ __forceinline__ int steps() const { return (cpr + 32 * U - 1) / (32 * U); }
  __device__ __forceinline__ void load(int it, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ch = (it * U + u) * 32 + lane;
      const bool ok = ch < cpr;
      const int g = ch / cpg;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        q[u][i] = ok ? __ldg(cp[i] + ch) : make_uint4(0u, 0u, 0u, 0u);
        s[u][i] = ok ? bf2f(__ldg(sp[i] + g)) : 0.f;
        b[u][i] = ok ? bf2f(__ldg(bp[i] + g)) : 0.f;
      }
    }
  }
  __device__ __forceinline__ void compute(int it, int lane, const bf16* xs, float acc[NR]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ch = (it * U + u) * 32 + lane;
      if (ch >= cpr) continue;
      float x[VPC];
      const float sx = chunk_x<BITS>(xs + ch * VPC, x);
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i] += chunk_term<BITS>(chunk_d<BITS>(q[u][i], x), sx, s[u][i], b[u][i]);
    }
  }
};

template <int NR, int BITS, int U>
__device__ __forceinline__ void qrows_run(QRows<NR, BITS, U>& r, int lane, const bf16* xs, float acc[NR]) {
  const int n = r.steps();
  for (int it = 0; it < n; ++it) {
    if (it > 0) r.load(it, lane);
    r.compute(it, lane, xs, acc);
  }
}

template <int NR>
__global__ void __launch_bounds__(kThreads, 2) proj_kernel(const __grid_constant__ ProjArgs a) {
  extern __shared__ __align__(16) unsigned char proj_smem[];
  bf16* xs = reinterpret_cast<bf16*>(proj_smem);
  __shared__ float red[kWarps];
  __shared__ int32_t s_idx[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  __shared__ unsigned long long s_key[kWarps];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gw = blockIdx.x * kWarps + warp;

  int si = -1;
  for (int s = 0; s < a.nseg; ++s)
    if (gw >= a.seg[s].warp0 && gw < a.seg[s].warp0 + a.seg[s].slots * a.seg[s].warps_per_slot) si = s;
  const bool active = si >= 0;
  const Seg& sg = a.seg[active ? si : 0];
  const kp::LinearParams& p = sg.w0.p;
  const bool dual = sg.mode == kODual;
  const int rpw = dual ? NR / 2 : NR;  // output rows of this warp
  int slot = 0;
  int64_t row0 = 0;
  if (active) {
    const int lw = gw - sg.warp0;
    slot = lw / sg.warps_per_slot;
    row0 = static_cast<int64_t>(lw % sg.warps_per_slot) * rpw;
  }
  const bool q4 = p.kind == 0 && p.bits == 4, q8 = p.kind == 0 && p.bits == 8;

  // Weights never depend on the activations: the first loads go out before the prologue.
  QRows<NR, 4, 2> r4;
  const bool pre = active && q4 && !sg.routed;
  if (pre) {
    r4.setup(sg.w0, sg.w1, dual, 0, row0);
    r4.load(0, lane);
  }
  pdl_trigger();
  pdl_wait();  // everything below reads the previous kernels' outputs
  stage_x(a, xs, red, tid, warp, lane);
  if (a.route && warp == 0) route_warp(a, s_idx, s_w, lane);
  __syncthreads();

  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.f;
  if (active) {
    const int64_t e = sg.routed ? s_idx[slot] : 0;
    if (q4) {
      if (!pre) {
        r4.setup(sg.w0, sg.w1, dual, e, row0);
        r4.load(0, lane);
      }
      qrows_run(r4, lane, xs, acc);
    } else if (q8) {
      QRows<NR, 8, 2> r8;
      r8.setup(sg.w0, sg.w1, dual, e, row0);
      r8.load(0, lane);
      qrows_run(r8, lane, xs, acc);
    } else {
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const bool second = dual && i >= NR / 2;
        const int64_t row = min64(row0 + (second ? i - NR / 2 : i), p.out - 1);
        acc[i] = row_dot(second ? sg.w1 : sg.w0, e, row, xs, lane);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = warp_sum(acc[i]);

  unsigned long long key = 0ull;
  if (active && lane == 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i)
      if (i < rpw) seg_epilogue(a, sg, slot, row0 + i, acc[i], acc[(i + NR / 2) % NR], key);
  }
  if (a.amax) {  // block maximum of (logit, -row): the greedy head
    if (lane == 0) s_key[warp] = key;
    __syncthreads();
    if (tid == 0) {
      unsigned long long m = 0ull;
      for (int w = 0; w < kWarps; ++w) m = max(m, s_key[w]);
      a.amax[blockIdx.x] = m;
    }
  }
}

// x[r] += sum_j w_j (act_j . Wd[e_j][r]) + sigmoid(g) (sact . Ws[r]): the routed experts' and the shared
// expert's down projections as one K-concatenated row, the MoE combine and the residual add fused.
template <int NR, int U>
struct DRows {
  const DownArgs* a;
  int64_t row[NR];
  int k = 0, cr = 0, total = 0;
  uint4 q[U][NR];
  float s[U][NR], b[U][NR];

  // Flat chunk f -> (part j, chunk c of the part); part k is the shared expert.
  __device__ __forceinline__ void part(int f, int& j, int& c) const {
    j = f < k * cr ? f / cr : k;
    c = j < k ? f - j * cr : f - k * cr;
  }
  __device__ __forceinline__ void load(int f0, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int f = f0 + 32 * u + lane;
      const bool ok = f < total;
      int j = 0, c = 0;
      if (ok) part(f, j, c);
      const DLinear& W = j < k ? a->wd : a->ws;
      const kp::LinearParams& p = W.p;
      const int64_t e = ok && j < k ? a->top_idx[j] : 0;
      const int vpc = 128 / p.bits;
      const int64_t wpr = p.in * p.bits / 32, gpr = p.in / p.group;
      const int g = c / (p.group / vpc);
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const uint4* cp = reinterpret_cast<const uint4*>(W.codes + e * p.expert_words + row[i] * wpr);
        const int64_t gi = e * p.expert_groups + row[i] * gpr + g;
        q[u][i] = ok ? __ldg(cp + c) : make_uint4(0u, 0u, 0u, 0u);
        s[u][i] = ok ? bf2f(__ldg(W.scales + gi)) : 0.f;
        b[u][i] = ok ? bf2f(__ldg(W.biases + gi)) : 0.f;
      }
    }
  }
  __device__ __forceinline__ void compute(int f0, int lane, const bf16* xs, const float* fac, float acc[NR]) {
    const int64_t I = a->wd.p.in;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int f = f0 + 32 * u + lane;
      if (f >= total) continue;
      int j, c;
      part(f, j, c);
      const int bits = j < k ? a->wd.p.bits : a->ws.p.bits;
      const bf16* xp = xs + static_cast<int64_t>(j) * I;  // act_j, or sact after the k routed rows
      if (bits == 4) {
        float x[32];
        const float sx = chunk_x<4>(xp + c * 32, x);
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += fac[j] * chunk_term<4>(chunk_d<4>(q[u][i], x), sx, s[u][i], b[u][i]);
      } else {
        float x[16];
        const float sx = chunk_x<8>(xp + c * 16, x);
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += fac[j] * chunk_term<8>(chunk_d<8>(q[u][i], x), sx, s[u][i], b[u][i]);
      }
    }
  }
};

template <int NR, int U>
__global__ void __launch_bounds__(kThreads) down_kernel(const __grid_constant__ DownArgs a) {
  extern __shared__ __align__(16) unsigned char down_smem[];
  bf16* xs = reinterpret_cast<bf16*>(down_smem);  // [k*I + Is]: act rows, then sact
  __shared__ float fac[kMaxTopK + 1];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, k = a.k;
  const int64_t I = a.wd.p.in, Is = a.ws.p.in, H = a.wd.p.out;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * NR;
  const bool active = row0 < H;
  const bool flat = a.wd.p.kind == 0 && a.ws.p.kind == 0;
  pdl_trigger();
  pdl_wait();  // the routing and the activations come from the previous kernel

  DRows<NR, U> r;
  r.a = &a;
  r.k = k;
#pragma unroll
  for (int i = 0; i < NR; ++i) r.row[i] = min64(row0 + i, H - 1);
  if (flat) {
    r.cr = static_cast<int>(I / (128 / a.wd.p.bits));
    r.total = k * r.cr + static_cast<int>(Is / (128 / a.ws.p.bits));
    if (active) r.load(0, lane);
  }
  // Stage the activations (the previous kernels' outputs) while the first weights are in flight.
  if ((I % 8) == 0 && (Is % 8) == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(a.act);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int64_t i = tid; i < k * I / 8; i += kThreads) dst[i] = src[i];
    const uint4* ss = reinterpret_cast<const uint4*>(a.sact);
    uint4* sd = reinterpret_cast<uint4*>(xs + k * I);
    for (int64_t i = tid; i < Is / 8; i += kThreads) sd[i] = ss[i];
  } else {
    for (int64_t i = tid; i < k * I; i += kThreads) xs[i] = a.act[i];
    for (int64_t i = tid; i < Is; i += kThreads) xs[k * I + i] = a.sact[i];
  }
  if (tid < k) fac[tid] = a.top_w[tid];
  if (tid == 0) fac[k] = sigmoidf_(a.sgate[0]);
  __syncthreads();
  if (!active) return;

  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.f;
  if (flat) {
    for (int f0 = 0; f0 < r.total; f0 += 32 * U) {
      if (f0 > 0) r.load(f0, lane);
      r.compute(f0, lane, xs, fac, acc);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      float t = 0.f;
      for (int j = 0; j < k; ++j) t += fac[j] * row_dot(a.wd, a.top_idx[j], r.row[i], xs + j * I, lane);
      t += fac[k] * row_dot(a.ws, 0, r.row[i], xs + k * I, lane);
      acc[i] = t;
    }
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = warp_sum(acc[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i)
      if (row0 + i < H) a.x[row0 + i] += acc[i];
  }
}

}  // namespace

unsigned proj_scalar(cudaStream_t st, const ProjArgs& in) {
  ProjArgs a = in;
  int64_t rows = 0;
  for (int s = 0; s < a.nseg; ++s) {
    const Seg& g = a.seg[s];
    if (g.w0.p.in != a.in) throw std::invalid_argument("[lily] cuda decode proj: segment input length mismatch");
    rows += static_cast<int64_t>(g.slots) * g.w0.p.out * (g.mode == kODual ? 2 : 1);
  }
  const int nr = (a.amax || rows >= 8192) ? 4 : 2;
  int64_t w = 0;
  for (int s = 0; s < a.nseg; ++s) {
    Seg& g = a.seg[s];
    const int rpw = g.mode == kODual ? nr / 2 : nr;
    g.warps_per_slot = static_cast<int32_t>((g.w0.p.out + rpw - 1) / rpw);
    g.warp0 = static_cast<int32_t>(w);
    w += static_cast<int64_t>(g.slots) * g.warps_per_slot;
  }
  const unsigned blocks = static_cast<unsigned>((w + kWarps - 1) / kWarps);
  const size_t smem = (static_cast<size_t>(a.in) * sizeof(bf16) + 15) / 16 * 16;
  if (nr == 4) launch_pdl(proj_kernel<4>, blocks, kThreads, smem, st, a);
  else launch_pdl(proj_kernel<2>, blocks, kThreads, smem, st, a);
  return blocks;
}

void moe_down_scalar(cudaStream_t st, const DownArgs& a) {
  constexpr int NR = 2, U = 4;
  const int64_t H = a.wd.p.out;
  const unsigned blocks = static_cast<unsigned>(((H + NR - 1) / NR + kWarps - 1) / kWarps);
  const size_t smem = ((a.k * a.wd.p.in + a.ws.p.in) * sizeof(bf16) + 15) / 16 * 16;
  launch_pdl(down_kernel<NR, U>, blocks, kThreads, smem, st, a);
}

// impl 3 (auto) takes what measured fastest per kernel on the H200 (benchmarks/kernels/check_decode.cu, with
// PDL, 2026-11-30): per-warp rings for the projections (lm_head 122 vs 170 us on scalar lanes, the others equal
// or slightly faster), scalar lanes for the routed experts' gate/up (6.8 vs 8.2 us: their weight loads go out
// before the routing, which the ring cannot do), the bulk-copy MoE down (7.4 vs 15.3 us).
unsigned proj(cudaStream_t st, const ProjArgs& a, int impl) {
  if ((impl == 4 || (impl == 3 && !a.route)) && ring_launch_ok(a)) return proj_ring(st, a);
  if (impl == 2 && bulk_launch_ok(a)) return proj_bulk(st, a);
  return impl == 1 || (impl == 2 && a.in % kGroup == 0) ? proj_tc(st, a) : proj_scalar(st, a);
}

void moe_down(cudaStream_t st, const DownArgs& a, int impl) {
  if (impl >= 2 && bulk_down_ok(a)) return moe_down_bulk(st, a);
  const bool ok = impl >= 1 && tc_ok(a.wd.p) && tc_ok(a.ws.p) && a.k <= kMaxTopK;
  if (!ok) return moe_down_scalar(st, a);
  moe_down_tc(st, a);
}

}  // namespace lily::cuda::gemv
