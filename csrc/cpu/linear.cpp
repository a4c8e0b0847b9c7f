#include "cpu/linear.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/simd.h"

namespace lily::cpu {
namespace {

// Below this many activation rows the GEMV path (no dequantized buffer) is faster.
constexpr int64_t kGemvMaxRows = 3;
constexpr int64_t kTile = 4;
std::atomic<bool> g_exact_rows{false};

std::vector<float>& tls_buffer(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// dot(W[r], x_s) for a quantized row and NS activation rows x[s] (xsum[s][g] = sum of x[s] over group g): the
// codes are decoded once for all rows, and each row's sums run in the one-row order, so every result is bit for
// bit what NS = 1 gives (an S-row verify equals S one-row steps: set_exact_rows).
template <int NS>
void qgemv_row(const Linear& W, int64_t r, const float* const* x, const float* const* xsum, float* out) {
  const int64_t ngroups = W.groups_per_row(), per_word = 32 / W.bits, wpg = W.group / per_word;
  const uint32_t* codes = W.codes + r * W.words_per_row();
  const uint16_t* sc = W.scales + r * ngroups;
  const uint16_t* bi = W.biases + r * ngroups;
  float bias_part[NS];
  for (int s = 0; s < NS; ++s) bias_part[s] = 0.f;
#ifdef LILY_AVX2
  __m256 total[NS];
  for (int s = 0; s < NS; ++s) total[s] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ngroups; ++g) {
    const uint32_t* cw = codes + g * wpg;
    const int64_t x0 = g * W.group;
    __m256 a0[NS], a1[NS];
    for (int s = 0; s < NS; ++s) a0[s] = _mm256_setzero_ps(), a1[s] = _mm256_setzero_ps();
    if (W.bits == 4) {
      for (int64_t w = 0; w < wpg; w += 2) {
        const __m256 c0 = simd::codes4x8(cw[w]), c1 = simd::codes4x8(cw[w + 1]);
        for (int s = 0; s < NS; ++s) {
          a0[s] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x[s] + x0 + 8 * w), a0[s]);
          a1[s] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x[s] + x0 + 8 * w + 8), a1[s]);
        }
      }
    } else {
      for (int64_t w = 0; w < wpg; w += 4) {
        const __m256 c0 = simd::codes8x8(cw + w), c1 = simd::codes8x8(cw + w + 2);
        for (int s = 0; s < NS; ++s) {
          a0[s] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x[s] + x0 + 4 * w), a0[s]);
          a1[s] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x[s] + x0 + 4 * w + 8), a1[s]);
        }
      }
    }
    const __m256 scale = _mm256_set1_ps(bf16_to_f32(sc[g]));
    const float bias = bf16_to_f32(bi[g]);
    for (int s = 0; s < NS; ++s) {
      total[s] = _mm256_fmadd_ps(scale, _mm256_add_ps(a0[s], a1[s]), total[s]);
      bias_part[s] += bias * xsum[s][g];
    }
  }
  for (int s = 0; s < NS; ++s) out[s] = simd::hsum(total[s]) + bias_part[s];
#else
  const uint32_t mask = (1u << W.bits) - 1;
  for (int s = 0; s < NS; ++s) {
    float acc = 0.f;
    for (int64_t g = 0; g < ngroups; ++g) {
      const uint32_t* cw = codes + g * wpg;
      const float* xg = x[s] + g * W.group;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t w = 0; w < wpg; ++w)
        for (int j = 0; j < per_word; ++j)
          part[j] += static_cast<float>((cw[w] >> (W.bits * j)) & mask) * xg[w * per_word + j];
      float qx = 0.f;
      for (int j = 0; j < per_word; ++j) qx += part[j];
      acc += bf16_to_f32(sc[g]) * qx;
      bias_part[s] += bf16_to_f32(bi[g]) * xsum[s][g];
    }
    out[s] = acc + bias_part[s];
  }
#endif
}

float bf16_dot(const uint16_t* w, const float* x, int64_t n) {
  int64_t i = 0;
  float r = 0.f;
#ifdef LILY_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(simd::load_bf16x8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(simd::load_bf16x8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  r = simd::hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) r += bf16_to_f32(w[i]) * x[i];
  return r;
}

// Rows of activations at a time in the quantized GEMV (register budget of qgemv_row's accumulators).
constexpr int kGemvBlock = 4;

void gemv_rows(const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy, int64_t r0,
               int64_t r1) {
  if (W.kind == Linear::Kind::Quant) {
    const int64_t ng = W.groups_per_row();
    std::vector<float>& sums = tls_buffer(static_cast<size_t>(S * ng));  // xsum of every row, [S, ng]
    for (int64_t s = 0; s < S; ++s)
      for (int64_t g = 0; g < ng; ++g) sums[s * ng + g] = simd::sum(x + s * ldx + g * W.group, W.group);
    for (int64_t s0 = 0; s0 < S; s0 += kGemvBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kGemvBlock, S - s0));
      const float* xs[kGemvBlock];
      const float* xsum[kGemvBlock];
      for (int i = 0; i < n; ++i) xs[i] = x + (s0 + i) * ldx, xsum[i] = sums.data() + (s0 + i) * ng;
      float out[kGemvBlock];
      for (int64_t r = r0; r < r1; ++r) {
        switch (n) {
          case 1: qgemv_row<1>(W, r, xs, xsum, out); break;
          case 2: qgemv_row<2>(W, r, xs, xsum, out); break;
          case 3: qgemv_row<3>(W, r, xs, xsum, out); break;
          default: qgemv_row<4>(W, r, xs, xsum, out); break;
        }
        for (int i = 0; i < n; ++i) y[(s0 + i) * ldy + r] = out[i];
      }
    }
    return;
  }
  for (int64_t s = 0; s < S; ++s) {
    const float* xs = x + s * ldx;
    float* ys = y + s * ldy;
    if (W.kind == Linear::Kind::DenseBF16) {
      const uint16_t* w = static_cast<const uint16_t*>(W.dense);
      for (int64_t r = r0; r < r1; ++r) ys[r] = bf16_dot(w + r * W.in, xs, W.in);
    } else {
      const float* w = static_cast<const float*>(W.dense);
      for (int64_t r = r0; r < r1; ++r) ys[r] = simd::dot(w + r * W.in, xs, W.in);
    }
  }
}

// Four dot products of x with rows w0..w3 (each [n]).
inline void dot4(const float* w0, const float* w1, const float* w2, const float* w3, const float* x, int64_t n,
                 float out[4]) {
  int64_t i = 0;
  float r0 = 0, r1 = 0, r2 = 0, r3 = 0;
#ifdef LILY_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 xv = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
  }
  r0 = simd::hsum(a0), r1 = simd::hsum(a1), r2 = simd::hsum(a2), r3 = simd::hsum(a3);
#else
  float p0[8] = {}, p1[8] = {}, p2[8] = {}, p3[8] = {};
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      p0[l] += w0[i + l] * x[i + l];
      p1[l] += w1[i + l] * x[i + l];
      p2[l] += w2[i + l] * x[i + l];
      p3[l] += w3[i + l] * x[i + l];
    }
  for (int l = 0; l < 8; ++l) r0 += p0[l], r1 += p1[l], r2 += p2[l], r3 += p3[l];
#endif
  for (; i < n; ++i) r0 += w0[i] * x[i], r1 += w1[i] * x[i], r2 += w2[i] * x[i], r3 += w3[i] * x[i];
  out[0] = r0, out[1] = r1, out[2] = r2, out[3] = r3;
}

#ifdef LILY_AVX2
// Register-blocked 4 weight rows x 2 activation rows: 6 loads feed 8 FMAs.
inline void dot4x2(const float* const w[4], const float* x0, const float* x1, int64_t n, float o0[4],
                   float o1[4]) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 u = _mm256_loadu_ps(x0 + i), v = _mm256_loadu_ps(x1 + i);
    for (int j = 0; j < 4; ++j) {
      const __m256 wj = _mm256_loadu_ps(w[j] + i);
      a[j] = _mm256_fmadd_ps(wj, u, a[j]);
      a[4 + j] = _mm256_fmadd_ps(wj, v, a[4 + j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    float r0 = simd::hsum(a[j]), r1 = simd::hsum(a[4 + j]);
    for (int64_t k = i; k < n; ++k) r0 += w[j][k] * x0[k], r1 += w[j][k] * x1[k];
    o0[j] = r0, o1[j] = r1;
  }
}
#endif

void gemm_rows(const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy, int64_t r0,
               int64_t r1) {
  const int64_t in = W.in;
  std::vector<float>& buf = tls_buffer(static_cast<size_t>(kTile * in));
  for (int64_t t0 = r0; t0 < r1; t0 += kTile) {
    const int64_t nr = std::min(kTile, r1 - t0);
    const float* rows[kTile];
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < nr) {
        if (W.kind == Linear::Kind::DenseF32) {
          rows[j] = static_cast<const float*>(W.dense) + (t0 + j) * in;
        } else {
          simd::weight_row(W, t0 + j, buf.data() + j * in);
          rows[j] = buf.data() + j * in;
        }
      } else {
        rows[j] = rows[0];  // padding lanes compute a duplicate that is never stored
      }
    }
    int64_t s = 0;
#ifdef LILY_AVX2
    for (; s + 2 <= S; s += 2) {
      float o0[4], o1[4];
      dot4x2(rows, x + s * ldx, x + (s + 1) * ldx, in, o0, o1);
      float* y0 = y + s * ldy + t0;
      float* y1 = y0 + ldy;
      for (int64_t j = 0; j < nr; ++j) y0[j] = o0[j], y1[j] = o1[j];
    }
#endif
    for (; s < S; ++s) {
      float o[4];
      dot4(rows[0], rows[1], rows[2], rows[3], x + s * ldx, in, o);
      float* ys = y + s * ldy + t0;
      for (int64_t j = 0; j < nr; ++j) ys[j] = o[j];
    }
  }
}

}  // namespace

void linear_rows(const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy, int64_t r0,
                 int64_t r1) {
  if (S <= kGemvMaxRows || g_exact_rows.load(std::memory_order_relaxed)) gemv_rows(W, x, ldx, S, y, ldy, r0, r1);
  else gemm_rows(W, x, ldx, S, y, ldy, r0, r1);
}

void set_exact_rows(bool on) { g_exact_rows.store(on, std::memory_order_relaxed); }

void linear(ThreadPool& pool, const Linear& W, const float* x, int64_t ldx, int64_t S, float* y, int64_t ldy) {
  // Enough rows per task to amortise scheduling (~32K multiply-adds), in whole tiles.
  const int64_t work_per_row = std::max<int64_t>(1, W.in * S);
  int64_t grain = std::max<int64_t>(kTile, 32768 / work_per_row);
  grain = (grain + kTile - 1) / kTile * kTile;
  pool.parallel_for(W.out, grain, [&](int64_t b, int64_t e, int) {
    linear_rows(W, x, ldx, S, y, ldy, b, e);
  });
}

}  // namespace lily::cpu
