// CUDA runtime: device discovery. The backend itself: docs/architecture.md, "The CUDA
// backend".
#include <cuda_runtime.h>

#include "cuda/runtime.h"
#include "kernels/params.h"

namespace lily::cuda {

int device_count() {
  int n = 0;
  // cudart is linked statically: with no driver this returns an error code, which means "no device".
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace lily::cuda
