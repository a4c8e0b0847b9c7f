// Experiment (issue 14 step 2): what one grid-wide dependency costs on this GPU, by launch form, with and without
// a weight stream to hide behind it. A decode step is ~200 of them in a row (norm -> in-projection -> DeltaNet step
// -> out-projection -> router -> experts -> down, per layer), and lily's decode GEMV launch costs ~3.9 us plus its
// bytes at 4.5 TB/s (kernels_check_decode_h200.txt). The earlier persistent experiment (exp_persistent_gemv, H200
// 2026-12-02: 8.61 us per stage against 7.54 for PDL-chained launches) did not say where its per-stage time went;
// this one takes the GEMV out and keeps only the dependency and the bytes:
//   stage i: every block streams its share of W_i (B bytes, distinct per stage: nothing stays in L2) into
//   registers, XOR-reduces it to one parity bit per block, reads the whole x_i = y_i (kV floats, from L2) and
//   writes its slice of y_{i+1}[j] = 0.5 x_i[(7 j + 1) % kV] + 0.25 x_i[(13 j + 5) % kV] + 1e-3 parity_b.
// Forms (the same arithmetic, so the final vector must agree bit for bit):
//   launch   one kernel per stage, a CUDA graph of plain launches
//   pdl      one kernel per stage, PDL in a graph: the weight loads issued before griddepcontrol.wait
//   persist  one cooperative kernel, stages ordered by arrival counters (release add / acquire spin), the next
//            stage's weight loads issued right after this stage's arrival, before the wait
//   grid     one cooperative kernel, cg::this_grid().sync() between stages, the next stage's loads before it
//   tma_pdl  one kernel per stage, the block's share bulk-copied (cp.async.bulk, one mbarrier) into shared memory
//            before griddepcontrol.wait; the blocks are small enough (36 registers, the share alone in shared
//            memory) that the next stage's are resident beside the running ones; x read by two gathers from L2
//   tma_per  persist with the bulk copy into one shared-memory buffer, issued after the stage's arrival
// (A block's share is contiguous, so every form XORs the same elements.) Per stage time at B = 0 is the pure
// dependency cost; the slope over B is the stream rate behind it. The CPU replica (B = 0) and the cross-form
// agreement are its checks. Ran on the H200 2026-12-04: benchmarks/results/exp_dependency_chain_h200.txt.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/exp_dep dev/exp_dependency_chain.cu
//   /tmp/exp_dep [stages]          (H200: seconds)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/common.cuh"

namespace cg = cooperative_groups;
using lily::cuda::launch_pdl;
using lily::cuda::pdl_trigger;
using lily::cuda::pdl_wait;

constexpr int kThreads = 512;
constexpr int kV = 4096;         // the activation vector each stage reads whole
constexpr int kMaxW = 16;        // uint4 weight loads per thread per stage: 16 x 16 B x 512 x 132 = 17.3 MB at most

struct Chain {
  const uint4* w;      // [stages][stride] uint4: stage i's weights start at i * stride
  size_t stride;       // uint4 between stages (the largest B of the run, so stages never share L2 lines)
  size_t nvec;         // uint4 of this run's B
  float* y;            // [stages + 1][kV]: y[0] the input, y[i + 1] stage i's output
  unsigned* arrived;   // [stages] (persist)
  int stages;
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// This thread's share of stage i's weights into registers (loads only: the XOR comes later, after the wait).
// Block b's share of a stage's weights: uint4 [b * per, min((b + 1) * per, nvec)), per = ceil(nvec / blocks) (at most
// kMaxW * kThreads). Thread t holds elements t + k * kThreads of it.
__device__ __forceinline__ size_t share_lo(const Chain& c) { return blockIdx.x * ((c.nvec + gridDim.x - 1) / gridDim.x); }
__device__ __forceinline__ size_t share_hi(const Chain& c) {
  return min(c.nvec, (blockIdx.x + 1) * ((c.nvec + gridDim.x - 1) / gridDim.x));
}
__device__ __forceinline__ void load_w(const Chain& c, int i, uint4 (&wr)[kMaxW]) {
  const size_t lo = share_lo(c), hi = share_hi(c);
  const uint4* base = c.w + static_cast<size_t>(i) * c.stride;
#pragma unroll
  for (int k = 0; k < kMaxW; ++k) {
    const size_t at = lo + threadIdx.x + k * kThreads;
    wr[k] = at < hi ? ld_stream(base + at) : make_uint4(0, 0, 0, 0);
  }
}

// The block's parity of its weights, x_i staged, the block's slice of y_{i+1} stored.
__device__ __forceinline__ uint32_t parity_regs(const uint4 (&wr)[kMaxW]) {
  uint32_t acc = 0;
#pragma unroll
  for (int k = 0; k < kMaxW; ++k) acc ^= wr[k].x ^ wr[k].y ^ wr[k].z ^ wr[k].w;
  return acc;
}
__device__ __forceinline__ uint32_t parity_smem(const Chain& c, const uint4* ws) {  // the share bulk-copied to smem
  const int n = static_cast<int>(share_hi(c) - share_lo(c));
  uint32_t acc = 0;
  for (int k = threadIdx.x; k < n; k += kThreads) acc ^= ws[k].x ^ ws[k].y ^ ws[k].z ^ ws[k].w;
  return acc;
}
// XS: x staged in shared memory (else the two gathers per output read it from L2: the co-resident form has no room)
template <bool XS = true>
__device__ void stage_math(const Chain& c, int i, uint32_t acc, float* xs, uint32_t* red) {
  acc = __reduce_xor_sync(0xFFFFFFFFu, acc);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  const float* x = c.y + static_cast<size_t>(i) * kV;
  if (XS)
    for (int j = threadIdx.x; j < kV; j += kThreads) xs[j] = __ldcg(x + j);
  __syncthreads();
  uint32_t blk = 0;
  for (int k = 0; k < kThreads / 32; ++k) blk ^= red[k];
  const float parity = static_cast<float>(__popc(blk) & 1);
  const int lo = static_cast<int>(static_cast<int64_t>(kV) * blockIdx.x / gridDim.x);
  const int hi = static_cast<int>(static_cast<int64_t>(kV) * (blockIdx.x + 1) / gridDim.x);
  float* y = c.y + static_cast<size_t>(i + 1) * kV;
  for (int j = lo + threadIdx.x; j < hi; j += kThreads)
    y[j] = XS ? 0.5f * xs[(7 * j + 1) % kV] + 0.25f * xs[(13 * j + 5) % kV] + 1e-3f * parity
              : 0.5f * __ldcg(x + (7 * j + 1) % kV) + 0.25f * __ldcg(x + (13 * j + 5) % kV) + 1e-3f * parity;
  __syncthreads();  // xs and red are reused by the next stage
}

__global__ void __launch_bounds__(kThreads, 1) stage_kernel(Chain c, int i, int pdl) {
  __shared__ float xs[kV];
  __shared__ uint32_t red[kThreads / 32];
  uint4 wr[kMaxW];
  load_w(c, i, wr);  // weights never depend on the previous stage
  if (pdl) {
    pdl_trigger();
    pdl_wait();
  }
  stage_math(c, i, parity_regs(wr), xs, red);
}

// The persistent forms' dependency: every block has arrived at stage j's counter (its y, the next stage's x, stored).
__device__ __forceinline__ void await_stage(const Chain& c, int j) {
  if (threadIdx.x == 0) {
    unsigned v = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c.arrived + j) : "memory");
    } while (v < gridDim.x);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) persist_kernel(Chain c) {
  __shared__ float xs[kV];
  __shared__ uint32_t red[kThreads / 32];
  uint4 wr[kMaxW];
  load_w(c, 0, wr);
  for (int i = 0; i < c.stages; ++i) {
    if (i > 0) await_stage(c, i - 1);
    stage_math(c, i, parity_regs(wr), xs, red);  // ends with __syncthreads: this block's y slice is stored
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c.arrived + i) : "memory");
    }
    if (i + 1 < c.stages) load_w(c, i + 1, wr);  // the next stage's bytes go out before its wait
  }
}

__global__ void __launch_bounds__(kThreads, 1) grid_kernel(Chain c) {
  __shared__ float xs[kV];
  __shared__ uint32_t red[kThreads / 32];
  cg::grid_group grid = cg::this_grid();
  uint4 wr[kMaxW];
  load_w(c, 0, wr);
  for (int i = 0; i < c.stages; ++i) {
    stage_math(c, i, parity_regs(wr), xs, red);
    if (i + 1 < c.stages) {
      load_w(c, i + 1, wr);
      grid.sync();
    }
  }
}

// ---- the bulk-copy forms: a block's share goes global -> shared memory by the copy engine (cp.async.bulk, one
// mbarrier), not through the threads' load path, so the x loads and the counter polls do not queue behind it.
__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(b)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n W_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W_%=;\n}\n" ::"r"(saddr(b)), "r"(phase) : "memory");
}
constexpr int kChunk = 8192;  // bytes per bulk copy (several in flight per block)
// Warp 0: stage i's share into ws, completion counted on *bar (expect_tx by lane 0 first, then the lanes' copies).
__device__ __forceinline__ void bulk_share(const Chain& c, int i, uint4* ws, uint64_t* bar) {
  const size_t lo = share_lo(c), hi = share_hi(c);
  const uint32_t bytes = static_cast<uint32_t>((hi - lo) * 16);
  const int lane = threadIdx.x & 31;
  if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)), "r"(bytes) : "memory");
  __syncwarp();
  const char* src = reinterpret_cast<const char*>(c.w + static_cast<size_t>(i) * c.stride + lo);
  for (uint32_t off = lane * kChunk; off < bytes; off += 32 * kChunk) {
    const uint32_t n = min(static_cast<uint32_t>(kChunk), bytes - off);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(saddr(reinterpret_cast<char*>(ws) + off)), "l"(src + off), "r"(n), "r"(saddr(bar)) : "memory");
  }
}

// One kernel per stage; two blocks per SM fit (the share plus no x staging, under half the shared memory), so the
// next stage's blocks are resident while this one runs and their copies go out before their wait.
__global__ void __launch_bounds__(kThreads, 2) tma_stage_kernel(Chain c, int i, int pdl) {
  extern __shared__ __align__(128) uint4 ws[];
  __shared__ uint32_t red[kThreads / 32];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) mbar_init(&bar);
  __syncthreads();
  if (threadIdx.x < 32) bulk_share(c, i, ws, &bar);
  if (pdl) {
    pdl_trigger();
    pdl_wait();
  }
  mbar_wait(&bar, 0);
  stage_math<false>(c, i, parity_smem(c, ws), nullptr, red);
}

// One cooperative kernel, counters as in persist; the next stage's share bulk-copied right after this stage's
// arrival (one buffer: the same prefetch depth as persist's registers).
__global__ void __launch_bounds__(kThreads, 1) tma_persist_kernel(Chain c) {
  extern __shared__ __align__(128) uint4 ws[];
  __shared__ float xs[kV];
  __shared__ uint32_t red[kThreads / 32];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x == 0) mbar_init(&bar);
  __syncthreads();
  if (threadIdx.x < 32) bulk_share(c, 0, ws, &bar);
  for (int i = 0; i < c.stages; ++i) {
    if (i > 0) await_stage(c, i - 1);
    mbar_wait(&bar, i & 1);
    stage_math(c, i, parity_smem(c, ws), xs, red);  // ends with __syncthreads: ws is free again
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c.arrived + i) : "memory");
    }
    if (i + 1 < c.stages && threadIdx.x < 32) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the threads' reads of ws before the copy's writes
      bulk_share(c, i + 1, ws, &bar);
    }
  }
}

__global__ void fill_kernel(uint4* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12;
    p[i] = make_uint4(h, h * 3u + 1u, h ^ 0xA5A5A5A5u, h + seed);
  }
}

int main(int argc, char** argv) {
  const int stages = argc > 1 ? std::atoi(argv[1]) : 200;
  int sms = 0, coop = 0;
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  cudaDeviceProp prop;
  LILY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int nb = sms;  // one block per SM (the cooperative forms need every block resident)
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persist_kernel, kThreads, 0));
  std::printf("exp_dependency_chain: %s, %d SMs, %d stages, %d blocks x %d threads (%d resident per SM)\n", prop.name,
              sms, stages, nb, kThreads, per_sm);
  if (!coop || per_sm < 1) {
    std::printf("SUMMARY exp_dependency_chain 1 failed (no cooperative launch)\n");
    return 1;
  }
  const size_t max_vec = static_cast<size_t>(kMaxW) * kThreads * nb;  // uint4 per stage at the largest B
  const double bytes_list[] = {0, 1e6, 4e6, 14e6};
  uint4* w;
  LILY_CUDA_CHECK(cudaMalloc(&w, max_vec * 16 * stages));
  fill_kernel<<<1024, 256>>>(w, max_vec * stages, 12345u);
  float *y, *y_ref;
  unsigned* arrived;
  LILY_CUDA_CHECK(cudaMalloc(&y, sizeof(float) * kV * (stages + 1)));
  LILY_CUDA_CHECK(cudaMalloc(&y_ref, sizeof(float) * kV));
  LILY_CUDA_CHECK(cudaMalloc(&arrived, sizeof(unsigned) * stages));
  std::vector<float> x0(kV);
  for (int j = 0; j < kV; ++j) x0[j] = std::sin(0.37f * j);
  cudaStream_t st;
  LILY_CUDA_CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  LILY_CUDA_CHECK(cudaEventCreate(&e0));
  LILY_CUDA_CHECK(cudaEventCreate(&e1));
  int failed = 0;
  const char* names[] = {"launch", "pdl", "persist", "grid", "tma_pdl", "tma_per"};
  constexpr int kForms = 6;
  for (double B : bytes_list) {
    Chain c{w, max_vec, std::min(max_vec, static_cast<size_t>(B / 16)), y, arrived, stages};
    // graphs of the per-stage forms
    const size_t share_bytes = (c.nvec + nb - 1) / nb * 16;  // a block's share (the bulk-copy forms' buffer)
    LILY_CUDA_CHECK(cudaFuncSetAttribute(tma_stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(share_bytes)));
    LILY_CUDA_CHECK(cudaFuncSetAttribute(tma_persist_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(share_bytes)));
    if (B > 0) {
      int co = 0;
      LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&co, tma_stage_kernel, kThreads, share_bytes));
      std::printf("tma_pdl: %zu bytes per block, %d blocks resident per SM\n", share_bytes, co);
    }
    cudaGraphExec_t graphs[3];  // launch, pdl, tma_pdl
    for (int pdl = 0; pdl < 3; ++pdl) {
      cudaGraph_t g;
      LILY_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < stages; ++i) {
        if (pdl == 2) launch_pdl(tma_stage_kernel, dim3(nb), dim3(kThreads), share_bytes, st, c, i, i > 0 ? 1 : 0);
        else if (pdl && i > 0) launch_pdl(stage_kernel, dim3(nb), dim3(kThreads), 0, st, c, i, 1);
        else stage_kernel<<<nb, kThreads, 0, st>>>(c, i, 0);
      }
      LILY_CUDA_CHECK(cudaStreamEndCapture(st, &g));
      LILY_CUDA_CHECK(cudaGraphInstantiate(&graphs[pdl], g, 0));
      LILY_CUDA_CHECK(cudaGraphDestroy(g));
    }
    auto run = [&](int form) {
      LILY_CUDA_CHECK(cudaMemcpyAsync(y, x0.data(), sizeof(float) * kV, cudaMemcpyHostToDevice, st));
      LILY_CUDA_CHECK(cudaMemsetAsync(arrived, 0, sizeof(unsigned) * stages, st));
      LILY_CUDA_CHECK(cudaEventRecord(e0, st));
      if (form < 2 || form == 4) {
        LILY_CUDA_CHECK(cudaGraphLaunch(graphs[form < 2 ? form : 2], st));
      } else {
        void* args[] = {&c};
        const void* k = form == 2 ? reinterpret_cast<void*>(persist_kernel)
                        : form == 3 ? reinterpret_cast<void*>(grid_kernel) : reinterpret_cast<void*>(tma_persist_kernel);
        LILY_CUDA_CHECK(cudaLaunchCooperativeKernel(k, dim3(nb), dim3(kThreads), args, form == 5 ? share_bytes : 0, st));
      }
      LILY_CUDA_CHECK(cudaEventRecord(e1, st));
      LILY_CUDA_CHECK(cudaStreamSynchronize(st));
      float ms = 0;
      LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    std::vector<float> first;
    for (int form = 0; form < kForms; ++form) {
      run(form);  // warm
      std::vector<double> t;
      for (int r = 0; r < 7; ++r) t.push_back(run(form));
      std::sort(t.begin(), t.end());
      std::vector<float> out(kV);
      LILY_CUDA_CHECK(cudaMemcpy(out.data(), y + static_cast<size_t>(stages) * kV, sizeof(float) * kV,
                                 cudaMemcpyDeviceToHost));
      bool same = true;
      if (form == 0) first = out;
      else for (int j = 0; j < kV; ++j) same = same && out[j] == first[j];
      if (!same) ++failed;
      const double us = t[3] * 1e3 / stages, bytes = 16.0 * c.nvec;
      std::printf("TIME %-7s B=%5.1f MB  %7.2f us per stage  %6.2f TB/s of weights  %s\n", names[form], bytes / 1e6, us,
                  bytes / (us * 1e-6) / 1e12, form == 0 ? "" : same ? "same output as launch" : "OUTPUT DIFFERS");
    }
    if (B == 0) {  // the CPU replica: parity 0 everywhere (no weights read)
      std::vector<float> xr = x0, yr(kV);
      for (int i = 0; i < stages; ++i) {
        for (int j = 0; j < kV; ++j) yr[j] = 0.5f * xr[(7 * j + 1) % kV] + 0.25f * xr[(13 * j + 5) % kV] + 0.f;
        xr = yr;
      }
      bool ok = true;
      for (int j = 0; j < kV; ++j) ok = ok && xr[j] == first[j];
      std::printf("%s B=0 CPU replica\n", ok ? "PASS" : "FAIL");
      failed += !ok;
    }
    for (auto& g : graphs) LILY_CUDA_CHECK(cudaGraphExecDestroy(g));
  }
  std::printf("SUMMARY exp_dependency_chain %d failed\n", failed);
  return failed ? 1 : 0;
}
