// Experiment (dev/README.md; issue 14 step 3): the one-token Gated DeltaNet state update at its bandwidth floor.
// Per layer and token the recurrent state S [Hv=32, Dv=128, Dk=128] fp32 (2 MB) is read and written once; lily's
// deltanet_step_kernel (csrc/cuda/deltanet.cu) took 12.4 us per layer under the profiler on the H200 (2026-12-01),
// against ~1 us for 4 MB at 4 TB/s plus a launch. Two kernels, same arithmetic as the CPU twin (model.md 4.3):
//   cur  lily's: one warp per state row (h, dv), 4 warps per block, each warp re-reading and re-normalising the
//        head's q and k (128 floats each: 4096 warps x 1 KB of L2 reads per layer, twice the state's bytes)
//   wide one block per (head, 32 rows): q, k normalised once per block into shared memory, each warp 4 rows with
//        16-byte state loads (a lane holds 4 consecutive dk), all rows' loads issued before any math
// Each is timed as a chain of 60 launches in a CUDA graph (PDL off: the question is the kernel) over 60 distinct
// states (120 MB, past the 60 MB L2), and checked against an fp64 host twin on fresh random inputs (y and the new
// state, rel RMS 1e-5), outputs NaN-poisoned first.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/exp_dn dev/exp_deltanet_step.cu && /tmp/exp_dn
// Written without a GPU (2026-12-01): compiled only.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/common.cuh"


constexpr int kHk = 16, kHv = 32, kDk = 128, kDv = 128;
constexpr float kQkEps = 1e-6f;
constexpr int64_t kKeyDim = int64_t(kHk) * kDk;
constexpr int64_t kState = int64_t(kHv) * kDv * kDk;  // floats per layer

struct Step {
  const float* u;       // [2 * key_dim + Hv * Dv]: q, k (not normalised), v
  const float* b;       // [Hv]
  const float* a;       // [Hv]
  const float* dt_bias; // [Hv]
  const float* a_log;   // [Hv]
  float* ssm;           // [Hv, Dv, Dk]
  float* y;             // [Hv, Dv]
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---- cur: lily's deltanet_step_kernel<4> (Dk = 128) ----
__global__ void __launch_bounds__(128) cur_kernel(Step s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, dv = blockIdx.x * 4 + warp;
  const int kh = h / (kHv / kHk);
  float* sp = s.ssm + (int64_t(h) * kDv + dv) * kDk;
  float st[4], q[4], k[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    st[i] = sp[lane + 32 * i];
    q[i] = s.u[int64_t(kh) * kDk + lane + 32 * i];
    k[i] = s.u[kKeyDim + int64_t(kh) * kDk + lane + 32 * i];
  }
  const float v = s.u[2 * kKeyDim + int64_t(h) * kDv + dv];
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  const float iq = 1.f / sqrtf(sq + kQkEps) * rsqrtf(static_cast<float>(kDk)), ik = 1.f / sqrtf(sk + kQkEps);
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] *= iq, k[i] *= ik;
  const float A = expf(s.a_log[h]), beta = 1.f / (1.f + expf(-s.b[h]));
  const float g = expf(-A * softplus(s.a[h] + s.dt_bias[h]));
  float kst = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) st[i] *= g, kst += st[i] * k[i];
  const float delta = beta * (v - warp_sum(kst));
  float o = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) st[i] += delta * k[i], o += st[i] * q[i];
  o = warp_sum(o);
  if (lane == 0) s.y[int64_t(h) * kDv + dv] = o;
#pragma unroll
  for (int i = 0; i < 4; ++i) sp[lane + 32 * i] = st[i];
}

// ---- wide: block (h, 32 rows), 8 warps x 4 rows, float4 state loads ----
constexpr int kRowsPerBlock = 32, kRowsPerWarp = 4;
__global__ void __launch_bounds__(256) wide_kernel(Step s) {
  __shared__ float4 qs[kDk / 4], ks[kDk / 4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h = blockIdx.y;
  const int kh = h / (kHv / kHk), dv0 = blockIdx.x * kRowsPerBlock + warp * kRowsPerWarp;
  // the warp's rows first: 4 x 512 bytes in flight per warp before anything waits
  float4* sp = reinterpret_cast<float4*>(s.ssm + (int64_t(h) * kDv + dv0) * kDk) + lane;
  float4 st[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) st[r] = sp[r * (kDk / 4)];
  float v[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) v[r] = s.u[2 * kKeyDim + int64_t(h) * kDv + dv0 + r];
  // q and k of the head, normalised once per block (warp 0: q, warp 1: k; the same sums as cur: lane l holds
  // elements l, l+32, l+64, l+96 before the butterfly, so the rounding matches)
  if (warp < 2) {
    const float* src = s.u + (warp == 0 ? 0 : kKeyDim) + int64_t(kh) * kDk;
    float x[4], ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = src[lane + 32 * i], ss += x[i] * x[i];
    ss = warp_sum(ss);
    const float inv = warp == 0 ? 1.f / sqrtf(ss + kQkEps) * rsqrtf(static_cast<float>(kDk)) : 1.f / sqrtf(ss + kQkEps);
    float* dst = reinterpret_cast<float*>(warp == 0 ? qs : ks);
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[lane + 32 * i] = x[i] * inv;
  }
  __syncthreads();
  const float4 q = qs[lane], k = ks[lane];  // lane holds dk 4l .. 4l+3
  const float A = expf(s.a_log[h]), beta = 1.f / (1.f + expf(-s.b[h]));
  const float g = expf(-A * softplus(s.a[h] + s.dt_bias[h]));
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    float4 t = st[r];
    t.x *= g, t.y *= g, t.z *= g, t.w *= g;
    const float kst = warp_sum(t.x * k.x + t.y * k.y + t.z * k.z + t.w * k.w);
    const float delta = beta * (v[r] - kst);
    t.x += delta * k.x, t.y += delta * k.y, t.z += delta * k.z, t.w += delta * k.w;
    const float o = warp_sum(t.x * q.x + t.y * q.y + t.z * q.z + t.w * q.w);
    if (lane == 0) s.y[int64_t(h) * kDv + dv0 + r] = o;
    sp[r * (kDk / 4)] = t;
  }
}

static std::vector<float> randu(std::mt19937& g, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

int main() {
  std::mt19937 rng(static_cast<unsigned>(std::random_device{}()));
  const int layers = 60;
  const size_t nu = 2 * kKeyDim + size_t(kHv) * kDv;
  std::vector<float> hu = randu(rng, nu, -1.5f, 1.5f);
  for (auto& x : hu) x = x / (1.f + std::exp(-x));  // post-conv SiLU values
  const auto hb = randu(rng, kHv, -4.f, 4.f), ha = randu(rng, kHv, -3.f, 0.5f), hdt = randu(rng, kHv, -1.f, 0.5f),
             hal = randu(rng, kHv, -1.5f, 0.f);
  const auto hs0 = randu(rng, kState, -0.5f, 0.5f);
  float *du, *db, *da, *ddt, *dal, *dssm, *dy;
  LILY_CUDA_CHECK(cudaMalloc(&du, nu * 4));
  LILY_CUDA_CHECK(cudaMalloc(&db, kHv * 4));
  LILY_CUDA_CHECK(cudaMalloc(&da, kHv * 4));
  LILY_CUDA_CHECK(cudaMalloc(&ddt, kHv * 4));
  LILY_CUDA_CHECK(cudaMalloc(&dal, kHv * 4));
  LILY_CUDA_CHECK(cudaMalloc(&dssm, size_t(layers) * kState * 4));
  LILY_CUDA_CHECK(cudaMalloc(&dy, size_t(layers) * kHv * kDv * 4));
  LILY_CUDA_CHECK(cudaMemcpy(du, hu.data(), nu * 4, cudaMemcpyHostToDevice));
  LILY_CUDA_CHECK(cudaMemcpy(db, hb.data(), kHv * 4, cudaMemcpyHostToDevice));
  LILY_CUDA_CHECK(cudaMemcpy(da, ha.data(), kHv * 4, cudaMemcpyHostToDevice));
  LILY_CUDA_CHECK(cudaMemcpy(ddt, hdt.data(), kHv * 4, cudaMemcpyHostToDevice));
  LILY_CUDA_CHECK(cudaMemcpy(dal, hal.data(), kHv * 4, cudaMemcpyHostToDevice));

  // fp64 twin of one step from hs0
  std::vector<double> ry(size_t(kHv) * kDv), rs(kState);
  for (int h = 0; h < kHv; ++h) {
    const int kh = h / (kHv / kHk);
    double q[kDk], k[kDk], sq = 0, sk = 0;
    for (int i = 0; i < kDk; ++i) {
      q[i] = hu[size_t(kh) * kDk + i], k[i] = hu[kKeyDim + size_t(kh) * kDk + i];
      sq += q[i] * q[i], sk += k[i] * k[i];
    }
    const double iq = 1.0 / std::sqrt(sq + kQkEps) / std::sqrt(double(kDk)), ik = 1.0 / std::sqrt(sk + kQkEps);
    for (int i = 0; i < kDk; ++i) q[i] *= iq, k[i] *= ik;
    const double x = double(ha[h]) + hdt[h], sp = x > 20 ? x : std::log1p(std::exp(x));
    const double g = std::exp(-std::exp(double(hal[h])) * sp), beta = 1.0 / (1.0 + std::exp(-double(hb[h])));
    for (int d = 0; d < kDv; ++d) {
      const size_t row = (size_t(h) * kDv + d) * kDk;
      double st[kDk], kst = 0, o = 0;
      for (int i = 0; i < kDk; ++i) st[i] = hs0[row + i] * g, kst += st[i] * k[i];
      const double delta = beta * (hu[2 * kKeyDim + size_t(h) * kDv + d] - kst);
      for (int i = 0; i < kDk; ++i) st[i] += delta * k[i], o += st[i] * q[i], rs[row + i] = st[i];
      ry[size_t(h) * kDv + d] = o;
    }
  }
  auto rel = [](const std::vector<double>& r, const std::vector<float>& g, bool& finite) {
    double n = 0, d = 0;
    for (size_t i = 0; i < r.size(); ++i) {
      finite = finite && std::isfinite(g[i]);
      n += (g[i] - r[i]) * (g[i] - r[i]), d += r[i] * r[i];
    }
    return std::sqrt(n / d);
  };
  int fails = 0;
  cudaStream_t st;
  LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int kind = 0; kind < 2; ++kind) {
    const char* name = kind == 0 ? "cur" : "wide";
    auto launch = [&](int l) {
      Step s{du, db, da, ddt, dal, dssm + size_t(l) * kState, dy + size_t(l) * kHv * kDv};
      if (kind == 0) cur_kernel<<<dim3(kDv / 4, kHv), 128, 0, st>>>(s);
      else wide_kernel<<<dim3(kDv / kRowsPerBlock, kHv), 256, 0, st>>>(s);
    };
    // check: layer 0 from hs0, outputs poisoned
    LILY_CUDA_CHECK(cudaMemcpy(dssm, hs0.data(), kState * 4, cudaMemcpyHostToDevice));
    LILY_CUDA_CHECK(cudaMemset(dy, 0xFF, size_t(kHv) * kDv * 4));
    launch(0);
    LILY_CUDA_CHECK(cudaStreamSynchronize(st));
    LILY_CUDA_CHECK(cudaGetLastError());
    std::vector<float> gy(size_t(kHv) * kDv), gs(kState);
    LILY_CUDA_CHECK(cudaMemcpy(gy.data(), dy, gy.size() * 4, cudaMemcpyDeviceToHost));
    LILY_CUDA_CHECK(cudaMemcpy(gs.data(), dssm, gs.size() * 4, cudaMemcpyDeviceToHost));
    bool finite = true;
    const double ey = rel(ry, gy, finite), es = rel(rs, gs, finite);
    const bool ok = finite && ey <= 1e-5 && es <= 1e-5;
    fails += !ok;
    // time: a graph of `layers` launches over distinct states (the values drift; only the time matters here)
    cudaGraph_t g;
    cudaGraphExec_t ge;
    LILY_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < layers; ++l) launch(l);
    LILY_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    LILY_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    LILY_CUDA_CHECK(cudaGraphLaunch(ge, st));
    cudaEvent_t e0, e1;
    LILY_CUDA_CHECK(cudaEventCreate(&e0));
    LILY_CUDA_CHECK(cudaEventCreate(&e1));
    LILY_CUDA_CHECK(cudaEventRecord(e0, st));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) LILY_CUDA_CHECK(cudaGraphLaunch(ge, st));
    LILY_CUDA_CHECK(cudaEventRecord(e1, st));
    LILY_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = 1e3 * ms / reps / layers;
    std::printf("%s %-5s y rel %.2e, state rel %.2e%s | %.2f us per layer, %.2f TB/s (state read + write)\n",
                ok ? "PASS" : "FAIL", name, ey, es, finite ? "" : " NON-FINITE", us, 2.0 * kState * 4 / (us * 1e-6) / 1e12);
  }
  std::printf("SUMMARY exp_deltanet_step %d failed\n", fails);
  return fails ? 1 : 0;
}
