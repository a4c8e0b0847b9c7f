// y = x W^T for quantized (4/8-bit MLX affine) and dense (bf16/f32) weights, fp32 activations.
// Weights are dequantized on the fly: GEMV uses the per-group identity
//   sum_i (s q_i + b) x_i = s * dot(q, x) + b * sum(x),
// GEMM dequantizes a tile of 4 weight rows into a small per-thread buffer and reuses it for all S rows.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "cpu/thread_pool.h"

namespace lily::cpu {

// y[s*ldy + r] = sum_i x[s*ldx + i] * W[r, i]  for s < S, r < W.out.
// x: [S, ldx] (W.in used), y: [S, ldy]. W must not be stacked (take W.expert(e) first).
void linear(ThreadPool& pool, const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy);

inline void linear(ThreadPool& pool, const Linear& W, const float* x, int64_t S, float* y) {
  linear(pool, W, x, W.in, S, y, W.out);
}

// on: every S computes each row as S == 1 does (the GEMV path), so an S-row forward equals S one-row steps bit
// for bit (the speculative verify, Backend::exact_rows). Process-wide; the engine sets it under its lock.
void set_exact_rows(bool on);

// Serial version over output rows [r0, r1) (callers that parallelise themselves).
void linear_rows(const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy, int64_t r0,
                 int64_t r1);

}  // namespace lily::cpu
