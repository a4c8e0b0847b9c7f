#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/linear.h"
#include "cpu/ops.h"

namespace lily::cpu {

void moe_route(const kp::MoeParams& p, const float* logits, int* top_idx, float* top_w) {
  const int E = p.n_experts, k = p.top_k;
  std::vector<float> prob(E);
  for (int64_t s = 0; s < p.S; ++s) {
    const float* l = logits + s * E;
    const float mx = *std::max_element(l, l + E);
    float denom = 0.f;
    for (int e = 0; e < E; ++e) denom += (prob[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) prob[e] /= denom;
    // Selection by repeated argmax: k is small (8), E moderate (256).
    int* idx = top_idx + s * k;
    float* wt = top_w + s * k;
    float chosen_sum = 0.f;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool used = false;
        for (int i = 0; i < j; ++i) used |= idx[i] == e;
        if (!used && (best < 0 || prob[e] > prob[best])) best = e;
      }
      idx[j] = best;
      wt[j] = prob[best];
      chosen_sum += prob[best];
    }
    if (p.norm_topk_prob)
      for (int j = 0; j < k; ++j) wt[j] /= chosen_sum;
  }
}

void moe_forward(ThreadPool& pool, const kp::MoeParams& p, const MoeWeights& w, const float* h, float* out,
                 MoeScratch& sc) {
  const int64_t S = p.S, H = p.hidden, E = p.n_experts, k = p.top_k, I = p.inter, Is = p.shared_inter;
  auto grow = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  grow(sc.logits, S * E);
  grow(sc.top_idx, S * k);
  grow(sc.top_w, S * k);
  grow(sc.rows, S * k);
  grow(sc.row_w, S * k);
  grow(sc.hb, S * H);
  grow(sc.d, S * H);
  grow(sc.g, S * I);
  grow(sc.up, S * I);
  grow(sc.sg, S * Is);
  grow(sc.su, S * Is);
  grow(sc.sig, S);

  // Router (8-bit in the real checkpoint) and routing.
  linear(pool, w.router, h, S, sc.logits.data());
  moe_route(p, sc.logits.data(), sc.top_idx.data(), sc.top_w.data());

  // Shared expert first: it writes every row of out, the routed experts then accumulate.
  linear(pool, w.sh_gate, h, S, sc.sg.data());
  linear(pool, w.sh_up, h, S, sc.su.data());
  for (int64_t i = 0; i < S * Is; ++i) sc.sg[i] = silu(sc.sg[i]) * sc.su[i];
  linear(pool, w.sh_down, sc.sg.data(), S, out);
  linear(pool, w.sh_expert_gate, h, S, sc.sig.data());
  for (int64_t s = 0; s < S; ++s) {
    const float sg = sigmoid(sc.sig[s]);
    for (int64_t i = 0; i < H; ++i) out[s * H + i] *= sg;
  }

  // Group (row, weight) pairs by expert: counting sort keeps rows in ascending order per expert.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < S * k; ++i) ++start[sc.top_idx[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < S * k; ++i) {
    const int64_t pos = fill[sc.top_idx[i]]++;
    sc.rows[pos] = static_cast<int>(i / k);
    sc.row_w[pos] = sc.top_w[i];
  }

  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int* rows = sc.rows.data() + start[e];
    const float* rw = sc.row_w.data() + start[e];
    // One row (always the case in decode) is read in place; more rows are gathered contiguously.
    const float* xin = h + static_cast<int64_t>(rows[0]) * H;
    if (n > 1) {
      for (int64_t i = 0; i < n; ++i) std::memcpy(sc.hb.data() + i * H, h + rows[i] * H, sizeof(float) * H);
      xin = sc.hb.data();
    }
    linear(pool, w.gate.expert(e), xin, n, sc.g.data());
    linear(pool, w.up.expert(e), xin, n, sc.up.data());
    for (int64_t i = 0; i < n * I; ++i) sc.g[i] = silu(sc.g[i]) * sc.up[i];
    linear(pool, w.down.expert(e), sc.g.data(), n, sc.d.data());
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + rows[i] * H;
      const float* d = sc.d.data() + i * H;
      for (int64_t j = 0; j < H; ++j) o[j] += rw[i] * d[j];
    }
  }
}

}  // namespace lily::cpu
