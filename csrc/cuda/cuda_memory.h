// The CUDA backend's Memory: device allocations and copies on the backend's own stream.
#pragma once
#include <cstddef>
#include <string>

#include <cuda_runtime.h>

#include "core/memory.h"
#include "cuda/common.cuh"

namespace lily {

// Device memory on the backend's stream; every call completes before it returns (the State contract).
class CudaMemory final : public Memory {
 public:
  CudaMemory() { LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking)); }
  ~CudaMemory() override { cudaStreamDestroy(st_); }
  cudaStream_t stream() const { return st_; }

  void* alloc(size_t bytes) override {
    void* p = nullptr;
    cuda::check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    LILY_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    LILY_CUDA_CHECK(cudaStreamSynchronize(st_));
    return p;
  }
  // cudaFree waits for queued work that may still use p.
  void release(void* p) noexcept override { cudaFree(p); }
  void copy(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyDeviceToDevice); }
  void to_host(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyDeviceToHost); }
  void from_host(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyHostToDevice); }

 private:
  void xfer(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, kind, st_));
    LILY_CUDA_CHECK(cudaStreamSynchronize(st_));
  }
  cudaStream_t st_ = nullptr;
};

}  // namespace lily
