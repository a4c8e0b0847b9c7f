// Experiment (a one-off, not a check: dev/README.md): how close can a decode-like chain of dependent 4-bit
// GEMVs get to the copy bandwidth, and what does it take? 40 "layers" x 5 stages with the byte sizes of a
// DeltaNet layer's decode (in-proj 12,352 x 2,048; out-proj 2,048 x 4,096; router 256 x 2,048; experts 8,192 x
// 2,048; down 2,048 x 4,608), ~1.4 GB of distinct weights, so nothing stays in L2 between tokens. Each stage
// reads the previous stage's output, so every stage boundary is a true dependency, as in the decode step.
//   A   one kernel per stage, chained by programmatic dependent launch, in a CUDA graph (today's structure)
//   A+P the same, but before waiting on its predecessor each block issues an L2 bulk prefetch of its own
//       weight slice (cp.async.bulk.prefetch.L2): the weights do not depend on the predecessor, so their reads
//       overlap its tail
//   A+N the same as A, but each kernel also prefetches the NEXT stage's weight slice into L2 (a ring across
//       stage boundaries without registers or shared memory)
//   B   one persistent cooperative kernel: stages separated by grid-wide barriers, the next stage's slice
//       prefetched into L2 before each barrier
// plus the ceiling: one plain read of all the weights. Every variant's final output is compared with variant A's
// (same arithmetic, same order: they must agree to the bit) and stage 0 with a CPU reference.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/exp dev/exp_stage_chain.cu
//   /tmp/exp [layers]
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace cg = cooperative_groups;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int kGroup = 64;         // 4-bit values per scale/bias pair
constexpr int kThreads = 256;      // 8 warps
constexpr int kRowsPerWarp = 4;    // rows a warp streams at once (bytes in flight)
constexpr int kMaxK = 4608;

struct Stage {
  const uint32_t* codes;       // [R, K/8] 4-bit codes, 8 per word
  const __nv_bfloat16* scale;  // [R, K/64]
  const __nv_bfloat16* bias;   // [R, K/64]
  const float* x;              // [R_prev] previous stage's output; input k is x[k % r_prev]
  float* y;                    // [R]
  int R, K, r_prev;
  const Stage* next;           // A+N: the stage whose weights to prefetch (nullptr: none)
};

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {  // p 16-byte aligned, bytes % 16 == 0
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// The row range [r0, r1) of warp `w` of `nw` warps in all, in kRowsPerWarp tasks.
__device__ __forceinline__ void warp_rows(int R, int w, int nw, int& r0, int& r1) {
  const int tasks = (R + kRowsPerWarp - 1) / kRowsPerWarp;
  const int per = (tasks + nw - 1) / nw;
  r0 = min(R, w * per * kRowsPerWarp);
  r1 = min(R, r0 + per * kRowsPerWarp);
}

// L2 prefetch of rows [r0, r1) of a stage by one lane per row piece.
__device__ void prefetch_rows(const Stage& s, int r0, int r1) {
  const int lane = threadIdx.x % 32;
  for (int r = r0 + lane; r < r1; r += 32) {
    prefetch_l2(s.codes + static_cast<size_t>(r) * (s.K / 8), s.K / 2);
    prefetch_l2(s.scale + static_cast<size_t>(r) * (s.K / kGroup), s.K / kGroup * 2);
    prefetch_l2(s.bias + static_cast<size_t>(r) * (s.K / kGroup), s.K / kGroup * 2);
  }
}

// y[r] for the warp's rows: lanes stride over 16-byte code chunks (32 values, half a group).
__device__ void gemv_rows(const Stage& s, const float* xs, int r0, int r1) {
  const int lane = threadIdx.x % 32, chunks = s.K / 32;
  for (int r = r0; r < r1; r += kRowsPerWarp) {
    float acc[kRowsPerWarp] = {};
    for (int c = lane; c < chunks; c += 32) {
      uint4 q[kRowsPerWarp];
      float sc[kRowsPerWarp], bi[kRowsPerWarp];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int row = min(r + j, r1 - 1);
        q[j] = reinterpret_cast<const uint4*>(s.codes + static_cast<size_t>(row) * (s.K / 8))[c];
        sc[j] = __bfloat162float(s.scale[static_cast<size_t>(row) * (s.K / kGroup) + c / 2]);
        bi[j] = __bfloat162float(s.bias[static_cast<size_t>(row) * (s.K / kGroup) + c / 2]);
      }
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const uint32_t w4[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
        float dq = 0.f, dx = 0.f;  // sum q*x and sum x over the chunk: w = scale * q + bias
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int v = 0; v < 8; ++v) {
            const float xv = xs[c * 32 + u * 8 + v];
            dq += static_cast<float>((w4[u] >> (4 * v)) & 15u) * xv;
            dx += xv;
          }
        acc[j] += sc[j] * dq + bi[j] * dx;
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      float a = acc[j];
      for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane == 0 && r + j < r1) s.y[r + j] = tanhf(a / static_cast<float>(s.K));  // bounded, non-expanding
    }
  }
}

__device__ void load_x(const Stage& s, float* xs) {
  for (int k = threadIdx.x; k < s.K; k += blockDim.x) xs[k] = s.x[k % s.r_prev];
  __syncthreads();
}

// mode 0: A; 1: A+P (own slice before the wait); 2: A+N (next stage's slice after computing).
__global__ void __launch_bounds__(kThreads) stage_kernel(Stage s, int mode) {
  __shared__ float xs[kMaxK];
  const int nw = gridDim.x * (kThreads / 32), w = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  int r0, r1;
  warp_rows(s.R, w, nw, r0, r1);
  if (mode == 1) prefetch_rows(s, r0, r1);
  pdl_wait();
  pdl_trigger();
  load_x(s, xs);
  if (mode == 2 && s.next) {
    int n0, n1;
    warp_rows(s.next->R, w, nw, n0, n1);
    prefetch_rows(*s.next, n0, n1);
  }
  gemv_rows(s, xs, r0, r1);
}

__global__ void __launch_bounds__(kThreads) persistent_kernel(const Stage* stages, int n) {
  __shared__ float xs[kMaxK];
  cg::grid_group grid = cg::this_grid();
  const int nw = gridDim.x * (kThreads / 32), w = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  for (int i = 0; i < n; ++i) {
    const Stage s = stages[i];
    int r0, r1;
    warp_rows(s.R, w, nw, r0, r1);
    if (i + 1 < n) {
      int n0, n1;
      warp_rows(stages[i + 1].R, w, nw, n0, n1);
      prefetch_rows(stages[i + 1], n0, n1);
    }
    load_x(s, xs);
    gemv_rows(s, xs, r0, r1);
    grid.sync();
  }
}

__global__ void read_kernel(const uint4* p, size_t n, unsigned long long* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(sink, 1ull);
}

static void launch_stage(cudaStream_t st, const Stage& s, int mode, int blocks) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, stage_kernel, s, mode));
}

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 40;
  const int shapes[5][2] = {{12352, 2048}, {2048, 4096}, {256, 2048}, {8192, 2048}, {2048, 4608}};
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int n = layers * 5;
  size_t words = 0, groups = 0, ys = 0;
  for (int i = 0; i < n; ++i) {
    words += static_cast<size_t>(shapes[i % 5][0]) * shapes[i % 5][1] / 8;
    groups += static_cast<size_t>(shapes[i % 5][0]) * shapes[i % 5][1] / kGroup;
    ys += shapes[i % 5][0];
  }
  const double bytes = words * 4.0 + groups * 4.0;
  std::printf("exp_stage_chain: %s, %d SMs, %d layers x 5 stages, %.3f GB of weights\n", prop.name, sms, layers,
              bytes / 1e9);
  std::mt19937 rng(7);
  std::vector<uint32_t> hc(words);
  for (auto& v : hc) v = rng();
  std::vector<__nv_bfloat16> hs(groups), hb(groups);
  for (size_t i = 0; i < groups; ++i) {
    hs[i] = __float2bfloat16(0.05f + 0.1f * (rng() % 1000) / 1000.f);
    hb[i] = __float2bfloat16(-0.4f + 0.8f * (rng() % 1000) / 1000.f);
  }
  uint32_t* dc;
  __nv_bfloat16 *dsc, *dbi;
  float *dy, *dx0;
  CK(cudaMalloc(&dc, words * 4));
  CK(cudaMalloc(&dsc, groups * 2));
  CK(cudaMalloc(&dbi, groups * 2));
  CK(cudaMalloc(&dy, ys * 4));
  CK(cudaMalloc(&dx0, 2048 * 4));
  CK(cudaMemcpy(dc, hc.data(), words * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dsc, hs.data(), groups * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbi, hb.data(), groups * 2, cudaMemcpyHostToDevice));
  std::vector<float> hx0(2048);
  for (auto& v : hx0) v = (rng() % 2001) / 1000.f - 1.f;
  CK(cudaMemcpy(dx0, hx0.data(), 2048 * 4, cudaMemcpyHostToDevice));

  std::vector<Stage> hst(n);
  Stage* dst;
  CK(cudaMalloc(&dst, n * sizeof(Stage)));
  size_t wo = 0, go = 0, yo = 0;
  for (int i = 0; i < n; ++i) {
    Stage& s = hst[i];
    s.R = shapes[i % 5][0];
    s.K = shapes[i % 5][1];
    s.codes = dc + wo;
    s.scale = dsc + go;
    s.bias = dbi + go;
    s.y = dy + yo;
    s.x = i == 0 ? dx0 : hst[i - 1].y;
    s.r_prev = i == 0 ? 2048 : hst[i - 1].R;
    s.next = i + 1 < n ? dst + i + 1 : nullptr;
    wo += static_cast<size_t>(s.R) * s.K / 8;
    go += static_cast<size_t>(s.R) * s.K / kGroup;
    yo += s.R;
  }
  CK(cudaMemcpy(dst, hst.data(), n * sizeof(Stage), cudaMemcpyHostToDevice));

  // stage 0 on the CPU (the same formula; float accumulation order differs, so a tolerance)
  std::vector<float> ref0(hst[0].R);
  for (int r = 0; r < hst[0].R; ++r) {
    double acc = 0;
    for (int k = 0; k < 2048; ++k) {
      const uint32_t q = (hc[static_cast<size_t>(r) * 256 + k / 8] >> (4 * (k % 8))) & 15u;
      const size_t g = static_cast<size_t>(r) * 32 + k / kGroup;
      acc += (__bfloat162float(hs[g]) * q + __bfloat162float(hb[g])) * hx0[k];
    }
    ref0[r] = static_cast<float>(std::tanh(acc / 2048.0));
  }

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 10;
  std::vector<float> out_a;
  auto final_out = [&]() {
    std::vector<float> v(hst[n - 1].R);
    CK(cudaMemcpy(v.data(), hst[n - 1].y, v.size() * 4, cudaMemcpyDeviceToHost));
    return v;
  };
  int fails = 0;
  auto check = [&](const char* name) {
    std::vector<float> y0(hst[0].R);
    CK(cudaMemcpy(y0.data(), hst[0].y, y0.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (size_t r = 0; r < y0.size(); ++r) worst = std::fmax(worst, std::fabs(y0[r] - ref0[r]));
    const auto v = final_out();
    bool same = true;
    if (out_a.empty()) out_a = v;
    else same = std::memcmp(v.data(), out_a.data(), v.size() * 4) == 0;
    const bool ok = worst < 1e-4 && same;
    fails += !ok;
    std::printf("%s %-4s stage-0 max |gpu - cpu| %.2e, final output %s variant A\n", ok ? "PASS" : "FAIL", name,
                worst, same ? "identical to" : "DIFFERS from");
  };
  auto timed = [&](const char* name, auto&& run) {
    run();
    CK(cudaStreamSynchronize(st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) run();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= reps;
    std::printf("TIME %-4s %8.3f ms per chain (%.1f us per stage) %.2f TB/s effective\n", name, ms, 1e3 * ms / n,
                bytes / (ms * 1e-3) / 1e12);
    check(name);
  };

  for (int blocks_per_sm : {1, 2}) {
    const int blocks = sms * blocks_per_sm;
    std::printf("-- %d block(s) per SM for the per-stage kernels\n", blocks_per_sm);
    for (int mode = 0; mode < 3; ++mode) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < n; ++i) launch_stage(st, hst[i], mode, blocks);
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      const char* names[3] = {"A", "A+P", "A+N"};
      timed(names[mode], [&] { CK(cudaGraphLaunch(ge, st)); });
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
  }
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kThreads, 0));
  for (int b : {1, 2}) {
    if (b > per_sm) break;
    const int blocks = sms * b;
    void* args[] = {&dst, const_cast<int*>(&n)};
    std::printf("-- persistent: %d block(s) per SM\n", b);
    timed("B", [&] {
      CK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(blocks), dim3(kThreads), args,
                                     0, st));
    });
  }
  unsigned long long* sink;
  CK(cudaMalloc(&sink, 8));
  for (int b : {4, 8}) {
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i)
      read_kernel<<<sms * b, 512, 0, st>>>(reinterpret_cast<const uint4*>(dc), words / 4, sink);
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= reps;
    std::printf("TIME read of the codes (%d blocks/SM): %.3f ms, %.2f TB/s\n", b, ms, words * 4.0 / (ms * 1e-3) / 1e12);
  }
  std::printf("SUMMARY exp_stage_chain %d failed\n", fails);
  return fails ? 1 : 0;
}
