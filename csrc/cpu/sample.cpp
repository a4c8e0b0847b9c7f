#include "cpu/sample.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace lily::cpu {

int32_t sample_draw(const float* logits, int64_t V, const SampleOptions& o, std::vector<uint8_t>& seen,
                    std::vector<int32_t>& counts, float uniform) {
  if (seen.empty()) seen.assign(static_cast<size_t>(V), 0);
  if (counts.empty()) counts.assign(static_cast<size_t>(V), 0);
  std::vector<double> x(logits, logits + V);
  for (size_t i = 0; i < o.bias_ids.size(); ++i) x[o.bias_ids[i]] += o.bias_vals[i];
  if (o.repetition_penalty != 1.f)
    for (int64_t i = 0; i < V; ++i)
      if (seen[i]) x[i] = x[i] > 0 ? x[i] / o.repetition_penalty : x[i] * o.repetition_penalty;
  if (o.presence_penalty != 0.f || o.frequency_penalty != 0.f)
    for (int64_t i = 0; i < V; ++i)
      if (counts[i] > 0) x[i] -= static_cast<double>(o.frequency_penalty) * counts[i] + o.presence_penalty;
  int64_t tok = 0;
  if (o.temperature == 0.f) {
    tok = std::max_element(x.begin(), x.end()) - x.begin();  // lowest index on ties
  } else {
    const double m = *std::max_element(x.begin(), x.end());
    std::vector<double> w(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) w[i] = std::exp((x[i] - m) / o.temperature);
    std::vector<uint8_t> keep(static_cast<size_t>(V), 1);
    if (o.top_k > 0 && o.top_k < V) {  // ties at the k-th value all kept
      std::vector<double> s(x);
      std::nth_element(s.begin(), s.begin() + (V - o.top_k), s.end());
      const double kth = s[V - o.top_k];
      for (int64_t i = 0; i < V; ++i) keep[i] = x[i] >= kth;
    }
    if (o.top_p < 1.f) {  // a value stays while the kept mass strictly above it is < top_p of the kept mass
      std::map<double, double, std::greater<double>> mass;  // kept value -> its kept mass, best first
      double total = 0;
      for (int64_t i = 0; i < V; ++i)
        if (keep[i]) mass[x[i]] += w[i], total += w[i];
      double above = 0, cut = mass.begin()->first;
      for (const auto& [v, mv] : mass) {
        if (!(above < o.top_p * total)) break;
        cut = v;
        above += mv;
      }
      for (int64_t i = 0; i < V; ++i) keep[i] = keep[i] && x[i] >= cut;
    }
    if (o.min_p > 0.f)
      for (int64_t i = 0; i < V; ++i) keep[i] = keep[i] && w[i] >= o.min_p;
    double total = 0;
    int64_t last = 0;
    for (int64_t i = 0; i < V; ++i)
      if (keep[i]) total += w[i], last = i;
    const double target = static_cast<double>(uniform) * total;
    double cum = 0;
    tok = last;
    for (int64_t i = 0; i < V; ++i) {
      if (!keep[i]) continue;
      cum += w[i];
      if (cum > target) {
        tok = i;
        break;
      }
    }
  }
  seen[tok] = 1;
  counts[tok] += 1;
  return static_cast<int32_t>(tok);
}

}  // namespace lily::cpu
