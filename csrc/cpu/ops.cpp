#include "cpu/ops.h"

#include "cpu/simd.h"

namespace lily::cpu {

void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float ms = simd::dot(x, x, n) / static_cast<float>(n);
  const float inv = 1.f / std::sqrt(ms + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

void rms_norm(ThreadPool& pool, const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  pool.parallel_for(rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(x + r * n, w, eps, n, y + r * n);
  });
}

void gated_rms_norm(ThreadPool& pool, const float* o, const float* z, const float* w, float eps, int64_t rows,
                    int64_t heads, int64_t n, float* y) {
  pool.parallel_for(rows, 1, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t off = (r * heads + h) * n;
        rms_norm_row(o + off, w, eps, n, y + off);
        for (int64_t i = 0; i < n; ++i) y[off + i] *= silu(z[off + i]);
      }
  });
}

void embed(ThreadPool& pool, const Linear& E, const int32_t* ids, int64_t S, float* x) {
  pool.parallel_for(S, 8, [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s) simd::weight_row(E, ids[s], x + s * E.in);
  });
}

}  // namespace lily::cpu
