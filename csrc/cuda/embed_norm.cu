#include "cuda/embed_norm.cuh"

#include <type_traits>

#include "cuda/mma_bf16.cuh"

namespace lily::cuda {
namespace {

// One block per row; 8 weights per thread step.
__global__ void embed_kernel(DLinear E, const int32_t* ids, float* x) {
  const int64_t s = blockIdx.x, n = E.p.in, row = ids[s];
  for (int64_t k0 = threadIdx.x * 8; k0 < n; k0 += blockDim.x * 8) {
    float w[8];
    load_w8(E, 0, row, k0, w);
    for (int j = 0; j < 8 && k0 + j < n; ++j) x[s * n + k0 + j] = w[j];
  }
}

constexpr int kNormThreads = 256;
// float4s per thread of the register path: rows up to 256 * 4 * 2 = 2048 floats (the model's hidden size).
constexpr int kNormVecs = 2;

// The sum of v over the block (a whole number of warps), returned to every thread. red: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
    t = warp_sum(t);
    if (threadIdx.x == 0) red[0] = t;
  }
  __syncthreads();
  return red[0];
}

// One block per row: fp32 sum of squares, then the scaled row in bf16 (the GEMM input). Any n, reading x twice.
template <class T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const float* x, const float* w, float eps, int64_t n,
                                                                T* y) {
  __shared__ float red[32];
  const float* xr = x + blockIdx.x * n;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, red) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = xr[i] * inv * w[i];
    if constexpr (std::is_same_v<T, bf16>) y[blockIdx.x * n + i] = __float2bfloat16(v);
    else y[blockIdx.x * n + i] = v;
  }
}

// rms_norm_kernel's formula with the row in registers (n % 4 == 0, n <= kNormThreads * 4 * kNormVecs, x and w
// 16-byte aligned, y 8-byte aligned): one float4 read of x (and of w, issued before the reduction so its latency
// hides behind it), 4 bf16 per 8-byte store.
__global__ void __launch_bounds__(kNormThreads) rms_norm_vec_kernel(const float* x, const float* w, float eps,
                                                                    int64_t n, bf16* y) {
  __shared__ float red[32];
  const int64_t nv = n / 4;
  const float4* xr = reinterpret_cast<const float4*>(x + blockIdx.x * n);
  const float4* wr = reinterpret_cast<const float4*>(w);
  float4 xv[kNormVecs], wv[kNormVecs];
  float ss = 0.f;
#pragma unroll
  for (int r = 0; r < kNormVecs; ++r) {
    const int64_t i = threadIdx.x + r * kNormThreads;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    xv[r] = i < nv ? xr[i] : zero;
    wv[r] = i < nv ? wr[i] : zero;
    ss += xv[r].x * xv[r].x;
    ss += xv[r].y * xv[r].y;
    ss += xv[r].z * xv[r].z;
    ss += xv[r].w * xv[r].w;
  }
  const float inv = rsqrtf(block_sum(ss, red) / static_cast<float>(n) + eps);
  uint2* yr = reinterpret_cast<uint2*>(y + blockIdx.x * n);
#pragma unroll
  for (int r = 0; r < kNormVecs; ++r) {
    const int64_t i = threadIdx.x + r * kNormThreads;
    if (i < nv)
      yr[i] = make_uint2(mma::pack_bf16x2(xv[r].x * inv * wv[r].x, xv[r].y * inv * wv[r].y),
                         mma::pack_bf16x2(xv[r].z * inv * wv[r].z, xv[r].w * inv * wv[r].w));
  }
}

}  // namespace

void embed(cudaStream_t st, const DLinear& E, const int32_t* ids, int64_t S, float* x) {
  embed_kernel<<<static_cast<unsigned>(S), 128, 0, st>>>(E, ids, x);
  LILY_LAUNCH_CHECK();
}

void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, bf16* y) {
  auto aligned = [](const void* q, uintptr_t b) { return reinterpret_cast<uintptr_t>(q) % b == 0; };
  if (n % 4 == 0 && n <= kNormThreads * 4 * kNormVecs && aligned(x, 16) && aligned(w, 16) && aligned(y, 8))
    rms_norm_vec_kernel<<<static_cast<unsigned>(rows), kNormThreads, 0, st>>>(x, w, eps, n, y);
  else
    rms_norm_kernel<bf16><<<static_cast<unsigned>(rows), kNormThreads, 0, st>>>(x, w, eps, n, y);
  LILY_LAUNCH_CHECK();
}

void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  rms_norm_kernel<float><<<static_cast<unsigned>(rows), kNormThreads, 0, st>>>(x, w, eps, n, y);
  LILY_LAUNCH_CHECK();
}

void poison(cudaStream_t st, void* p, size_t n) {
  if (n) LILY_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, n, st));
}

}  // namespace lily::cuda
