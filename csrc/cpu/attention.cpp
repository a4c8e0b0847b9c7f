#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/ops.h"
#include "cpu/simd.h"

namespace lily::cpu {
namespace {

// x[0..rd) rotated by angles with cos/sin tables [rd/2]; NeoX half-split pairing.
inline void rope_row(float* x, const float* cs, const float* sn, int half) {
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cs[i] - b * sn[i];
    x[i + half] = b * cs[i] + a * sn[i];
  }
}

}  // namespace

void attention_forward(ThreadPool& pool, const kp::AttentionParams& p, float* qg, float* k, const float* v,
                       const float* q_norm, const float* k_norm, float* k_cache, float* v_cache, float* o) {
  const int64_t S = p.S, D = p.head_dim, Hq = p.n_heads, Hkv = p.n_kv_heads;
  const int half = p.rotary_dim / 2;
  const int64_t kv_row = Hkv * D;

  // cos/sin per new row: [S, half]; angles from integer positions in double precision.
  std::vector<float> cs(static_cast<size_t>(S * half)), sn(static_cast<size_t>(S * half));
  for (int64_t t = 0; t < S; ++t)
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(static_cast<double>(p.rope_theta), -2.0 * i / p.rotary_dim);
      const double ang = static_cast<double>(p.pos0 + t) * inv_freq;
      cs[t * half + i] = static_cast<float>(std::cos(ang));
      sn[t * half + i] = static_cast<float>(std::sin(ang));
    }

  // q/k per-head RMSNorm + RoPE; k and v appended to the cache.
  pool.parallel_for(S, 1, [&](int64_t b, int64_t e, int) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t h = 0; h < Hq; ++h) {
        float* q = qg + (t * Hq + h) * 2 * D;
        rms_norm_row(q, q_norm, p.eps, D, q);
        rope_row(q, &cs[t * half], &sn[t * half], half);
      }
      float* kc = k_cache + (p.pos0 + t) * kv_row;
      float* vc = v_cache + (p.pos0 + t) * kv_row;
      for (int64_t h = 0; h < Hkv; ++h) {
        float* kk = k + t * kv_row + h * D;
        rms_norm_row(kk, k_norm, p.eps, D, kk);
        rope_row(kk, &cs[t * half], &sn[t * half], half);
      }
      std::memcpy(kc, k + t * kv_row, sizeof(float) * kv_row);
      std::memcpy(vc, v + t * kv_row, sizeof(float) * kv_row);
    }
  });

  // Causal softmax attention per (row, query head); fp32 throughout.
  const int64_t group = Hq / Hkv;
  pool.parallel_for(S * Hq, 1, [&](int64_t b, int64_t e, int) {
    thread_local std::vector<float> scores;
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / Hq, h = i % Hq, kvh = h / group;
      const int64_t n = p.pos0 + t + 1;  // keys 0..pos
      if (static_cast<int64_t>(scores.size()) < n) scores.resize(n);
      const float* q = qg + (t * Hq + h) * 2 * D;
      const float* gate = q + D;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = simd::dot(q, k_cache + j * kv_row + kvh * D, D) * p.scale;
        mx = std::max(mx, scores[j]);
      }
      float denom = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        denom += scores[j];
      }
      float* out = o + t * Hq * D + h * D;
      std::fill(out, out + D, 0.f);
      for (int64_t j = 0; j < n; ++j) simd::axpy(scores[j], v_cache + j * kv_row + kvh * D, out, D);
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv * sigmoid(gate[d]);
    }
  });
}

}  // namespace lily::cpu
