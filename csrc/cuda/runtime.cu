// CUDA runtime: device discovery and one trivial kernel. The backend itself: docs/architecture.md, "The CUDA
// backend".
#include <cuda_runtime.h>

#include "cuda/runtime.h"
#include "kernels/params.h"

namespace lily::cuda {
namespace {

__global__ void fill_kernel(float* p, int n, float value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = value;
}

}  // namespace

int device_count() {
  int n = 0;
  // cudart is linked statically: with no driver this returns an error code, which means "no device".
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool fill_roundtrip(float* dst, int n, float value) {
  if (device_count() == 0 || n <= 0) return false;
  float* d = nullptr;
  if (cudaMalloc(&d, sizeof(float) * n) != cudaSuccess) return false;
  fill_kernel<<<(n + 255) / 256, 256>>>(d, n, value);
  bool ok = cudaGetLastError() == cudaSuccess &&
            cudaMemcpy(dst, d, sizeof(float) * n, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d);
  return ok;
}

}  // namespace lily::cuda
