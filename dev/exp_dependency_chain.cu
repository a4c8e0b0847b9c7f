// Experiment (issue 36 step 2): which form can stream a decode layer's weights ahead of its dependency chain.
// A layer-shaped stage list stands in for the decode step: per layer six dependent stages reading
//   14.4 MB (in-projection), 4 (DeltaNet state), 4.8 (out-projection), 1.8 (router + shared expert),
//   9.5 routed (8 experts' gate/up), 5.4 routed (8 experts' down),
// 40 layers, 240 stages. The routed stages' addresses are known only from stage 3's output (the routing): expert k
// of layer L is ((bits of y[k * 37 + 1]) & 31) * 8 + k, from a pool of 256 distinct experts per layer (19 GB, so no
// weight is in L2 twice). Every stage: each of the nb blocks (one per SM) reduces its contiguous share of the stage's
// weights to one parity bit, reads the whole previous output x (4,096 floats) and writes its pair-aligned slice of
//   y[j] = (0.5 x[(7j + 1) % V] + 0.25 x[(13j + 5) % V]) + 1e-3 parity(block owning j).
// Forms (the same arithmetic: every form's final vector must equal the CPU replica's bit for bit):
//   pdl      one kernel per stage under PDL in a graph, the block's share loaded into registers before
//            griddepcontrol.wait (routed stages after it: they need the routing)
//   tma_pdl  one kernel per stage, the share bulk-copied (cp.async.bulk) into shared memory before the wait; two blocks
//            fit per SM, so the next stage's blocks are resident and copying while this one runs
//   pf_l2    pdl, plus cp.async.bulk.prefetch.L2 of the block's shares of the next two stages before the wait
//   ring     one persistent cooperative kernel; two producer warps per block keep shared-memory page rings full by
//            bulk copies, as far ahead as the ring allows, never waiting on arrivals (the dense producer streams the
//            dense stages of this and later layers, the routed producer waits only for its layer's routing); the 16
//            consumer warps wait for the previous stage's counter (release add / acquire spin) before reading x,
//            then consume the pages already on chip
//   ll       ring with a flagged-data hop instead of the counter: y is stored as 16-byte lines {v0, epoch, v1, epoch}
//            (each 8-byte half one store's value and flag, as NCCL's LL protocol), no fence, no counter; a consumer
//            polls x's lines until both epochs are the stage's
// A 16 KB page ring differs from "3 slots two stages ahead": a block's share of the in-projection is 109 KB, so
// three stage-sized slots do not fit in 227 KB; pages hold as much of the next stages as fits.
// Each form runs at scale 1 (the bytes above) and 0 (no weights: the pure hop). Decision rule (issue 36): ring at
// <= 14 us per layer -> the persistent per-layer kernel (a); else per-operation kernels of half an SM (b).
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/exp_dep dev/exp_dependency_chain.cu
//   /tmp/exp_dep [layers]          (H200: ~30 s, 20 GB of device memory)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/common.cuh"

using lily::cuda::launch_pdl;
using lily::cuda::pdl_trigger;
using lily::cuda::pdl_wait;

constexpr int kV = 4096, kPairs = kV / 2;
constexpr int kPerLayer = 6, kRouteStage = 3, kExperts = 256, kTopK = 8;
constexpr double kStageMB[kPerLayer] = {14.4, 4.0, 4.8, 1.8, 9.5, 5.4};
constexpr int kThreads = 512;                        // the per-stage kernels; the ring's consumers
constexpr int kMaxW = 16;                            // uint4 per thread in registers: 128 KB per block
constexpr int kPageVec = 1024;                       // uint4 per ring page (16 KB)
constexpr int kDensePages = 7, kRoutedPages = 6;     // 208 KB of rings
constexpr int kRingThreads = kThreads + 64;          // + the dense and the routed producer warp
constexpr uint32_t kSeedDense = 12345u, kSeedExperts = 777u;

__host__ __device__ constexpr bool routed(int s) { return s >= 4; }
template <class T>
__host__ __device__ inline T mn(T a, T b) { return a < b ? a : b; }

struct Plan {
  const uint4* dense;     // [layers][dense_vec]: stage s of layer L at L * dense_vec + dense_off[s]
  const uint4* experts;   // [layers][kExperts][expert_vec]: gate/up [0, gu_vec), down [gu_vec, expert_vec)
  size_t dense_vec, expert_vec, gu_vec;
  size_t stage_vec[kPerLayer];  // uint4 per stage (routed: the 8 experts' chunks, concatenated)
  size_t dense_off[kPerLayer];
  int layers, nb;
  float* y;               // [stages + 1][kV]: level 0 the input, level i + 1 stage i's output (counter forms)
  uint4* yl;              // [stages + 1][kPairs] lines {v0, epoch, v1, epoch} (ll)
  unsigned* arrived;      // [stages] blocks done with stage i (ring)
  unsigned epoch0;        // level i of this run carries epoch epoch0 + i (ll)
};

// ---- shared by every form ----------------------------------------------------------------------------------------
__host__ __device__ inline void share_of(const Plan& p, int s, int b, size_t& lo, size_t& hi) {
  const size_t n = p.stage_vec[s], per = (n + p.nb - 1) / p.nb;
  lo = mn(n, b * per);
  hi = mn(n, lo + per);
}
__host__ __device__ inline int pair_lo(const Plan& p, int b) { return static_cast<int>(int64_t(kPairs) * b / p.nb); }
__host__ __device__ inline int route_expert(float v, int k) {
  uint32_t h;
  memcpy(&h, &v, 4);
  h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
  return static_cast<int>((h & 31u) * 8u + k);
}
// Where logical element `off` of stage s (layer L) lives, and how many elements follow it contiguously.
__host__ __device__ inline const uint4* locate(const Plan& p, int L, int s, const int* ex, size_t off, size_t& run) {
  if (!routed(s)) {
    run = p.stage_vec[s] - off;
    return p.dense + L * p.dense_vec + p.dense_off[s] + off;
  }
  const size_t cv = s == 4 ? p.gu_vec : p.expert_vec - p.gu_vec, k = off / cv, in = off % cv;
  run = cv - in;
  return p.experts + (size_t(L) * kExperts + ex[k]) * p.expert_vec + (s == 4 ? 0 : p.gu_vec) + in;
}
__device__ __forceinline__ float out_value(const float* x, int j, uint32_t parity) {
  return __fadd_rn(__fadd_rn(__fmul_rn(0.5f, x[(7 * j + 1) % kV]), __fmul_rn(0.25f, x[(13 * j + 5) % kV])),
                   parity ? 1e-3f : 0.f);
}
__device__ __forceinline__ uint32_t xor4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// A wait that cannot complete is a launch failure (trap after 2 s), never a hang.
__device__ __forceinline__ void spin_until_count(const unsigned* c, unsigned want) {
  const uint64_t t0 = now_ns();
  unsigned v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    if (v >= want) return;
    if (now_ns() - t0 > 2000000000ull) __trap();
  }
}
__device__ __forceinline__ uint4 ld_line(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 wait_line(const uint4* p, unsigned epoch) {
  const uint64_t t0 = now_ns();
  for (;;) {
    const uint4 v = ld_line(p);
    if (v.y == epoch && v.w == epoch) return v;
    if (now_ns() - t0 > 2000000000ull) __trap();
  }
}
// Block-wide parity of the per-thread XORs (red: nwarps words), then the block's slice of the next level.
__device__ __forceinline__ uint32_t block_parity(uint32_t acc, uint32_t* red, int nthreads, bool named) {
  acc = __reduce_xor_sync(0xFFFFFFFFu, acc);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  if (named) asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
  else __syncthreads();
  uint32_t blk = 0;
  for (int k = 0; k < nthreads / 32; ++k) blk ^= red[k];
  return __popc(blk) & 1;
}

// ---- mbarriers and bulk copies ---------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count));
}
__device__ __forceinline__ bool mbar_try(uint64_t* b, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(ok) : "r"(saddr(b)), "r"(parity) : "memory");
  return ok;
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  if (mbar_try(b, parity)) return;
  const uint64_t t0 = now_ns();
  while (!mbar_try(b, parity))
    if (now_ns() - t0 > 2000000000ull) __trap();
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// Logical elements [lo, hi) of stage s into dst (one copy per contiguous piece of at most a page), counted on bar.
// One thread.
__device__ void copy_range(const Plan& p, int L, int s, const int* ex, size_t lo, size_t hi, uint4* dst, uint64_t* bar) {
  for (size_t o = lo; o < hi;) {
    size_t run;
    const uint4* src = locate(p, L, s, ex, o, run);
    const size_t n = mn(mn(run, hi - o), size_t(kPageVec));
    bulk_copy(dst + (o - lo), src, static_cast<uint32_t>(n * 16), bar);
    o += n;
  }
}
// The routing of layer L from level L * 6 + kRouteStage + 1 (a warp's lanes < kTopK each read one value).
__device__ __forceinline__ int read_route(const Plan& p, int L, int k, bool ll) {
  const int level = L * kPerLayer + kRouteStage + 1, j = k * 37 + 1;
  float v;
  if (ll) {
    const uint4 line = wait_line(p.yl + size_t(level) * kPairs + j / 2, p.epoch0 + level);
    v = __uint_as_float(j % 2 ? line.z : line.x);
  } else {
    v = __ldcg(p.y + size_t(level) * kV + j);
  }
  return route_expert(v, k);
}

// ---- pdl and pf_l2: one kernel per stage, the share in registers -----------------------------------------------
// Thread t's elements t + k * kThreads of the block's share [lo, hi) of stage s.
__device__ __forceinline__ void load_share(const Plan& p, int L, int s, const int* ex, size_t lo, size_t hi,
                                           uint4 (&wr)[kMaxW]) {
#pragma unroll
  for (int k = 0; k < kMaxW; ++k) {
    const size_t at = lo + threadIdx.x + size_t(k) * kThreads;
    size_t run;
    wr[k] = at < hi ? ld_stream(locate(p, L, s, ex, at, run)) : make_uint4(0, 0, 0, 0);
  }
}
template <bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 1) reg_stage_kernel(Plan p, int i) {
  __shared__ float xs[kV];
  __shared__ uint32_t red[kThreads / 32];
  __shared__ int ex[kTopK];
  const int L = i / kPerLayer, s = i % kPerLayer;
  size_t lo, hi;
  share_of(p, s, blockIdx.x, lo, hi);
  uint4 wr[kMaxW];
  // The block's shares of stage t (its layer's routing in ex when routed), into L2 by warp 0's lanes.
  auto prefetch = [&](int t) {
    if (t >= p.layers * kPerLayer || threadIdx.x >= 32) return;
    size_t a, b;
    share_of(p, t % kPerLayer, blockIdx.x, a, b);
    for (size_t o = a + size_t(threadIdx.x) * kPageVec; o < b; o += 32 * kPageVec) {
      for (size_t q = o, end = mn(b, o + kPageVec); q < end;) {
        size_t run;
        const uint4* src = locate(p, t / kPerLayer, t % kPerLayer, ex, q, run);
        const size_t n = mn(run, end - q);
        prefetch_l2(src, static_cast<uint32_t>(n * 16));
        q += n;
      }
    }
  };
  if (!routed(s)) {
    if (kPrefetch)
      for (int t = i + 1; t <= i + 2 && !routed(t % kPerLayer); ++t) prefetch(t);
    load_share(p, L, s, ex, lo, hi, wr);
  }
  pdl_trigger();
  pdl_wait();
  if (routed(s)) {
    if (threadIdx.x < kTopK) ex[threadIdx.x] = read_route(p, L, threadIdx.x, false);
    __syncthreads();
    if (kPrefetch && s == 4) prefetch(i + 1);  // the down's share: its experts are known now
    load_share(p, L, s, ex, lo, hi, wr);
  }
  for (int j = threadIdx.x; j < kV; j += kThreads) xs[j] = __ldcg(p.y + size_t(i) * kV + j);
  uint32_t acc = 0;
#pragma unroll
  for (int k = 0; k < kMaxW; ++k) acc ^= xor4(wr[k]);
  const uint32_t par = block_parity(acc, red, kThreads, false);  // its __syncthreads also orders xs
  float* y = p.y + size_t(i + 1) * kV;
  for (int j = 2 * pair_lo(p, blockIdx.x) + threadIdx.x; j < 2 * pair_lo(p, blockIdx.x + 1); j += kThreads)
    y[j] = out_value(xs, j, par);
}

// ---- tma_pdl: one kernel per stage, the share bulk-copied into shared memory --------------------------------------
__global__ void __launch_bounds__(kThreads, 2) tma_stage_kernel(Plan p, int i) {
  extern __shared__ __align__(128) uint4 ws[];
  __shared__ uint32_t red[kThreads / 32];
  __shared__ int ex[kTopK];
  __shared__ __align__(8) uint64_t bar;
  const int L = i / kPerLayer, s = i % kPerLayer;
  size_t lo, hi;
  share_of(p, s, blockIdx.x, lo, hi);
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&] {
    if (threadIdx.x == 0) {
      mbar_expect(&bar, static_cast<uint32_t>((hi - lo) * 16));
      copy_range(p, L, s, ex, lo, hi, ws, &bar);
    }
  };
  if (!routed(s)) issue();
  pdl_trigger();
  pdl_wait();
  if (routed(s)) {
    if (threadIdx.x < kTopK) ex[threadIdx.x] = read_route(p, L, threadIdx.x, false);
    __syncthreads();
    issue();
  }
  mbar_wait(&bar, 0);
  uint32_t acc = 0;
  for (size_t k = threadIdx.x; k < hi - lo; k += kThreads) acc ^= xor4(ws[k]);
  const uint32_t par = block_parity(acc, red, kThreads, false);
  const float* x = p.y + size_t(i) * kV;
  float* y = p.y + size_t(i + 1) * kV;
  for (int j = 2 * pair_lo(p, blockIdx.x) + threadIdx.x; j < 2 * pair_lo(p, blockIdx.x + 1); j += kThreads)
    y[j] = __fadd_rn(__fadd_rn(__fmul_rn(0.5f, __ldcg(x + (7 * j + 1) % kV)), __fmul_rn(0.25f, __ldcg(x + (13 * j + 5) % kV))),
                     par ? 1e-3f : 0.f);
}

// ---- ring and ll: one persistent kernel, producer warps streaming pages ahead ------------------------------------
struct RingSmem {
  uint4 dense[kDensePages][kPageVec];
  uint4 routed[kRoutedPages][kPageVec];
  float xs[kV];
  uint64_t dense_full[kDensePages], dense_empty[kDensePages];
  uint64_t routed_full[kRoutedPages], routed_empty[kRoutedPages];
  uint32_t red[kThreads / 32];
};

// Producer: pages of the stages in `want` (dense or routed), in stage order, each into the next free slot.
template <bool kLL>
__device__ void produce(const Plan& p, bool dense, uint4 (*pages)[kPageVec], uint64_t* full, uint64_t* empty, int npages) {
  const int lane = threadIdx.x % 32;
  int ex[kTopK];
  uint32_t g = 0;
  for (int L = 0; L < p.layers; ++L) {
    if (!dense) {  // the routing of this layer: the only wait a producer has
      if (!kLL && lane == 0) spin_until_count(p.arrived + L * kPerLayer + kRouteStage, p.nb);
      __syncwarp();
      const int v = lane < kTopK ? read_route(p, L, lane, kLL) : 0;
      for (int k = 0; k < kTopK; ++k) ex[k] = __shfl_sync(0xFFFFFFFFu, v, k);
    }
    for (int s = 0; s < kPerLayer; ++s) {
      if (routed(s) == dense) continue;
      size_t lo, hi;
      share_of(p, s, blockIdx.x, lo, hi);
      for (size_t o = lo; o < hi; o += kPageVec, ++g) {
        const int slot = g % npages;
        mbar_wait(&empty[slot], ((g / npages) & 1) ^ 1);
        if (lane == 0) {
          const size_t e = mn(hi, o + size_t(kPageVec));
          mbar_expect(&full[slot], static_cast<uint32_t>((e - o) * 16));
          copy_range(p, L, s, ex, o, e, pages[slot], &full[slot]);
        }
        __syncwarp();
      }
    }
  }
}

template <bool kLL>
__global__ void __launch_bounds__(kRingThreads, 1) ring_kernel(Plan p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  RingSmem& sm = *reinterpret_cast<RingSmem*>(smem_raw);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int k = 0; k < kDensePages; ++k) mbar_init(&sm.dense_full[k], 1), mbar_init(&sm.dense_empty[k], kThreads / 32);
    for (int k = 0; k < kRoutedPages; ++k) mbar_init(&sm.routed_full[k], 1), mbar_init(&sm.routed_empty[k], kThreads / 32);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kThreads / 32) return produce<kLL>(p, true, sm.dense, sm.dense_full, sm.dense_empty, kDensePages);
  if (warp == kThreads / 32 + 1) return produce<kLL>(p, false, sm.routed, sm.routed_full, sm.routed_empty, kRoutedPages);
  uint32_t gd = 0, gr = 0;  // pages consumed from each ring
  const int stages = p.layers * kPerLayer;
  const int jlo = pair_lo(p, blockIdx.x), jhi = pair_lo(p, blockIdx.x + 1);  // this block's pairs
  for (int i = 0; i < stages; ++i) {
    const int s = i % kPerLayer;
    // The dependency gates the read of x alone: the pages of this stage are already streaming or on chip.
    if (kLL) {
      for (int q = threadIdx.x; q < kPairs; q += kThreads) {
        const uint4 line = wait_line(p.yl + size_t(i) * kPairs + q, p.epoch0 + i);
        sm.xs[2 * q] = __uint_as_float(line.x), sm.xs[2 * q + 1] = __uint_as_float(line.z);
      }
    } else {
      if (i > 0 && threadIdx.x == 0) spin_until_count(p.arrived + i - 1, p.nb);
      asm volatile("bar.sync 1, %0;" ::"r"(kThreads) : "memory");
      for (int j = threadIdx.x; j < kV; j += kThreads) sm.xs[j] = __ldcg(p.y + size_t(i) * kV + j);
    }
    size_t lo, hi;
    share_of(p, s, blockIdx.x, lo, hi);
    uint32_t acc = 0;
    for (size_t o = lo; o < hi; o += kPageVec) {
      const bool r = routed(s);
      uint32_t& g = r ? gr : gd;
      const int np = r ? kRoutedPages : kDensePages, slot = g % np;
      uint4* page = r ? sm.routed[slot] : sm.dense[slot];
      mbar_wait(r ? &sm.routed_full[slot] : &sm.dense_full[slot], (g / np) & 1);
      const int n = static_cast<int>(mn(size_t(kPageVec), hi - o));
      for (int k = threadIdx.x; k < n; k += kThreads) acc ^= xor4(page[k]);
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbar_arrive(r ? &sm.routed_empty[slot] : &sm.dense_empty[slot]);
      ++g;
    }
    const uint32_t par = block_parity(acc, sm.red, kThreads, true);  // its bar.sync also orders xs
    if (kLL) {
      const unsigned e = p.epoch0 + i + 1;
      for (int q = jlo + threadIdx.x; q < jhi; q += kThreads) {
        const float v0 = out_value(sm.xs, 2 * q, par), v1 = out_value(sm.xs, 2 * q + 1, par);
        asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p.yl + size_t(i + 1) * kPairs + q),
                     "r"(__float_as_uint(v0)), "r"(e), "r"(__float_as_uint(v1)), "r"(e) : "memory");
      }
      asm volatile("bar.sync 1, %0;" ::"r"(kThreads) : "memory");  // xs and red are rewritten by the next stage
    } else {
      float* y = p.y + size_t(i + 1) * kV;
      for (int j = 2 * jlo + threadIdx.x; j < 2 * jhi; j += kThreads) y[j] = out_value(sm.xs, j, par);
      asm volatile("bar.sync 1, %0;" ::"r"(kThreads) : "memory");
      if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.arrived + i) : "memory");
      }
    }
  }
}

// ---- host --------------------------------------------------------------------------------------------------------
__host__ __device__ inline uint4 weight_at(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
  h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12;
  return make_uint4(h, h * 3u + 1u, h ^ 0xA5A5A5A5u, h + seed);
}
__global__ void fill_kernel(uint4* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = weight_at(i, seed);
}

// The whole chain on the CPU, with the weights' parities (the same hash as fill_kernel).
static std::vector<float> cpu_replica(const Plan& p, const uint4* dense0, const uint4* experts0,
                                      const std::vector<float>& x0) {
  std::vector<float> x = x0, y(kV);
  int ex[kTopK] = {};
  for (int i = 0; i < p.layers * kPerLayer; ++i) {
    const int L = i / kPerLayer, s = i % kPerLayer;
    if (s == 4)
      for (int k = 0; k < kTopK; ++k) ex[k] = route_expert(x[k * 37 + 1], k);  // x is level L * 6 + 4 here
    for (int b = 0; b < p.nb; ++b) {
      size_t lo, hi;
      share_of(p, s, b, lo, hi);
      uint32_t acc = 0;
      for (size_t o = lo; o < hi; ++o) {
        size_t run;
        const uint4* at = locate(p, L, s, ex, o, run);
        const bool dn = !routed(s);
        const uint4 w = weight_at(static_cast<size_t>(at - (dn ? dense0 : experts0)), dn ? kSeedDense : kSeedExperts);
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
      const uint32_t par = __builtin_popcount(acc) & 1;
      for (int j = 2 * pair_lo(p, b); j < 2 * pair_lo(p, b + 1); ++j) {
        const float a = 0.5f * x[(7 * j + 1) % kV], c = 0.25f * x[(13 * j + 5) % kV];
        y[j] = (a + c) + (par ? 1e-3f : 0.f);
      }
    }
    x = y;
  }
  return x;
}

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 40, stages = layers * kPerLayer;
  int sms = 0, coop = 0;
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  cudaDeviceProp prop;
  LILY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int nb = sms;
  // Sizes in uint4, each a multiple of kTopK chunks for the routed stages.
  Plan p{};
  p.layers = layers, p.nb = nb;
  for (int s = 0; s < kPerLayer; ++s) p.stage_vec[s] = static_cast<size_t>(kStageMB[s] * 1e6 / 16 / kTopK) * kTopK;
  p.gu_vec = p.stage_vec[4] / kTopK;
  p.expert_vec = p.gu_vec + p.stage_vec[5] / kTopK;
  for (int s = 0; s < 4; ++s) p.dense_off[s] = p.dense_vec, p.dense_vec += p.stage_vec[s];
  const size_t n_dense = p.dense_vec * layers, n_experts = p.expert_vec * kExperts * layers;
  uint4 *dense, *experts;
  LILY_CUDA_CHECK(cudaMalloc(&dense, n_dense * 16));
  LILY_CUDA_CHECK(cudaMalloc(&experts, n_experts * 16));
  fill_kernel<<<4096, 256>>>(dense, n_dense, kSeedDense);
  fill_kernel<<<4096, 256>>>(experts, n_experts, kSeedExperts);
  LILY_CUDA_CHECK(cudaGetLastError());
  p.dense = dense, p.experts = experts;
  LILY_CUDA_CHECK(cudaMalloc(&p.y, sizeof(float) * kV * (stages + 1)));
  LILY_CUDA_CHECK(cudaMalloc(&p.yl, sizeof(uint4) * kPairs * (stages + 1)));
  LILY_CUDA_CHECK(cudaMemset(p.yl, 0, sizeof(uint4) * kPairs * (stages + 1)));
  LILY_CUDA_CHECK(cudaMalloc(&p.arrived, sizeof(unsigned) * stages));
  double per_layer_mb = 0;
  for (double mb : kStageMB) per_layer_mb += mb;
  std::printf("exp_dependency_chain (layer-shaped): %s, %d SMs, %d layers x %d stages, %.1f MB a layer, "
              "weights %.1f GB\n", prop.name, sms, layers, kPerLayer, per_layer_mb, (n_dense + n_experts) * 16 / 1e9);
  if (!coop) return std::printf("SUMMARY exp_dependency_chain 1 failed (no cooperative launch)\n"), 1;

  const size_t ring_smem = sizeof(RingSmem);
  LILY_CUDA_CHECK(cudaFuncSetAttribute(ring_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ring_smem)));
  LILY_CUDA_CHECK(cudaFuncSetAttribute(ring_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ring_smem)));
  int co_ring = 0, co_tma = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&co_ring, ring_kernel<false>, kRingThreads, ring_smem));
  const size_t tma_smem = (p.stage_vec[0] + nb - 1) / nb * 16;  // the largest share
  LILY_CUDA_CHECK(cudaFuncSetAttribute(tma_stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tma_smem)));
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&co_tma, tma_stage_kernel, kThreads, tma_smem));
  std::printf("ring: %zu bytes of shared memory, %d block(s) per SM; tma_pdl: %zu bytes, %d per SM\n", ring_smem,
              co_ring, tma_smem, co_tma);
  if (co_ring < 1) return std::printf("SUMMARY exp_dependency_chain 1 failed (the ring kernel does not fit)\n"), 1;

  std::vector<float> x0(kV);
  for (int j = 0; j < kV; ++j) x0[j] = std::sin(0.37f * j);
  std::vector<uint4> x0l(kPairs);
  cudaStream_t st;
  LILY_CUDA_CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  LILY_CUDA_CHECK(cudaEventCreate(&e0));
  LILY_CUDA_CHECK(cudaEventCreate(&e1));
  const char* names[] = {"pdl", "tma_pdl", "pf_l2", "ring", "ll"};
  constexpr int kForms = 5;
  int failed = 0;
  unsigned run_no = 0;
  const size_t full_vec[kPerLayer] = {p.stage_vec[0], p.stage_vec[1], p.stage_vec[2], p.stage_vec[3], p.stage_vec[4], p.stage_vec[5]};
  double table[2][kForms] = {};
  for (int scale = 1; scale >= 0; --scale) {
    for (int s = 0; s < kPerLayer; ++s) p.stage_vec[s] = scale ? full_vec[s] : 0;
    if (!scale) p.gu_vec = 0, p.expert_vec = 0;  // no weights: locate is never called
    cudaGraphExec_t graphs[3];
    for (int f = 0; f < 3; ++f) {
      cudaGraph_t g;
      LILY_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < stages; ++i) {
        if (f == 1) launch_pdl(tma_stage_kernel, dim3(nb), dim3(kThreads), tma_smem, st, p, i);
        else if (f == 0) launch_pdl(reg_stage_kernel<false>, dim3(nb), dim3(kThreads), 0, st, p, i);
        else launch_pdl(reg_stage_kernel<true>, dim3(nb), dim3(kThreads), 0, st, p, i);
      }
      LILY_CUDA_CHECK(cudaStreamEndCapture(st, &g));
      LILY_CUDA_CHECK(cudaGraphInstantiate(&graphs[f], g, 0));
      LILY_CUDA_CHECK(cudaGraphDestroy(g));
    }
    std::vector<float> want(kV);
    if (scale) {
      want = cpu_replica(p, dense, experts, x0);
    } else {  // no weights: every parity 0
      std::vector<float> x = x0;
      for (int i = 0; i < stages; ++i) {
        for (int j = 0; j < kV; ++j) want[j] = (0.5f * x[(7 * j + 1) % kV] + 0.25f * x[(13 * j + 5) % kV]) + 0.f;
        x = want;
      }
    }
    auto run = [&](int form) {
      ++run_no;
      p.epoch0 = run_no * (stages + 2);
      if (form == 4) {
        for (int q = 0; q < kPairs; ++q) {
          uint32_t a, b;
          std::memcpy(&a, &x0[2 * q], 4), std::memcpy(&b, &x0[2 * q + 1], 4);
          x0l[q] = make_uint4(a, p.epoch0, b, p.epoch0);
        }
        LILY_CUDA_CHECK(cudaMemcpyAsync(p.yl, x0l.data(), sizeof(uint4) * kPairs, cudaMemcpyHostToDevice, st));
      } else {
        LILY_CUDA_CHECK(cudaMemcpyAsync(p.y, x0.data(), sizeof(float) * kV, cudaMemcpyHostToDevice, st));
      }
      LILY_CUDA_CHECK(cudaMemsetAsync(p.arrived, 0, sizeof(unsigned) * stages, st));
      LILY_CUDA_CHECK(cudaEventRecord(e0, st));
      if (form < 3) {
        LILY_CUDA_CHECK(cudaGraphLaunch(graphs[form], st));
      } else {
        void* args[] = {&p};
        const void* k = form == 3 ? reinterpret_cast<const void*>(ring_kernel<false>)
                                  : reinterpret_cast<const void*>(ring_kernel<true>);
        LILY_CUDA_CHECK(cudaLaunchCooperativeKernel(k, dim3(nb), dim3(kRingThreads), args, ring_smem, st));
      }
      LILY_CUDA_CHECK(cudaEventRecord(e1, st));
      LILY_CUDA_CHECK(cudaStreamSynchronize(st));
      float ms = 0;
      LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    for (int form = 0; form < kForms; ++form) {
      run(form);  // warm
      std::vector<double> t;
      for (int r = 0; r < 7; ++r) t.push_back(run(form));
      std::sort(t.begin(), t.end());
      std::vector<float> out(kV);
      if (form == 4) {
        std::vector<uint4> lines(kPairs);
        LILY_CUDA_CHECK(cudaMemcpy(lines.data(), p.yl + size_t(stages) * kPairs, sizeof(uint4) * kPairs,
                                   cudaMemcpyDeviceToHost));
        for (int q = 0; q < kPairs; ++q) {
          std::memcpy(&out[2 * q], &lines[q].x, 4), std::memcpy(&out[2 * q + 1], &lines[q].z, 4);
          if (lines[q].y != p.epoch0 + stages || lines[q].w != p.epoch0 + stages) out[2 * q] = NAN;
        }
      } else {
        LILY_CUDA_CHECK(cudaMemcpy(out.data(), p.y + size_t(stages) * kV, sizeof(float) * kV, cudaMemcpyDeviceToHost));
      }
      const bool same = std::memcmp(out.data(), want.data(), sizeof(float) * kV) == 0;
      failed += !same;
      const double us_layer = t[3] * 1e3 / layers, bytes = per_layer_mb * 1e6 * scale;
      table[scale][form] = us_layer;
      std::printf("TIME %-7s scale %d  %7.2f us per layer  %5.2f us per stage  %5.2f TB/s  %s\n", names[form], scale,
                  us_layer, us_layer / kPerLayer, bytes / (us_layer * 1e-6) / 1e12, same ? "PASS (= CPU replica)" : "FAIL");
    }
    for (auto& g : graphs) LILY_CUDA_CHECK(cudaGraphExecDestroy(g));
  }
  std::printf("\n| form | us per layer (%.1f MB) | us per layer, no weights | hop (no weights) us per stage |\n|---|---:|---:|---:|\n",
              per_layer_mb);
  for (int f = 0; f < kForms; ++f)
    std::printf("| %s | %.2f | %.2f | %.2f |\n", names[f], table[1][f], table[0][f], table[0][f] / kPerLayer);
  std::printf("decision (issue 36): ring %.2f us per layer -> %s\n", table[1][3],
              table[1][3] <= 14.0 ? "(a) persistent per-layer kernel" : "(b) per-operation kernels of half an SM");
  std::printf("SUMMARY exp_dependency_chain %d failed\n", failed);
  return failed ? 1 : 0;
}
