// Small element-wise and row-wise ops of the CPU backend (fp32).
#pragma once
#include <cmath>
#include <cstdint>

#include "core/tensor.h"
#include "cpu/thread_pool.h"

namespace lily::cpu {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }
// log(1 + e^x) without overflow.
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// y[r, :] = x[r, :] * rsqrt(mean(x[r]^2) + eps) * w   for r < rows; x, y: [rows, n] (may alias), w: [n].
void rms_norm(ThreadPool& pool, const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y);
// Single row, serial.
void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y);

// y[r, h, :] = rms_norm(o[r, h, :]; w) * silu(z[r, h, :])  for r < rows, h < heads: the DeltaNet output norm.
// o, z, y: [rows, heads, n] (y may alias o), w: [n] used as stored (no +1).
void gated_rms_norm(ThreadPool& pool, const float* o, const float* z, const float* w, float eps, int64_t rows,
                    int64_t heads, int64_t n, float* y);

// x[s, :] = E[ids[s], :]  (quantized rows are dequantized); x: [S, E.in].
void embed(ThreadPool& pool, const Linear& E, const int32_t* ids, int64_t S, float* x);

}  // namespace lily::cpu
