// Vector helpers for the CPU backend: fp32 dot/axpy and on-the-fly dequantization of MLX affine codes.
// AVX2/FMA paths behind __AVX2__; the portable fallbacks keep several independent accumulators so
// that GCC vectorises them without -ffast-math.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/tensor.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LILY_AVX2 1
#endif

namespace lily::simd {

#ifdef LILY_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
// 8 consecutive bf16 values -> 8 floats.
inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// One 4-bit word (8 codes, LSB first) -> 8 floats.
inline __m256 codes4x8(uint32_t word) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                               _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(q);
}
// Two 8-bit words (8 codes, LSB first = byte order on little endian) -> 8 floats.
inline __m256 codes8x8(const uint32_t* w) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
// e^x for 8 floats, lane by lane (the same bits in every lane): Cephes expf, x = n ln2 + r (two-part ln2), degree-5
// polynomial on |r| <= ln2/2, times 2^n. Within 1.01 ulp of the exact value for every float x in [-87.3, 0] (all
// checked); below about -87.6 (and -inf) it gives 0, no denormals; x is clamped at 88.37 (no inf); not for NaN.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// sum_i a[i] * b[i], fp32.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float r = 0.f;
#ifdef LILY_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  r = hsum(_mm256_add_ps(a0, a1));
#else
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; l < 8; ++l) r += acc[l];
#endif
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y[i] += a * x[i]
inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline float sum(const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += x[i + l];
  float r = 0.f;
  for (int l = 0; l < 8; ++l) r += acc[l];
  for (; i < n; ++i) r += x[i];
  return r;
}

// Dequantize row `r` of a quantized Linear into dst[in] (w = s*q + b per group).
inline void dequant_row(const Linear& W, int64_t r, float* dst) {
  const int64_t ngroups = W.groups_per_row(), per_word = 32 / W.bits, words_per_group = W.group / per_word;
  const uint32_t* codes = W.codes + r * W.words_per_row();
  const uint16_t* sc = W.scales + r * ngroups;
  const uint16_t* bi = W.biases + r * ngroups;
  for (int64_t g = 0; g < ngroups; ++g) {
    const float s = bf16_to_f32(sc[g]), b = bf16_to_f32(bi[g]);
    const uint32_t* cw = codes + g * words_per_group;
    float* d = dst + g * W.group;
#ifdef LILY_AVX2
    const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
    if (W.bits == 4) {
      for (int64_t w = 0; w < words_per_group; ++w)
        _mm256_storeu_ps(d + 8 * w, _mm256_fmadd_ps(codes4x8(cw[w]), vs, vb));
    } else {
      for (int64_t w = 0; w < words_per_group; w += 2)
        _mm256_storeu_ps(d + 4 * w, _mm256_fmadd_ps(codes8x8(cw + w), vs, vb));
    }
#else
    const uint32_t mask = (1u << W.bits) - 1;
    for (int64_t w = 0; w < words_per_group; ++w)
      for (int j = 0; j < per_word; ++j) d[w * per_word + j] = s * static_cast<float>((cw[w] >> (W.bits * j)) & mask) + b;
#endif
  }
}

// Row r of a dense bf16/f32 Linear into dst[in].
inline void dense_row(const Linear& W, int64_t r, float* dst) {
  if (W.kind == Linear::Kind::DenseF32) {
    std::memcpy(dst, static_cast<const float*>(W.dense) + r * W.in, sizeof(float) * W.in);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(W.dense) + r * W.in;
    for (int64_t i = 0; i < W.in; ++i) dst[i] = bf16_to_f32(p[i]);
  }
}

inline void weight_row(const Linear& W, int64_t r, float* dst) {
  if (W.kind == Linear::Kind::Quant) dequant_row(W, r, dst);
  else dense_row(W, r, dst);
}

}  // namespace lily::simd
