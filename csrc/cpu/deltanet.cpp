#include "cpu/deltanet.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/ops.h"
#include "cpu/simd.h"

namespace lily::cpu {

void deltanet_forward(ThreadPool& pool, const kp::DeltaNetParams& p, const float* qkv, const float* z,
                      const float* b, const float* a, const float* conv_w, const float* dt_bias,
                      const float* a_log, const float* norm_w, float* conv_state, float* ssm, float* u, float* y,
                      float* ssm_rows, float* conv_rows) {
  const int64_t S = p.S, C = p.conv_dim, K = p.conv_kernel, Hk = p.k_heads, Hv = p.v_heads, Dk = p.k_dim,
                Dv = p.v_dim;
  const int64_t key_dim = Hk * Dk;

  // 1. Causal depthwise conv over X = [conv_state (K-1 rows); qkv (S rows)], then SiLU.
  //    Tap j = K-1 multiplies the current row. Channels are independent: split them across threads.
  pool.parallel_for(C, 64, [&](int64_t c0, int64_t c1, int) {
    auto X = [&](int64_t i, int64_t c) { return i < K - 1 ? conv_state[i * C + c] : qkv[(i - (K - 1)) * C + c]; };
    for (int64_t t = 0; t < S; ++t)
      for (int64_t c = c0; c < c1; ++c) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; ++j) acc += conv_w[c * K + j] * X(t + j, c);
        u[t * C + c] = silu(acc);
      }
    if (conv_rows)  // the state after row t: X rows t+1 .. t+K-1
      for (int64_t t = 0; t < S; ++t)
        for (int64_t r = 0; r < K - 1; ++r)
          for (int64_t c = c0; c < c1; ++c) conv_rows[(t * (K - 1) + r) * C + c] = X(t + 1 + r, c);
    // New state = last K-1 rows of X; ascending r only overwrites rows no longer needed.
    for (int64_t r = 0; r < K - 1; ++r)
      for (int64_t c = c0; c < c1; ++c) conv_state[r * C + c] = X(S + r, c);
  });

  // 2. l2-normalise q (times Dk^-0.5) and k per head, eps inside the sqrt.
  const float q_scale = 1.f / std::sqrt(static_cast<float>(Dk));
  pool.parallel_for(S, 1, [&](int64_t t0, int64_t t1, int) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < 2 * Hk; ++h) {
        float* x = u + t * C + h * Dk;
        const float inv = 1.f / std::sqrt(simd::dot(x, x, Dk) + p.qk_eps) * (h < Hk ? q_scale : 1.f);
        for (int64_t i = 0; i < Dk; ++i) x[i] *= inv;
      }
  });

  // 3. Gates in fp32: beta = sigmoid(b), g = exp(-exp(A_log) * softplus(a + dt_bias)). [S, Hv]
  std::vector<float> beta(static_cast<size_t>(S * Hv)), decay(static_cast<size_t>(S * Hv));
  for (int64_t t = 0; t < S; ++t)
    for (int64_t h = 0; h < Hv; ++h) {
      beta[t * Hv + h] = sigmoid(b[t * Hv + h]);
      decay[t * Hv + h] = std::exp(-std::exp(a_log[h]) * softplus(a[t * Hv + h] + dt_bias[h]));
    }

  // 4. Recurrence. Each state row S[h, dv, :] evolves independently of the other rows, so a thread
  //    owns a set of rows and runs all S tokens on them while they stay in L1.
  const int64_t kv_ratio = Hv / Hk;
  pool.parallel_for(Hv * Dv, 4, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / Dv, dv = r % Dv, kh = h / kv_ratio;
      float* st = ssm + r * Dk;  // [Dk]
      for (int64_t t = 0; t < S; ++t) {
        const float* q = u + t * C + kh * Dk;
        const float* k = u + t * C + key_dim + kh * Dk;
        const float v = u[t * C + 2 * key_dim + h * Dv + dv];
        const float g = decay[t * Hv + h], bt = beta[t * Hv + h];
        for (int64_t i = 0; i < Dk; ++i) st[i] *= g;
        const float delta = bt * (v - simd::dot(st, k, Dk));
        simd::axpy(delta, k, st, Dk);
        y[t * Hv * Dv + h * Dv + dv] = simd::dot(st, q, Dk);
        if (ssm_rows) std::copy(st, st + Dk, ssm_rows + (t * Hv * Dv + r) * Dk);
      }
    }
  });

  // 5. Gated RMSNorm per (row, value head): RMSNorm(o; w) * SiLU(z), w used as stored.
  gated_rms_norm(pool, y, z, norm_w, p.norm_eps, S, Hv, Dv, y);
}

}  // namespace lily::cpu
