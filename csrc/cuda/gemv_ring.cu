// Decode projections with per-warp cp.async rings: every compute warp streams its own weight chunks into a
// 4-deep ring in shared memory (16-byte cp.async, 3 chunks in flight while one is computed) and runs the
// tensor-core dot products of gemv_tc.cu on them (same fragment layout and arithmetic, see its header).
//
// Why: the H200 reaches 4.4 TB/s with plain 16-byte loads from ~1,000 threads per SM (~128 KB in flight per
// SM), while the register-loading GEMVs keep ~32-64 KB in flight and the single-producer bulk ring of
// gemv_bulk.cu streamed at most 2.33 TB/s. Here 8 warps x 3 chunks x 4.6 KB ~ 110 KB per SM are in flight
// without registers, each warp issuing its own copies, and the first chunks go out before the PDL wait.
//
// A chunk is 16 rows x 512 values (8 groups) of one weight set: codes [16][256 B + 32 B pad] (the pad spreads
// the quad rows over the banks), scales [16][16 B], biases [16][16 B]. Rows past `out` re-read the last row.
// Two schedules (chosen per launch by the task count):
//   warp-owned: each warp takes whole 16-row blocks (tasks) and all their chunks -- many row blocks (the
//               DeltaNet in-projection, q/k/v, lm_head); no cross-warp reduction.
//   block-owned: a block takes a 16-row block and its 8 warps split its chunks, then add their partial sums in a
//               fixed order -- few row blocks (out-projections, experts, shared expert, router launches).
// Segments that are not 4-bit group-64 with in % 512 == 0 (the 8-bit router) run on scalar lanes, block-owned.
#include "cuda/gemv_tc.cuh"

namespace lily::cuda::gemv {
namespace {

constexpr int kDepth = 4;                        // ring stages per warp
constexpr int kCG = 8;                           // groups per chunk
constexpr int kCodeRow = kCG * 32 + 32;          // staged bytes per row of codes (256 + pad)
constexpr int kStage = kRowBlock * kCodeRow + 2 * kRowBlock * kCG * 2;  // 5,120 B
constexpr int kRingBytes = kWarps * kDepth * kStage;                   // 160 KB per block

__host__ __device__ __forceinline__ bool ring_ok(const kp::LinearParams& p) {
  return tc_ok(p) && p.in % (kCG * kGroup) == 0;
}
__host__ __device__ __forceinline__ int sets_of(const Seg& s) { return s.mode == kODual ? 2 : 1; }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait_depth() { asm volatile("cp.async.wait_group %0;" ::"n"(kDepth - 1) : "memory"); }

// One warp copies chunk `ch` of rows [row0, row0 + 16) of W (expert e) into `stage` (uncommitted).
__device__ __forceinline__ void issue_chunk(unsigned char* stage, const DLinear& W, int64_t e, int64_t row0, int ch,
                                            int lane) {
  const kp::LinearParams& p = W.p;
  const int64_t rcb = p.in / 2, rsb = p.in / 32;
  const unsigned char* gc = reinterpret_cast<const unsigned char*>(W.codes + e * p.expert_words) + ch * (kCG * 32);
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // 16 rows x 16 pieces of 16 B
    const int idx = i * 32 + lane, r = idx >> 4, col = idx & 15;
    cp_async16(stage + r * kCodeRow + col * 16, gc + min64(row0 + r, p.out - 1) * rcb + col * 16);
  }
  const int r = lane & 15;
  const uint16_t* sb = lane < 16 ? W.scales : W.biases;
  const unsigned char* src = reinterpret_cast<const unsigned char*>(sb + e * p.expert_groups) +
                             min64(row0 + r, p.out - 1) * rsb + ch * (kCG * 2);
  cp_async16(stage + kRowBlock * kCodeRow + (lane >> 4) * (kRowBlock * 16) + r * 16, src);
}

// acc[h] += (row q + 8h of the staged chunk) . x over the chunk's 8 groups (chunk ch of the row).
__device__ __forceinline__ void compute_chunk(const unsigned char* stage, int ch, const bf16* xp, const float* gs,
                                              float (&acc)[2], int lane) {
  const int q = lane >> 2, c = lane & 3;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(stage + kRowBlock * kCodeRow);
  const uint16_t* bi = sc + kRowBlock * kCG;
#pragma unroll
  for (int l0 = 0; l0 < kCG; l0 += 4) {
    float d[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int l = l0 + u, gx = ch * kCG + l;
      d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.f;
      const uint4* xb = reinterpret_cast<const uint4*>(xp + gx * kGroup + c * 16);
      const uint4 x0 = xb[0], x1 = xb[1];
      const uint32_t B[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const uint2 w0 = *reinterpret_cast<const uint2*>(stage + q * kCodeRow + l * 32 + c * 8);
      const uint2 w1 = *reinterpret_cast<const uint2*>(stage + (q + 8) * kCodeRow + l * 32 + c * 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t A[4] = {nib_pair(w0.x, i), nib_pair(w1.x, i), nib_pair(w0.y, i), nib_pair(w1.y, i)};
        mma_bf16(d[u], A, B[2 * i], B[2 * i + 1]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int l = l0 + u;
      const float xsum = gs[ch * kCG + l];
      const float s0 = bf2f(sc[q * kCG + l]), s1 = bf2f(sc[(q + 8) * kCG + l]);
      const float b0 = bf2f(bi[q * kCG + l]), b1 = bf2f(bi[(q + 8) * kCG + l]);
      acc[0] += s0 * d[u][0] + (b0 - 128.f * s0) * xsum;
      acc[1] += s1 * d[u][2] + (b1 - 128.f * s1) * xsum;
    }
  }
}

__device__ __forceinline__ int find_seg_r(const ProjArgs& a, int t) {
  int si = 0;
  for (int s = 1; s < a.nseg; ++s)
    if (t >= a.seg[s].warp0) si = s;
  return si;
}

// The stream of chunks one warp computes, in order. Warp-owned: tasks t = first, first + step, ... with all
// their (set, chunk) items. Block-owned: the block's tasks, items i = warp, warp + 8, ... of each ring task.
struct Stream {
  int t, i;  // task, item within the task (item = set * chunks + chunk)
};

template <bool kBlockOwned>
__device__ __forceinline__ int items_of(const ProjArgs& a, int t) {
  const Seg& sg = a.seg[find_seg_r(a, t)];
  return ring_ok(sg.w0.p) ? sets_of(sg) * static_cast<int>(sg.w0.p.in / (kCG * kGroup)) : 0;
}

template <bool kBlockOwned>
__device__ __forceinline__ void stream_next(const ProjArgs& a, Stream& s, int n_tasks, int step, int warp) {
  s.i += kBlockOwned ? kWarps : 1;
  while (s.t < n_tasks && s.i >= items_of<kBlockOwned>(a, s.t)) {
    s.t += step;
    s.i = kBlockOwned ? warp : 0;
  }
}

template <bool kBlockOwned>
__device__ __forceinline__ void stream_issue(const ProjArgs& a, const Stream& s, int n_tasks, unsigned char* stage,
                                             const int32_t* s_idx, int lane) {
  if (s.t < n_tasks) {
    const Seg& sg = a.seg[find_seg_r(a, s.t)];
    const int lt = s.t - sg.warp0, slot = lt / sg.warps_per_slot;
    const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock;
    const int nch = static_cast<int>(sg.w0.p.in / (kCG * kGroup));
    issue_chunk(stage, s.i / nch ? sg.w1 : sg.w0, sg.routed ? s_idx[slot] : 0, row0, s.i % nch, lane);
  }
  cp_commit();  // empty groups keep the wait count uniform at the end of the stream
}

template <bool kBlockOwned>
__global__ void __launch_bounds__(kThreads, 1) proj_ring_kernel(const __grid_constant__ ProjArgs a, int n_tasks) {
  extern __shared__ __align__(128) unsigned char ring_smem[];
  __shared__ float red[2][2][kWarps][2 * 8 + 16];  // [task parity][set][warp][row]; 32 rows padded
  __shared__ float nred[kWarps];
  __shared__ unsigned long long s_key[kWarps];
  __shared__ int32_t s_idx[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  const int n = a.in, npad = (n + 7) / 8 * 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, q = lane >> 2, c = lane & 3;
  unsigned char* ring = ring_smem + warp * (kDepth * kStage);
  bf16* xs = reinterpret_cast<bf16*>(ring_smem + kRingBytes);
  bf16* xp = xs + npad;
  float* gs = reinterpret_cast<float*>(xp + npad);

  const int step = kBlockOwned ? gridDim.x : gridDim.x * kWarps;
  Stream is{static_cast<int>(kBlockOwned ? blockIdx.x : blockIdx.x * kWarps + warp), kBlockOwned ? warp - kWarps : -1};
  stream_next<kBlockOwned>(a, is, n_tasks, step, warp);
  Stream cs = is;
  // Weights never depend on the activations: the first chunks go out before waiting for the predecessor,
  // unless the experts are routed (the routing comes from the prologue below).
  int issued = 0;
  if (!a.route) {
    for (; issued < kDepth - 1; ++issued) {
      stream_issue<kBlockOwned>(a, is, n_tasks, ring + (issued % kDepth) * kStage, s_idx, lane);
      stream_next<kBlockOwned>(a, is, n_tasks, step, warp);
    }
  }
  pdl_trigger();
  pdl_wait();
  stage_x(a, xs, nred, tid, warp, lane);
  if (a.route && warp == 0) route_warp(a, s_idx, s_w, lane);
  __syncthreads();
  permute_x(xs, xp, gs, n, warp, lane);
  __syncthreads();
  for (; issued < kDepth - 1; ++issued) {
    stream_issue<kBlockOwned>(a, is, n_tasks, ring + (issued % kDepth) * kStage, s_idx, lane);
    stream_next<kBlockOwned>(a, is, n_tasks, step, warp);
  }

  unsigned long long key = 0ull;
  int j = 0;  // items computed by this warp
  if (!kBlockOwned) {
    while (cs.t < n_tasks) {
      const Seg& sg = a.seg[find_seg_r(a, cs.t)];
      const int lt = cs.t - sg.warp0, slot = lt / sg.warps_per_slot;
      const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock;
      const int nch = static_cast<int>(sg.w0.p.in / (kCG * kGroup)), ni = sets_of(sg) * nch;
      float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      for (int i = 0; i < ni; ++i, ++j) {
        stream_issue<kBlockOwned>(a, is, n_tasks, ring + ((j + kDepth - 1) % kDepth) * kStage, s_idx, lane);
        stream_next<kBlockOwned>(a, is, n_tasks, step, warp);
        cp_wait_depth();
        __syncwarp();
        float part[2] = {0.f, 0.f};
        compute_chunk(ring + (j % kDepth) * kStage, i % nch, xp, gs, part, lane);
        __syncwarp();
        if (i < nch) acc[0][0] += part[0], acc[0][1] += part[1];
        else acc[1][0] += part[0], acc[1][1] += part[1];
      }
      if (c == 0) {
        seg_epilogue(a, sg, slot, row0 + q, acc[0][0], acc[1][0], key);
        seg_epilogue(a, sg, slot, row0 + q + 8, acc[0][1], acc[1][1], key);
      }
      cs.t += step;
    }
  } else {
    int tb = 0;
    for (int t = blockIdx.x; t < n_tasks; t += step, ++tb) {
      const Seg& sg = a.seg[find_seg_r(a, t)];
      const int lt = t - sg.warp0, slot = lt / sg.warps_per_slot;
      const int64_t row0 = static_cast<int64_t>(lt % sg.warps_per_slot) * kRowBlock;
      const bool dual = sg.mode == kODual;
      float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
      if (ring_ok(sg.w0.p)) {
        const int nch = static_cast<int>(sg.w0.p.in / (kCG * kGroup)), ni = sets_of(sg) * nch;
        for (int i = warp; i < ni; i += kWarps, ++j) {
          stream_issue<kBlockOwned>(a, is, n_tasks, ring + ((j + kDepth - 1) % kDepth) * kStage, s_idx, lane);
          stream_next<kBlockOwned>(a, is, n_tasks, step, warp);
          cp_wait_depth();
          __syncwarp();
          float part[2] = {0.f, 0.f};
          compute_chunk(ring + (j % kDepth) * kStage, i % nch, xp, gs, part, lane);
          __syncwarp();
          if (i < nch) acc[0][0] += part[0], acc[0][1] += part[1];
          else acc[1][0] += part[0], acc[1][1] += part[1];
        }
      } else {  // scalar lanes over this warp's share of the groups; rows to the quad layout
        const int G = n / kGroup, gpw = (G + kWarps - 1) / kWarps, g0 = min(G, warp * gpw), g1 = min(G, g0 + gpw);
        const int64_t e = sg.routed ? s_idx[slot] : 0;
        const float v0 = scalar_rows(sg.w0, e, row0, g0, g1, xs, lane);
        acc[0][0] = __shfl_sync(0xffffffffu, v0, 2 * q);
        acc[0][1] = __shfl_sync(0xffffffffu, v0, 2 * q + 16);
        if (dual) {
          const float v1 = scalar_rows(sg.w1, e, row0, g0, g1, xs, lane);
          acc[1][0] = __shfl_sync(0xffffffffu, v1, 2 * q);
          acc[1][1] = __shfl_sync(0xffffffffu, v1, 2 * q + 16);
        }
      }
      float (*rd)[kWarps][32] = red[tb & 1];
      if (c == 0) {
        rd[0][warp][q] = acc[0][0], rd[0][warp][q + 8] = acc[0][1];
        rd[1][warp][q] = acc[1][0], rd[1][warp][q + 8] = acc[1][1];
      }
      __syncthreads();
      if (tid < kRowBlock) {
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v0 += rd[0][w][tid], v1 += rd[1][w][tid];
        seg_epilogue(a, sg, slot, row0 + tid, v0, v1, key);
      }
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  if (a.amax) {  // block maximum of (logit, -row): the greedy head
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
    if (lane == 0) s_key[warp] = key;
    __syncthreads();
    if (tid == 0) {
      unsigned long long m = 0ull;
      for (int w = 0; w < kWarps; ++w) m = max(m, s_key[w]);
      a.amax[blockIdx.x] = m;
    }
  }
}

// The SM count, with the kernels' shared-memory limit raised once first.
int sm_count_ring() {
  static const bool raised = [] {
    for (auto k : {proj_ring_kernel<false>, proj_ring_kernel<true>})
      check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024), "cudaFuncSetAttribute");
    return true;
  }();
  (void)raised;
  return device_sm_count();
}

}  // namespace

bool ring_launch_ok(const ProjArgs& a) {
  if (a.in % kGroup != 0 || (a.route && a.top_k > kMaxTopK)) return false;
  const size_t act = 2 * static_cast<size_t>((a.in + 7) / 8 * 8) * sizeof(bf16) + (a.in / kGroup) * sizeof(float);
  if (kRingBytes + act > 220 * 1024) return false;
  for (int s = 0; s < a.nseg; ++s)
    if (tc_ok(a.seg[s].w0.p) && !ring_ok(a.seg[s].w0.p)) return false;
  return true;
}

unsigned proj_ring(cudaStream_t st, const ProjArgs& in) {
  ProjArgs a = in;
  const int64_t tasks = number_row_block_tasks(a);
  bool all_ring = true;
  for (int s = 0; s < a.nseg; ++s) all_ring = all_ring && ring_ok(a.seg[s].w0.p);
  const int sms = sm_count_ring();
  // Warp-owned when there are row blocks for most warps; otherwise the block's warps share each row block.
  const bool warp_owned = all_ring && tasks >= static_cast<int64_t>(sms) * kWarps / 2;
  const int64_t want = warp_owned ? (tasks + kWarps - 1) / kWarps : tasks;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(want, sms));
  const size_t smem = kRingBytes + 2 * static_cast<size_t>((a.in + 7) / 8 * 8) * sizeof(bf16) +
                      (a.in / kGroup) * sizeof(float);
  if (warp_owned)
    launch_pdl(proj_ring_kernel<false>, dim3(blocks), dim3(kThreads), smem, st, a, static_cast<int>(tasks));
  else
    launch_pdl(proj_ring_kernel<true>, dim3(blocks), dim3(kThreads), smem, st, a, static_cast<int>(tasks));
  return blocks;
}

}  // namespace lily::cuda::gemv
