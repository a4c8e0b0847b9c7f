// Decode GEMVs on the tensor cores: the one-token projections (proj) and the MoE down + combine (down) with
// 4-bit weights read as mma.sync A fragments and the activation row as the B operand.
//
// Why: the scalar GEMV (gemv.cu) spends ~3.6 instructions per weight (shift, mask, FMA, plus the activation
// unpacking), about as long as the H200 takes to stream the bytes, and its load and compute phases do not
// overlap. Here a warp turns 8 codes into 4 bf16x2 A elements with one LOP3 each ((q & 0xF) | 0x4300 is the
// bf16 128 + q, exact), and one m16n8k16 MMA does 256 multiply-adds: ~0.7 instructions per weight.
//
// Arithmetic (exact weights, no bf16 rounding of s q + b): per 64-value group g of a row,
//   sum_k (s q_k + b) x_k = s * D_g + (b - 128 s) * X_g,   D_g = sum_k (128 + q_k) x_k (MMA, fp32 accumulate),
// X_g = sum_k x_k over the group (fp32, from the staged bf16 x). All 8 B columns hold x, so every column of
// the MMA result is the same dot product and each lane reads its rows' values from its first column.
//
// Fragment layout (m16n8k16, lane = 4 q + c): A rows q and q + 8, k slots {2c, 2c+1, 2c+8, 2c+9}. Lane c of
// a quad owns codes [16 c, 16 c + 16) of the group: one uint2 (words 2c, 2c+1) per row. MMA i (0..3) takes
// codes (i, i+4) of the first word and (8+i, 12+i) of the second: exactly what (w >> 4i) & 0x000F000F picks.
// The activations are staged in that order (perm64), so lane c's B registers for the group are two 16-byte
// shared-memory loads.
//
// Work split: a block task is a 16-row block of one segment (dual: 16 gate + 16 up rows, sharing B); the 8
// warps of the block split the row's groups and a shared-memory reduction adds their partials in a fixed
// order (deterministic). The grid is persistent (2 blocks per SM): the staging prologue runs once per block.
#include "cuda/gemv_tc.cuh"

namespace lily::cuda::gemv {
namespace {

constexpr int kBlocksPerSm = 2;

// One weight row as a lane reads it: its uint2 of codes per group, the group scales and biases.
struct RowPtr {
  const uint2* c;
  const uint16_t* s;
  const uint16_t* b;
};

__device__ __forceinline__ RowPtr row_ptr(const DLinear& W, int64_t e, int64_t row, int c) {
  const kp::LinearParams& p = W.p;
  const int64_t gpr = p.in / kGroup;
  RowPtr r;
  r.c = reinterpret_cast<const uint2*>(W.codes + e * p.expert_words + row * (p.in / 8)) + c;  // group g: + 4 g
  r.s = W.scales + e * p.expert_groups + row * gpr;
  r.b = W.biases + e * p.expert_groups + row * gpr;
  return r;
}

// acc[rb][h] += fac * (row h of weight set rb) . x over the row's groups [l0, l1); the staged activations of
// group l sit at group goff + l of xp / gs. rp[rb][0]: row q, rp[rb][1]: row q + 8. UG groups' loads are
// issued together before any is used.
template <int RB, int UG>
__device__ __forceinline__ void tc_rows(const RowPtr (&rp)[RB][2], int l0, int l1, int goff, const bf16* xp,
                                        const float* gs, float fac, float (&acc)[RB][2], int c) {
  for (int l = l0; l < l1; l += UG) {
    uint2 cw[UG][RB][2];
    float sv[UG][RB][2], bv[UG][RB][2];
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      const int g = min(l + u, l1 - 1);  // past the end: reload the last group, skipped below
#pragma unroll
      for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cw[u][rb][h] = __ldg(rp[rb][h].c + 4 * g);
          sv[u][rb][h] = bf2f(__ldg(rp[rb][h].s + g));
          bv[u][rb][h] = bf2f(__ldg(rp[rb][h].b + g));
        }
    }
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      if (l + u >= l1) break;
      const int gx = goff + l + u;
      const uint4* xb = reinterpret_cast<const uint4*>(xp + gx * kGroup + c * 16);
      const uint4 x0 = xb[0], x1 = xb[1];
      const uint32_t B[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const float xsum = gs[gx];
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t A[4] = {nib_pair(cw[u][rb][0].x, i), nib_pair(cw[u][rb][1].x, i),
                                 nib_pair(cw[u][rb][0].y, i), nib_pair(cw[u][rb][1].y, i)};
          mma_bf16(d, A, B[2 * i], B[2 * i + 1]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s = sv[u][rb][h], b = bv[u][rb][h];
          acc[rb][h] += fac * (s * d[2 * h] + (b - 128.f * s) * xsum);
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm) proj_tc_kernel(const __grid_constant__ ProjArgs a,
                                                                          int n_tasks) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const int n = a.in, G = n / kGroup, npad = (n + 7) / 8 * 8;
  bf16* xs = reinterpret_cast<bf16*>(tc_smem);  // [n] natural order (scalar lanes, staging)
  bf16* xp = xs + npad;                           // [n] perm64 order (tensor-core lanes)
  float* gs = reinterpret_cast<float*>(xp + npad);  // [G]
  __shared__ float red[kWarps][2 * kRowBlock];
  __shared__ float nred[kWarps];
  __shared__ int32_t s_idx[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, q = lane >> 2, c = lane & 3;

  pdl_trigger();
  pdl_wait();
  stage_x(a, xs, nred, tid, warp, lane);
  if (a.route && warp == 0) route_warp(a, s_idx, s_w, lane);
  __syncthreads();
  permute_x(xs, xp, gs, n, warp, lane);
  __syncthreads();

  const int gpw = (G + kWarps - 1) / kWarps, g0 = min(G, warp * gpw), g1 = min(G, g0 + gpw);
  unsigned long long key = 0ull;
  for (int t = blockIdx.x; t < n_tasks; t += gridDim.x) {
    int si = 0;
    for (int s = 1; s < a.nseg; ++s)
      if (t >= a.seg[s].warp0) si = s;
    const Seg& sg = a.seg[si];
    const int lt = t - sg.warp0, slot = lt / sg.warps_per_slot;
    const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock, out = sg.w0.p.out;
    const bool dual = sg.mode == kODual;
    const int64_t e = sg.routed ? s_idx[slot] : 0;
    const int64_t ra = min64(row0 + q, out - 1), rb8 = min64(row0 + q + 8, out - 1);
    if (tc_ok(sg.w0.p)) {
      if (dual) {
        const RowPtr rp[2][2] = {{row_ptr(sg.w0, e, ra, c), row_ptr(sg.w0, e, rb8, c)},
                                 {row_ptr(sg.w1, e, ra, c), row_ptr(sg.w1, e, rb8, c)}};
        float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
        tc_rows<2, 2>(rp, g0, g1, 0, xp, gs, 1.f, acc, c);
        if (c == 0) {
          red[warp][q] = acc[0][0], red[warp][q + 8] = acc[0][1];
          red[warp][16 + q] = acc[1][0], red[warp][16 + q + 8] = acc[1][1];
        }
      } else {
        const RowPtr rp[1][2] = {{row_ptr(sg.w0, e, ra, c), row_ptr(sg.w0, e, rb8, c)}};
        float acc[1][2] = {{0.f, 0.f}};
        tc_rows<1, 4>(rp, g0, g1, 0, xp, gs, 1.f, acc, c);
        if (c == 0) red[warp][q] = acc[0][0], red[warp][q + 8] = acc[0][1];
      }
    } else {
      const float v0 = scalar_rows(sg.w0, e, row0, g0, g1, xs, lane);
      if ((lane & 1) == 0) red[warp][lane / 2] = v0;
      if (dual) {
        const float v1 = scalar_rows(sg.w1, e, row0, g0, g1, xs, lane);
        if ((lane & 1) == 0) red[warp][16 + lane / 2] = v1;
      }
    }
    __syncthreads();
    const int64_t row = row0 + tid;
    if (tid < kRowBlock && row < out) {
      float v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v0 += red[w][tid];
      if (dual)
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v1 += red[w][16 + tid];
      seg_epilogue(a, sg, slot, row, v0, v1, key);
    }
    __syncthreads();  // red is rewritten by the next task
  }
  if (a.amax && warp == 0) {  // block maximum of (logit, -row): the greedy head
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
    if (lane == 0) a.amax[blockIdx.x] = key;
  }
}

// x[r] += sum_j w_j (act_j . Wd[e_j][r]) + sigmoid(g) (sact . Ws[r]), as down_kernel in gemv.cu: the
// routed and shared parts are one K-concatenated row; each warp takes a contiguous range of its groups.
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) down_tc_kernel(const __grid_constant__ DownArgs a,
                                                                          int n_tasks) {
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const int k = a.k, I = static_cast<int>(a.wd.p.in), Is = static_cast<int>(a.ws.p.in);
  const int n = k * I + Is, npad = (n + 7) / 8 * 8, GI = I / kGroup, G = n / kGroup;
  bf16* xs = reinterpret_cast<bf16*>(tc_smem);
  bf16* xp = xs + npad;
  float* gs = reinterpret_cast<float*>(xp + npad);
  __shared__ float red[kWarps][kRowBlock];
  __shared__ float fac[kMaxTopK + 1];
  __shared__ int32_t eid[kMaxTopK + 1];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, q = lane >> 2, c = lane & 3;

  pdl_trigger();
  pdl_wait();  // routing and activations come from the previous kernels
  {
    const uint4* src = reinterpret_cast<const uint4*>(a.act);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = tid; i < k * I / 8; i += kThreads) dst[i] = src[i];
    const uint4* ss = reinterpret_cast<const uint4*>(a.sact);
    uint4* sd = reinterpret_cast<uint4*>(xs + k * I);
    for (int i = tid; i < Is / 8; i += kThreads) sd[i] = ss[i];
  }
  if (tid < k) fac[tid] = a.top_w[tid], eid[tid] = a.top_idx[tid];
  if (tid == 0) fac[k] = sigmoidf_(a.sgate[0]), eid[k] = 0;
  __syncthreads();
  permute_x(xs, xp, gs, n, warp, lane);
  __syncthreads();

  const int gpw = (G + kWarps - 1) / kWarps, g0 = min(G, warp * gpw), g1 = min(G, g0 + gpw);
  const int64_t H = a.wd.p.out;
  for (int t = blockIdx.x; t < n_tasks; t += gridDim.x) {
    const int64_t row0 = static_cast<int64_t>(t) * kRowBlock;
    const int64_t ra = min64(row0 + q, H - 1), rb8 = min64(row0 + q + 8, H - 1);
    float acc[1][2] = {{0.f, 0.f}};
    for (int j = 0; j <= k; ++j) {
      const int p0 = j * GI, p1 = j < k ? p0 + GI : G;  // the part's groups in the concatenated row
      const int lo = max(g0, p0), hi = min(g1, p1);
      if (lo >= hi) continue;
      const DLinear& W = j < k ? a.wd : a.ws;
      const RowPtr rp[1][2] = {{row_ptr(W, eid[j], ra, c), row_ptr(W, eid[j], rb8, c)}};
      tc_rows<1, 4>(rp, lo - p0, hi - p0, p0, xp, gs, fac[j], acc, c);
    }
    if (c == 0) red[warp][q] = acc[0][0], red[warp][q + 8] = acc[0][1];
    __syncthreads();
    if (tid < kRowBlock && row0 + tid < H) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += red[w][tid];
      a.x[row0 + tid] += v;
    }
    __syncthreads();
  }
}

size_t tc_smem_bytes(int64_t n) {
  const int64_t npad = (n + 7) / 8 * 8;
  return static_cast<size_t>(2 * npad * sizeof(bf16) + (n / kGroup) * sizeof(float) + 15) / 16 * 16;
}

}  // namespace

bool tc_format(const DLinear& w) { return tc_ok(w.p); }

int64_t head_blocks(int64_t rows) {
  const int64_t scalar = ((rows + 3) / 4 + kWarps - 1) / kWarps;
  const int64_t tc = std::min<int64_t>((rows + kRowBlock - 1) / kRowBlock, int64_t{kBlocksPerSm} * device_sm_count());
  return std::max(scalar, tc);
}

unsigned proj_tc(cudaStream_t st, const ProjArgs& in) {
  ProjArgs a = in;
  const int64_t tasks = number_row_block_tasks(a);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tasks, int64_t{kBlocksPerSm} * device_sm_count()));
  launch_pdl(proj_tc_kernel, dim3(blocks), dim3(kThreads), tc_smem_bytes(a.in), st, a, static_cast<int>(tasks));
  return blocks;
}

void moe_down_tc(cudaStream_t st, const DownArgs& a) {
  const int64_t H = a.wd.p.out, tasks = (H + kRowBlock - 1) / kRowBlock;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tasks, int64_t{kBlocksPerSm} * device_sm_count()));
  const int64_t n = a.k * a.wd.p.in + a.ws.p.in;
  launch_pdl(down_tc_kernel, dim3(blocks), dim3(kThreads), tc_smem_bytes(n), st, a, static_cast<int>(tasks));
}

}  // namespace lily::cuda::gemv
