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
  grow(sc.hb, S * k * H);
  grow(sc.d, S * k * H);
  grow(sc.g, S * k * I);
  grow(sc.up, S * k * I);
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

  // The active experts' FFNs as one pool job per stage (gate+up, then down), split into (expert, output tile) items,
  // not one job per expert and matrix: a decode step or a speculative verify touches k to (rows * k) experts, and
  // a pool dispatch per small GEMV dominated them. Each output row is linear_rows' own arithmetic over the expert's
  // n rows, whatever the split, so results are those of per-expert calls bit for bit.
  struct Active {
    int64_t e, n, at;  // expert, its rows, their first slot in the grouped order
  };
  std::vector<Active> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back({e, start[e + 1] - start[e], start[e]});
  for (int64_t pos = 0; pos < S * k; ++pos)  // inputs gathered in the grouped order: [S*k, H]
    std::memcpy(sc.hb.data() + pos * H, h + static_cast<int64_t>(sc.rows[pos]) * H, sizeof(float) * H);
  struct Item {
    const Active* x;
    int64_t r0, r1;  // output rows
  };
  std::vector<Item> items;
  auto stage = [&](int64_t out, int64_t in, auto&& body) {  // body(expert, r0, r1) over (expert, output tile) items
    items.clear();
    for (const Active& x : active) {  // ~32K multiply-adds per item, whole tiles of 4 rows
      const int64_t t = std::max<int64_t>(4, (32768 / std::max<int64_t>(1, in * x.n)) / 4 * 4);
      for (int64_t r0 = 0; r0 < out; r0 += t) items.push_back({&x, r0, std::min(r0 + t, out)});
    }
    pool.parallel_for(static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) body(*items[i].x, items[i].r0, items[i].r1);
    });
  };
  stage(I, H, [&](const Active& x, int64_t r0, int64_t r1) {
    const float* in = sc.hb.data() + x.at * H;
    linear_rows(w.gate.expert(x.e), in, H, x.n, sc.g.data() + x.at * I, I, r0, r1);
    linear_rows(w.up.expert(x.e), in, H, x.n, sc.up.data() + x.at * I, I, r0, r1);
  });
  for (int64_t i = 0; i < S * k * I; ++i) sc.g[i] = silu(sc.g[i]) * sc.up[i];
  stage(H, I, [&](const Active& x, int64_t r0, int64_t r1) {
    linear_rows(w.down.expert(x.e), sc.g.data() + x.at * I, I, x.n, sc.d.data() + x.at * H, H, r0, r1);
  });

  // Combine in ascending expert order per row (as a one-row step adds them).
  for (const Active& x : active)
    for (int64_t i = 0; i < x.n; ++i) {
      float* o = out + static_cast<int64_t>(sc.rows[x.at + i]) * H;
      const float* d = sc.d.data() + (x.at + i) * H;
      const float rw = sc.row_w[x.at + i];
      for (int64_t j = 0; j < H; ++j) o[j] += rw * d[j];
    }
}

}  // namespace lily::cpu
