// Embedding and RMSNorm (embed_norm.cu), and the debug poisoning of scratch. Device pointers, stream-ordered.
#pragma once
#include "cuda/common.cuh"
#include "kernels/params.h"

namespace lily::cuda {

// x[s, :] = E[ids[s], :] (dequantized rows).  ids: int32 [S], x: fp32 [S, E.in].
void embed(cudaStream_t st, const DLinear& E, const int32_t* ids, int64_t S, float* x);
// y[r, :] = bf16(x[r, :] * rsqrt(mean(x[r]^2) + eps) * w).  x: fp32 [rows, n], w: fp32 [n], y: bf16 [rows, n].
// One block per row; n % 4 == 0, n <= 2048 (the model's hidden size), x and w 16-byte and y 8-byte aligned: the
// row held in registers (x read once, float4 loads, 8-byte stores); otherwise a loop that reads x twice.
void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, bf16* y);
// The same, y fp32 [rows, n] (the MTP head's hidden rows), on the reading loop.
void rms_norm(cudaStream_t st, const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y);
// Fills n bytes with 0xFF (NaN in fp32 and bf16): debug poisoning of scratch buffers.
void poison(cudaStream_t st, void* p, size_t n);

}  // namespace lily::cuda
