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

// Attention runs flash-attention style over key blocks of kBlock keys from key 0: the blocks a row goes through and
// every operation on its scores, sums and output depend on its position alone, so an S-row call equals S one-row
// calls bit for bit (speculative verify, batched streams) whatever the tiling or thread count.
constexpr int64_t kBlock = 64;          // keys per online-softmax block (multiple of 8)
constexpr int64_t kLds = kBlock + 8;    // floats per (row, head) of scores: a key group may run past the block
constexpr int64_t kItemFloats = 32768;  // (row, head)s per work item x head_dim: state ~256 KB, in L2

#ifdef LILY_AVX2
// Lane c of the result: ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) of input c, whatever the other inputs are.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[i * kLds + c] = dot(q_i, k_c) * scale for NQ <= 3 queries q_i = q + i D and keys k0..k2 (s[.. + 3] gets junk).
// A key chunk is loaded once for the NQ queries; every (query, key) has its own accumulator over D in order and
// reduce4's tree, so a score has the same bits whichever kernel or neighbours compute it. (Named registers: GCC
// keeps arrays of vectors on the stack here.)
template <int NQ>
inline void qk3(const float* q, int64_t D, const float* k0, const float* k1, const float* k2, float scale, float* s) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z;
  for (int64_t d = 0; d < D; d += 8) {
    __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d), x2 = _mm256_loadu_ps(k2 + d);
    __asm__("" : "+x"(x0), "+x"(x1), "+x"(x2));  // kept in registers (GCC would reload them for every query)
    __m256 y = _mm256_loadu_ps(q + d);
    a00 = _mm256_fmadd_ps(y, x0, a00), a01 = _mm256_fmadd_ps(y, x1, a01), a02 = _mm256_fmadd_ps(y, x2, a02);
    if (NQ > 1) {
      y = _mm256_loadu_ps(q + D + d);
      a10 = _mm256_fmadd_ps(y, x0, a10), a11 = _mm256_fmadd_ps(y, x1, a11), a12 = _mm256_fmadd_ps(y, x2, a12);
    }
    if (NQ > 2) {
      y = _mm256_loadu_ps(q + 2 * D + d);
      a20 = _mm256_fmadd_ps(y, x0, a20), a21 = _mm256_fmadd_ps(y, x1, a21), a22 = _mm256_fmadd_ps(y, x2, a22);
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
  _mm_storeu_ps(s, _mm_mul_ps(reduce4(a00, a01, a02, z), sc));
  if (NQ > 1) _mm_storeu_ps(s + kLds, _mm_mul_ps(reduce4(a10, a11, a12, z), sc));
  if (NQ > 2) _mm_storeu_ps(s + 2 * kLds, _mm_mul_ps(reduce4(a20, a21, a22, z), sc));
}

// o_i[8c, 8c + 8) = o_i * alpha_i + sum_{j < n} p_i[j] v_j[8c, 8c + 8) for NQ queries and chunks c0..c0+NC-1,
// FMAs in key order, value rows ldv apart. A value chunk is loaded once for the NQ queries; per element the
// operations do not depend on NQ, NC or a split of j. (The unroll pragmas let GCC keep the arrays in registers.)
template <int NQ, int NC>
inline void pv_tile(float* const* o, const float* alpha, const float* const* p, const float* v, int64_t ldv,
                    int64_t n, int64_t c0) {
  __m256 acc[NQ][NC];
  _Pragma("GCC unroll 8") for (int i = 0; i < NQ; ++i)
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c)
      acc[i][c] = _mm256_mul_ps(_mm256_loadu_ps(o[i] + 8 * (c0 + c)), _mm256_set1_ps(alpha[i]));
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[NC];
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) {
      vv[c] = _mm256_loadu_ps(v + j * ldv + 8 * (c0 + c));
      if (NQ > 1) __asm__("" : "+x"(vv[c]));
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < NQ; ++i) {
      const __m256 pj = _mm256_broadcast_ss(p[i] + j);
      _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) acc[i][c] = _mm256_fmadd_ps(pj, vv[c], acc[i][c]);
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < NQ; ++i)
    _Pragma("GCC unroll 8") for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o[i] + 8 * (c0 + c), acc[i][c]);
}

template <int NQ, int NC>
__attribute__((noinline)) void pv_rows(float* const* o, const float* alpha, const float* const* p, const float* v,
                                       int64_t ldv, int64_t n, int64_t chunks) {  // out of line: GCC spills inlined
  int64_t c = 0;
  for (; c + NC <= chunks; c += NC) pv_tile<NQ, NC>(o, alpha, p, v, ldv, n, c);
  for (; c < chunks; ++c) pv_tile<NQ, 1>(o, alpha, p, v, ldv, n, c);
}
#endif

// One (row, head)'s online-softmax step over a key block: s[0..n) -> p = exp(s - m') in place, m' = max(m, s),
// l = l e^(m - m') + sum p; returns e^(m - m'), the factor of the output so far. The operations depend on n only.
inline float softmax_block(bool vec, float* s, int64_t n, float& m, float& l) {
  float mb = -INFINITY, sum = 0.f;
#ifdef LILY_AVX2
  if (vec) {  // s has room up to n rounded up to 8; lanes past n are masked off (whatever they hold)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    auto live = [&](int64_t j) {
      return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane));
    };
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 8) mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_loadu_ps(s + j), live(j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mb = std::max(m, _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1))));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 e = simd::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mb)));
      _mm256_storeu_ps(s + j, e);
      acc = _mm256_add_ps(acc, _mm256_and_ps(e, live(j)));
    }
    sum = simd::hsum(acc);
  } else
#endif
  {
    for (int64_t j = 0; j < n; ++j) mb = std::max(mb, s[j]);
    mb = std::max(m, mb);
    for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mb));
  }
  const float alpha = std::exp(m - mb);  // 0 on the first block (m = -inf)
  l = l * alpha + sum;
  m = mb;
  return alpha;
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

  // Causal softmax attention per (row, query head), fp32. A work item is a tile of rows and one KV head's query
  // heads, (row, head) i = r * group + g; each key and value row is read once per item for all of them (a long
  // context streams the cache from DRAM once per item, hence ~kItemFloats / D (row, head)s per item, fewer rows
  // when that would leave a thread idle). Per key block: scores (qk3), online softmax (softmax_block: running max
  // m, sum l, rescale of the output), then the value rows (pv_rows), all in L1/L2. (The previous kernel kept every
  // key's score per item, 2.6 MB at 20K context, out of L2: 4-5x slower at 4K-32K.)
  const int64_t group = Hq / Hkv;
  const int64_t per_thread = (S * Hkv + pool.size() - 1) / pool.size();
  const int64_t tile_rows = std::max<int64_t>(1, std::min(kItemFloats / D / group, per_thread));
  const int64_t tiles = (S + tile_rows - 1) / tile_rows;
#ifdef LILY_AVX2
  const bool vec = D % 8 == 0;
#else
  const bool vec = false;
#endif
  pool.parallel_for(tiles * Hkv, 1, [&](int64_t b, int64_t e, int) {
    thread_local std::vector<float> buf;  // out [nq, D] | q [nq, D] | scores [nq, kLds] | m, l, alpha [nq]
    thread_local std::vector<const float*> pp;
    thread_local std::vector<float*> op;
    thread_local std::vector<int64_t> len;
    for (int64_t item = b; item < e; ++item) {
      const int64_t t0 = (item / Hkv) * tile_rows, kvh = item % Hkv;
      const int64_t rows = std::min(tile_rows, S - t0), nq = rows * group;
      const int64_t width = p.pos0 + t0 + rows;  // keys of the tile's last row
      buf.resize(static_cast<size_t>(nq * (2 * D + kLds + 3)));
      std::fill(buf.begin(), buf.begin() + nq * D, 0.f);
      pp.resize(nq), op.resize(nq), len.resize(nq);
      float *acc = buf.data(), *qb = acc + nq * D, *sc = qb + nq * D, *m = sc + nq * kLds, *l = m + nq;
      float* alpha = l + nq;
      auto query = [&](int64_t i) { return qg + ((t0 + i / group) * Hq + kvh * group + i % group) * 2 * D; };
      for (int64_t i = 0; i < nq; ++i) {
        std::memcpy(qb + i * D, query(i), sizeof(float) * D);  // contiguous queries (the gates sit between them)
        pp[i] = sc + i * kLds, op[i] = acc + i * D, m[i] = -INFINITY, l[i] = 0.f;
      }
      const float *kh = k_cache + kvh * D, *vh = v_cache + kvh * D;
      for (int64_t jb = 0; jb < width; jb += kBlock) {
        const int64_t nk = std::min(kBlock, width - jb);
        const int64_t i0 = std::max<int64_t>(0, jb - p.pos0 - t0) * group;  // first (row, head) seeing key jb
        for (int64_t i = i0; i < nq; ++i) len[i] = std::min(nk, p.pos0 + t0 + i / group + 1 - jb);
#ifdef LILY_AVX2
        if (vec) {
          // Three keys (clamped to real rows) x threes of (row, head)s from i0 that see any of them.
          for (int64_t c = 0; c < nk; c += 3) {
            const float* k0 = kh + std::min(jb + c, width - 1) * kv_row;
            const float* k1 = kh + std::min(jb + c + 1, width - 1) * kv_row;
            const float* k2 = kh + std::min(jb + c + 2, width - 1) * kv_row;
            int64_t i = i0;
            for (; i + 3 <= nq; i += 3)
              if (len[i + 2] > c) qk3<3>(qb + i * D, D, k0, k1, k2, p.scale, sc + i * kLds + c);
            if (i + 2 == nq) qk3<2>(qb + i * D, D, k0, k1, k2, p.scale, sc + i * kLds + c);
            if (i + 1 == nq) qk3<1>(qb + i * D, D, k0, k1, k2, p.scale, sc + i * kLds + c);
          }
        } else
#endif
          for (int64_t i = i0; i < nq; ++i)
            for (int64_t j = 0; j < len[i]; ++j) sc[i * kLds + j] = simd::dot(qb + i * D, kh + (jb + j) * kv_row, D) * p.scale;
        for (int64_t i = i0; i < nq; ++i) alpha[i] = softmax_block(vec, sc + i * kLds, len[i], m[i], l[i]);
        const float* vb = vh + jb * kv_row;
#ifdef LILY_AVX2
        if (vec) {
          // Four (row, head)s over the keys all of them see, then each one over its further keys.
          for (int64_t i = i0; i < nq;) {
            const int64_t n4 = nq - i >= 4 ? 4 : nq - i >= 2 ? 2 : 1;
            if (n4 == 4) pv_rows<4, 2>(&op[i], &alpha[i], &pp[i], vb, kv_row, len[i], D / 8);
            else if (n4 == 2) pv_rows<2, 4>(&op[i], &alpha[i], &pp[i], vb, kv_row, len[i], D / 8);
            else pv_rows<1, 8>(&op[i], &alpha[i], &pp[i], vb, kv_row, len[i], D / 8);
            for (int64_t u = 1; u < n4; ++u)
              if (len[i + u] > len[i]) {
                const float one = 1.f, *pu = pp[i + u] + len[i];
                pv_rows<1, 8>(&op[i + u], &one, &pu, vb + len[i] * kv_row, kv_row, len[i + u] - len[i], D / 8);
              }
            i += n4;
          }
        } else
#endif
          for (int64_t i = i0; i < nq; ++i) {
            float* a = op[i];
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha[i];
            for (int64_t j = 0; j < len[i]; ++j)
              for (int64_t d = 0; d < D; ++d) a[d] += pp[i][j] * vb[j * kv_row + d];
          }
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* out = o + (t0 + i / group) * Hq * D + (kvh * group + i % group) * D;
        const float* gate = query(i) + D;
        const float s = 1.f / l[i];
        for (int64_t d = 0; d < D; ++d) out[d] = op[i][d] * (s * sigmoid(gate[d]));
      }
    }
  });
}

}  // namespace lily::cpu
