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

  // Causal softmax attention per (row, query head); fp32 throughout. A work item is a tile of up to kTileRows rows
  // and one KV head's query heads: each key and value row is read once for all of them (a row at a time over a
  // long context read the whole cache per row and head: 8K-token prefills ran 7x as long as 4K ones). Every
  // (row, head) keeps the one-row arithmetic in the same order (scores, their max, exp and sum in key order,
  // then the value rows in key order), so a row's output does not depend on the rows it is computed with.
  constexpr int64_t kTileRows = 16;
  const int64_t group = Hq / Hkv, tiles = (S + kTileRows - 1) / kTileRows;
  pool.parallel_for(tiles * Hkv, 1, [&](int64_t b, int64_t e, int) {
    thread_local std::vector<float> scores;  // [rows * group][keys of the tile's last row]
    thread_local std::vector<float> inv;     // [rows * group] 1 / the softmax's sum
    for (int64_t item = b; item < e; ++item) {
      const int64_t t0 = (item / Hkv) * kTileRows, kvh = item % Hkv;
      const int64_t rows = std::min(kTileRows, S - t0), nq = rows * group;
      const int64_t width = p.pos0 + t0 + rows;  // keys of the tile's last row
      if (static_cast<int64_t>(scores.size()) < nq * width) scores.resize(static_cast<size_t>(nq * width));
      auto query = [&](int64_t r, int64_t g) { return qg + ((t0 + r) * Hq + kvh * group + g) * 2 * D; };
      for (int64_t j = 0; j < width; ++j) {  // scores, a key row at a time for every (row, head) that sees it
        const float* kj = k_cache + j * kv_row + kvh * D;
        for (int64_t r = std::max<int64_t>(0, j - p.pos0 - t0); r < rows; ++r)
          for (int64_t g = 0; g < group; ++g)
            scores[(r * group + g) * width + j] = simd::dot(query(r, g), kj, D) * p.scale;
      }
      if (static_cast<int64_t>(inv.size()) < nq) inv.resize(static_cast<size_t>(nq));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          float* sc = &scores[(r * group + g) * width];
          const int64_t n = p.pos0 + t0 + r + 1;  // keys 0..pos
          float mx = -INFINITY;
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sc[j]);
          float denom = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = std::exp(sc[j] - mx);
            denom += sc[j];
          }
          inv[r * group + g] = 1.f / denom;
          float* out = o + (t0 + r) * Hq * D + (kvh * group + g) * D;
          std::fill(out, out + D, 0.f);
        }
      for (int64_t j = 0; j < width; ++j) {  // the value rows, each once for every (row, head) that sees it
        const float* vj = v_cache + j * kv_row + kvh * D;
        for (int64_t r = std::max<int64_t>(0, j - p.pos0 - t0); r < rows; ++r)
          for (int64_t g = 0; g < group; ++g)
            simd::axpy(scores[(r * group + g) * width + j], vj, o + (t0 + r) * Hq * D + (kvh * group + g) * D, D);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          float* out = o + (t0 + r) * Hq * D + (kvh * group + g) * D;
          const float* gate = query(r, g) + D;
          const float s = inv[r * group + g];
          for (int64_t d = 0; d < D; ++d) out[d] *= s * sigmoid(gate[d]);
        }
    }
  });
}

}  // namespace lily::cpu
