// Decode GEMVs with the weights streamed into shared memory by the bulk copy engine (cp.async.bulk + mbarrier):
// one producer warp keeps a ring of weight stages in flight while 8 compute warps run the tensor-core dot
// products of gemv_tc.cu on them (same fragment layout and arithmetic, see its header comment).
//
// Why: register-loading GEMVs stall on DRAM latency (each warp has one batch of loads in flight, then computes,
// then reduces). Here the copies for later stages are in flight while a stage is computed, without registers,
// and since weights never depend on the activations the producer starts before the kernel waits for its
// predecessor (programmatic dependent launch).
// Measured on the H200 (benchmarks/kernels/check_gemv.cu, 2026-11-30): the MoE down (9 experts' 16-row parts,
// split over the warps) takes 7.4 us against 15.4 us on scalar lanes, so it is the default there; for the
// projections it is no faster than scalar lanes (lm_head 1.74 vs 1.65 TB/s, mid-size matrices slower). With the
// compute switched off this ring streamed only 2.33 TB/s where plain 16-byte loads from 1,024 threads per SM
// reach 4.4 TB/s: one thread issuing one stage at a time is the limit. Next: per-warp cp.async rings.
//
// Stages: proj -- one weight set (gate or up) x 16 rows x a chunk of <= 2048 values (longer rows: several
// chunks), each compute warp owning whole 16-row blocks; down -- one expert part x 16 rows, part j on warp j % 8,
// partial sums added in a fixed order. Layout as in global memory: codes [16][kc/2 B], scales [16][kc/32 B],
// biases [16][kc/32 B]. Requires 4-bit group-64 weights with in % (512 x chunks) == 0 (16-byte copy sizes):
// every projection of the real model. Other segments of a launch (the 8-bit router) run on scalar lanes.
#include "cuda/gemv_tc.cuh"

namespace lily::cuda::gemv {
namespace {

constexpr int kMaxStages = 32;
constexpr int kChunk = 2048;                     // most values of a row per stage (longer rows: several stages)
constexpr int kBulkThreads = kThreads + 32;      // 8 compute warps + 1 producer warp
constexpr int kSmemLimit = 220 * 1024;           // dynamic shared memory per block (H100/H200 opt-in: 227 KB incl. static)
constexpr int kRingBudget = 200 * 1024;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(b)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// Producer/compute hand-off of the routing (named barrier 2: compute warps arrive, the producer waits).
__device__ __forceinline__ void route_arrive() { asm volatile("bar.arrive 2, %0;" ::"n"(kBulkThreads) : "memory"); }
__device__ __forceinline__ void route_wait() { asm volatile("bar.sync 2, %0;" ::"n"(kBulkThreads) : "memory"); }

// Row chunks of a weight: stages hold kc = in / chunks values of 16 rows; copies stay 16-byte multiples.
__host__ __device__ __forceinline__ int n_chunks(int64_t in) { return static_cast<int>((in + kChunk - 1) / kChunk); }
__host__ __device__ __forceinline__ bool bulk_ok(const kp::LinearParams& p) {
  return tc_ok(p) && p.in % (512 * n_chunks(p.in)) == 0;
}
__host__ __device__ __forceinline__ int chunk_len(int64_t in) { return static_cast<int>(in / n_chunks(in)); }
__host__ __device__ __forceinline__ int stage_bytes_for(int64_t in) { return 9 * chunk_len(in); }  // 16 x kc x 9/16

// The ring: stage buffers in dynamic shared memory plus their full/empty barriers.
struct Ring {
  unsigned char* buf;
  int stage_bytes, n;
  uint64_t* full;   // [n] producer arrival + transaction bytes
  uint64_t* empty;  // [n] the consuming warp's arrival
};

// Producer: stage `it` <- rows [row0, row0 + v) x chunk `ch` of weight W (expert e).
__device__ __forceinline__ void produce(const Ring& r, int it, const DLinear& W, int64_t e, int64_t row0, int v, int ch) {
  const int s = it % r.n, u = it / r.n;
  if (u > 0) mbar_wait(&r.empty[s], (u - 1) & 1);
  const kp::LinearParams& p = W.p;
  const int kc = chunk_len(p.in);
  const uint32_t cb = kc / 2, sb = kc / 32;  // bytes per row of the stage: codes, scales (= biases)
  const int64_t rcb = p.in / 2, rsb = p.in / 32;  // bytes per row in global memory
  mbar_expect_tx(&r.full[s], static_cast<uint32_t>(v) * (cb + 2 * sb));
  unsigned char* d = r.buf + static_cast<size_t>(s) * r.stage_bytes;
  const unsigned char* gc = reinterpret_cast<const unsigned char*>(W.codes + e * p.expert_words) + row0 * rcb + ch * cb;
  const unsigned char* gsc = reinterpret_cast<const unsigned char*>(W.scales + e * p.expert_groups) + row0 * rsb + ch * sb;
  const unsigned char* gbi = reinterpret_cast<const unsigned char*>(W.biases + e * p.expert_groups) + row0 * rsb + ch * sb;
  if (kc == p.in) {  // whole rows: three contiguous copies
    bulk_copy(d, gc, v * cb, &r.full[s]);
    bulk_copy(d + kRowBlock * cb, gsc, v * sb, &r.full[s]);
    bulk_copy(d + kRowBlock * (cb + sb), gbi, v * sb, &r.full[s]);
  } else {
    for (int i = 0; i < v; ++i) {
      bulk_copy(d + i * cb, gc + i * rcb, cb, &r.full[s]);
      bulk_copy(d + kRowBlock * cb + i * sb, gsc + i * rsb, sb, &r.full[s]);
      bulk_copy(d + kRowBlock * (cb + sb) + i * sb, gbi + i * rsb, sb, &r.full[s]);
    }
  }
}

// Compute warp: acc[h] += fac * (row q + 8h of stage `it`) . x over the stage's groups [l0, l1) (a chunk of kc
// values); group l's staged activations sit at group goff + l of xp / gs. Releases the stage afterwards.
// Four groups per step: their MMA chains are independent, so they overlap.
__device__ __forceinline__ void consume(const Ring& r, int it, int kc, int l0, int l1, int goff, const bf16* xp,
                                        const float* gs, float fac, float (&acc)[2], int lane) {
  const int s = it % r.n, q = lane >> 2, c = lane & 3;
  const unsigned char* st = r.buf + static_cast<size_t>(s) * r.stage_bytes;
  const int cb = kc / 2, sb = kc / 32;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(st + kRowBlock * cb);
  const uint16_t* bi = reinterpret_cast<const uint16_t*>(st + kRowBlock * (cb + sb));
  mbar_wait(&r.full[s], (it / r.n) & 1);
  for (int l = l0; l < l1; l += 4) {
    float d[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.f;
      const int g = min(l + u, l1 - 1);
      const uint4* xb = reinterpret_cast<const uint4*>(xp + (goff + g) * kGroup + c * 16);
      const uint4 x0 = xb[0], x1 = xb[1];
      const uint32_t B[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const uint2 w0 = *reinterpret_cast<const uint2*>(st + q * cb + g * 32 + c * 8);
      const uint2 w1 = *reinterpret_cast<const uint2*>(st + (q + 8) * cb + g * 32 + c * 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t A[4] = {nib_pair(w0.x, i), nib_pair(w1.x, i), nib_pair(w0.y, i), nib_pair(w1.y, i)};
        mma_bf16(d[u], A, B[2 * i], B[2 * i + 1]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (l + u >= l1) break;
      const int g = l + u;
      const float xsum = gs[goff + g];
      const float s0 = bf2f(sc[q * (sb / 2) + g]), s1 = bf2f(sc[(q + 8) * (sb / 2) + g]);
      const float b0 = bf2f(bi[q * (sb / 2) + g]), b1 = bf2f(bi[(q + 8) * (sb / 2) + g]);
      acc[0] += fac * (s0 * d[u][0] + (b0 - 128.f * s0) * xsum);
      acc[1] += fac * (s1 * d[u][2] + (b1 - 128.f * s1) * xsum);
    }
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(&r.empty[s]);
}

// Barriers initialised by thread 0, visible to the async proxy and to every thread before use.
__device__ __forceinline__ void init_ring(const Ring& r) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < r.n; ++s) mbar_init(&r.full[s], 1), mbar_init(&r.empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

__device__ __forceinline__ int find_seg(const ProjArgs& a, int t) {
  int si = 0;
  for (int s = 1; s < a.nseg; ++s)
    if (t >= a.seg[s].warp0) si = s;
  return si;
}

// Stages of one task of proj: (gate, up) sets x row chunks; 0 for segments on the scalar lanes.
__device__ __forceinline__ int task_stages(const Seg& sg) {
  return bulk_ok(sg.w0.p) ? (sg.mode == kODual ? 2 : 1) * n_chunks(sg.w0.p.in) : 0;
}

// Projections: each compute warp owns whole 16-row blocks (the block's tasks i with i % 8 == warp), so no
// cross-warp reduction or barrier is needed; a task's stages are its weight sets x row chunks, in order.
__global__ void __launch_bounds__(kBulkThreads, 1) proj_bulk_kernel(const __grid_constant__ ProjArgs a, int n_tasks,
                                                                     int stage_bytes, int n_stages) {
  extern __shared__ __align__(128) unsigned char bulk_smem[];
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float nred[kWarps];
  __shared__ unsigned long long s_key[kWarps];
  __shared__ int32_t s_idx[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  const int n = a.in, npad = (n + 7) / 8 * 8;
  const Ring ring{bulk_smem, stage_bytes, n_stages, full, empty};
  bf16* xs = reinterpret_cast<bf16*>(bulk_smem + static_cast<size_t>(stage_bytes) * n_stages);
  bf16* xp = xs + npad;
  float* gs = reinterpret_cast<float*>(xp + npad);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, q = lane >> 2, c = lane & 3;
  init_ring(ring);

  if (warp == kWarps) {  // producer
    if (a.route) route_wait();  // routed segments need the experts chosen by the compute warps
    if (lane != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < n_tasks; t += gridDim.x) {
      const Seg& sg = a.seg[find_seg(a, t)];
      if (!task_stages(sg)) continue;
      const int lt = t - sg.warp0, slot = lt / sg.warps_per_slot;
      const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock;
      const int v = static_cast<int>(min64(kRowBlock, sg.w0.p.out - row0));
      const int64_t e = sg.routed ? s_idx[slot] : 0;
      for (int k = 0; k < (sg.mode == kODual ? 2 : 1); ++k)
        for (int ch = 0; ch < n_chunks(sg.w0.p.in); ++ch) produce(ring, it++, k ? sg.w1 : sg.w0, e, row0, v, ch);
    }
    return;
  }

  pdl_trigger();
  pdl_wait();
  stage_x<true>(a, xs, nred, tid, warp, lane);
  if (a.route && warp == 0) route_warp(a, s_idx, s_w, lane);
  compute_sync<true>();
  if (a.route) route_arrive();
  permute_x(xs, xp, gs, n, warp, lane);
  compute_sync<true>();

  unsigned long long key = 0ull;
  int it = 0, i = 0;
  for (int t = blockIdx.x; t < n_tasks; t += gridDim.x, ++i) {
    const Seg& sg = a.seg[find_seg(a, t)];
    const int ns = task_stages(sg);
    if (i % kWarps != warp) {
      it += ns;
      continue;
    }
    const int lt = t - sg.warp0, slot = lt / sg.warps_per_slot;
    const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock, out = sg.w0.p.out;
    const bool dual = sg.mode == kODual;
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [set][row q, q + 8]
    if (ns) {
      const int kc = chunk_len(n), nch = n_chunks(n), gpc = kc / kGroup;
      for (int k = 0; k < (dual ? 2 : 1); ++k)
        for (int ch = 0; ch < nch; ++ch) consume(ring, it++, kc, 0, gpc, ch * gpc, xp, gs, 1.f, acc[k], lane);
    } else {  // scalar lanes: lane 2r + h holds row r's sum; move rows q, q + 8 to the tensor-core lanes
      const int64_t e = sg.routed ? s_idx[slot] : 0;
      const int G = n / kGroup;
      for (int k = 0; k < (dual ? 2 : 1); ++k) {
        const float v = scalar_rows(k ? sg.w1 : sg.w0, e, row0, 0, G, xs, lane);
        acc[k][0] = __shfl_sync(0xffffffffu, v, 2 * q);
        acc[k][1] = __shfl_sync(0xffffffffu, v, 2 * (q + 8) & 31);
      }
    }
    if (c != 0) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + q + 8 * h;
      if (row >= out) continue;
      const float v0 = acc[0][h], v1 = acc[1][h];
      seg_epilogue(a, sg, slot, row, v0, v1, key);
    }
  }
  if (a.amax) {  // block maximum of (logit, -row): the greedy head
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
    if (lane == 0) s_key[warp] = key;
    compute_sync<true>();
    if (tid == 0) {
      unsigned long long m = 0ull;
      for (int w = 0; w < kWarps; ++w) m = max(m, s_key[w]);
      a.amax[blockIdx.x] = m;
    }
  }
}

// MoE down + combine (down_kernel's result): a task is a 16-row block of the residual; its stages are the
// k routed experts' parts and the shared expert's part of the K-concatenated row, part j consumed by warp
// j % 8; the warps' partial sums are added in a fixed order (deterministic).
__global__ void __launch_bounds__(kBulkThreads, 1) down_bulk_kernel(const __grid_constant__ DownArgs a, int n_tasks,
                                                                     int stage_bytes, int n_stages) {
  extern __shared__ __align__(128) unsigned char bulk_smem[];
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float red[2][kWarps][kRowBlock];
  __shared__ float fac[kMaxTopK + 1];
  const int k = a.k, I = static_cast<int>(a.wd.p.in), Is = static_cast<int>(a.ws.p.in);
  const int n = k * I + Is, npad = (n + 7) / 8 * 8, GI = I / kGroup;
  const Ring ring{bulk_smem, stage_bytes, n_stages, full, empty};
  bf16* xs = reinterpret_cast<bf16*>(bulk_smem + static_cast<size_t>(stage_bytes) * n_stages);
  bf16* xp = xs + npad;
  float* gs = reinterpret_cast<float*>(xp + npad);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, q = lane >> 2, c = lane & 3;
  const int64_t H = a.wd.p.out;
  init_ring(ring);

  if (warp == kWarps) {  // producer: the expert ids come from the previous kernel
    if (lane != 0) return;
    pdl_wait();
    int it = 0;
    for (int t = blockIdx.x; t < n_tasks; t += gridDim.x) {
      const int64_t row0 = static_cast<int64_t>(t) * kRowBlock;
      const int v = static_cast<int>(min64(kRowBlock, H - row0));
      for (int j = 0; j <= k; ++j) produce(ring, it++, j < k ? a.wd : a.ws, j < k ? a.top_idx[j] : 0, row0, v, 0);
    }
    return;
  }

  pdl_trigger();
  pdl_wait();
  {
    const uint4* src = reinterpret_cast<const uint4*>(a.act);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = tid; i < k * I / 8; i += kThreads) dst[i] = src[i];
    const uint4* ss = reinterpret_cast<const uint4*>(a.sact);
    uint4* sd = reinterpret_cast<uint4*>(xs + k * I);
    for (int i = tid; i < Is / 8; i += kThreads) sd[i] = ss[i];
  }
  if (tid < k) fac[tid] = a.top_w[tid];
  if (tid == 0) fac[k] = sigmoidf_(a.sgate[0]);
  compute_sync<true>();
  permute_x(xs, xp, gs, n, warp, lane);
  compute_sync<true>();

  int tb = 0;
  for (int t = blockIdx.x; t < n_tasks; t += gridDim.x, ++tb) {
    const int64_t row0 = static_cast<int64_t>(t) * kRowBlock;
    float acc[2] = {0.f, 0.f};
    for (int j = warp; j <= k; j += kWarps) {
      const int kc = j < k ? I : Is;
      consume(ring, tb * (k + 1) + j, kc, 0, kc / kGroup, j * GI, xp, gs, fac[j], acc, lane);
    }
    float (*rd)[kRowBlock] = red[tb & 1];
    if (c == 0) rd[warp][q] = acc[0], rd[warp][q + 8] = acc[1];
    compute_sync<true>();
    if (tid < kRowBlock && row0 + tid < H) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += rd[w][tid];
      a.x[row0 + tid] += v;
    }
  }
}

// The SM count, with the kernels' shared-memory limit raised once first.
int sm_count_bulk() {
  static const bool raised = [] {
    check(cudaFuncSetAttribute(proj_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit),
          "cudaFuncSetAttribute");
    check(cudaFuncSetAttribute(down_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit),
          "cudaFuncSetAttribute");
    return true;
  }();
  (void)raised;
  return device_sm_count();
}

size_t act_bytes(int64_t n) {
  const int64_t npad = (n + 7) / 8 * 8;
  return static_cast<size_t>(2 * npad * sizeof(bf16) + (n / kGroup) * sizeof(float));
}

}  // namespace

bool bulk_launch_ok(const ProjArgs& a) {
  bool any = false;
  for (int s = 0; s < a.nseg; ++s) {
    const kp::LinearParams& p = a.seg[s].w0.p;
    if (tc_ok(p) && !bulk_ok(p)) return false;  // 4-bit but not copyable in 16-byte rows: the register path
    any = any || bulk_ok(p);
  }
  return any && a.in % kGroup == 0 && (!a.route || a.top_k <= kMaxTopK);
}

unsigned proj_bulk(cudaStream_t st, const ProjArgs& in) {
  ProjArgs a = in;
  const int64_t tasks = number_row_block_tasks(a);
  const int stage = stage_bytes_for(a.in);
  const int ns = std::min<int>(kMaxStages, (kRingBudget - static_cast<int>(act_bytes(a.in))) / stage);
  if (ns < 2) throw std::invalid_argument("[lily] cuda decode proj: input too long for the bulk GEMV");
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tasks, sm_count_bulk()));
  const size_t smem = static_cast<size_t>(stage) * ns + act_bytes(a.in);
  launch_pdl(proj_bulk_kernel, dim3(blocks), dim3(kBulkThreads), smem, st, a, static_cast<int>(tasks), stage, ns);
  return blocks;
}

bool bulk_down_ok(const DownArgs& a) {
  return bulk_ok(a.wd.p) && bulk_ok(a.ws.p) && n_chunks(a.wd.p.in) == 1 && n_chunks(a.ws.p.in) == 1 &&
         a.k <= kMaxTopK;
}

void moe_down_bulk(cudaStream_t st, const DownArgs& a) {
  const int64_t H = a.wd.p.out, tasks = (H + kRowBlock - 1) / kRowBlock, n = a.k * a.wd.p.in + a.ws.p.in;
  const int stage = std::max(stage_bytes_for(a.wd.p.in), stage_bytes_for(a.ws.p.in));
  const int ns = std::min<int>(kMaxStages, (kRingBudget - static_cast<int>(act_bytes(n))) / stage);
  if (ns < 2) throw std::invalid_argument("[lily] cuda decode down: expert rows too long for the bulk GEMV");
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tasks, sm_count_bulk()));
  const size_t smem = static_cast<size_t>(stage) * ns + act_bytes(n);
  launch_pdl(down_bulk_kernel, dim3(blocks), dim3(kBulkThreads), smem, st, a, static_cast<int>(tasks), stage, ns);
}

}  // namespace lily::cuda::gemv
