// CK for the check programs that stop at the first CUDA error (check_attention, check_deltanet, check_gemm): the
// failed call, where, and the error, then exit status 2. (check_util.cuh's CK throws instead, so one case fails and
// check_small / check_sample go on.)
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                                   \
  do {                                                                                                          \
    const cudaError_t e_ = (x);                                                                                 \
    if (e_ != cudaSuccess) {                                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x);     \
      std::exit(2);                                                                                             \
    }                                                                                                           \
  } while (0)
