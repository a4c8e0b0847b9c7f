#include "cuda/embed_norm.cuh"

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

// One block per row: fp32 sum of squares, then the scaled row in bf16 (the GEMM input).
__global__ void rms_norm_kernel(const float* x, const float* w, float eps, int64_t n, bf16* y) {
  __shared__ float red[32];
  const float* xr = x + blockIdx.x * n;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(red[0] / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) y[blockIdx.x * n + i] = __float2bfloat16(xr[i] * inv * w[i]);
}

}  // namespace

void embed(cudaStream_t st, const DLinear& E, const int32_t* ids, int64_t S, float* x) {
  embed_kernel<<<static_cast<unsigned>(S), 128, 0, st>>>(E, ids, x);
  LILY_LAUNCH_CHECK();
}

void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, bf16* y) {
  rms_norm_kernel<<<static_cast<unsigned>(rows), 256, 0, st>>>(x, w, eps, n, y);
  LILY_LAUNCH_CHECK();
}

void poison(cudaStream_t st, void* p, size_t n) {
  if (n) LILY_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, n, st));
}

}  // namespace lily::cuda
