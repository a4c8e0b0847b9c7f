#include "core/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

namespace lily {
namespace {

// One float32 product, rounded on its own: through a volatile, so the compiler cannot fuse it into the add that
// follows (GCC's default -ffp-contract=fast would, with -march=native's FMA, across statements too). The devices
// and NumPy round the product and the sum apart (CUDA: __fmul_rn / __fadd_rn).
float rounded_product(float a, float b) {
  volatile float p = a * b;
  return p;
}

}  // namespace

SampleOptions sample_options(double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
                             double presence_penalty, double frequency_penalty, std::vector<int32_t> bias_ids,
                             std::vector<float> bias_vals) {
  SampleOptions o;
  o.temperature = static_cast<float>(temperature);
  o.top_k = static_cast<int32_t>(std::clamp<int64_t>(top_k, -1, std::numeric_limits<int32_t>::max()));
  o.top_p = static_cast<float>(top_p);
  o.min_p = static_cast<float>(min_p);
  o.repetition_penalty = static_cast<float>(repetition_penalty);
  o.presence_penalty = static_cast<float>(presence_penalty);
  o.frequency_penalty = static_cast<float>(frequency_penalty);
  o.bias_ids = std::move(bias_ids);
  o.bias_vals = std::move(bias_vals);
  return o;
}

// The rule (sampling.h), as lily.sampling.Sampler takes it step for step: the processed
// row in float32, each operation rounded once (bit-identical to the host's and the devices'); the weights
// exp((x - m) * (1 / T)) in double from the float32 row, max and T, as the host forms them; top-p's target and
// min-p's threshold with the float32 options (what every device receives).
RowWeights sample_weights(const float* logits, int64_t V, const SampleOptions& o, const std::vector<uint8_t>& seen,
                          const std::vector<int32_t>& counts) {
  RowWeights r;
  std::vector<float> x(logits, logits + V);
  for (size_t i = 0; i < o.bias_ids.size(); ++i) x[o.bias_ids[i]] = x[o.bias_ids[i]] + o.bias_vals[i];
  if (o.repetition_penalty != 1.f && !seen.empty())
    for (int64_t i = 0; i < V; ++i)
      if (seen[i]) x[i] = x[i] > 0.f ? x[i] / o.repetition_penalty : x[i] * o.repetition_penalty;
  if ((o.presence_penalty != 0.f || o.frequency_penalty != 0.f) && !counts.empty())
    for (int64_t i = 0; i < V; ++i)
      if (counts[i] != 0) {
        const float pen = rounded_product(o.frequency_penalty, static_cast<float>(counts[i])) + o.presence_penalty;
        x[i] = x[i] - pen;
      }
  // greedy: T = 0, or a T whose float32 reciprocal overflows (the devices' weights are then NaN / 0: their argmax)
  const float inv_t32 = o.temperature > 0.f ? 1.f / o.temperature : std::numeric_limits<float>::infinity();
  if (!std::isfinite(inv_t32)) {
    r.greedy = std::max_element(x.begin(), x.end()) - x.begin();  // lowest index on ties
    return r;
  }
  const float m = *std::max_element(x.begin(), x.end());
  if (m == -std::numeric_limits<float>::infinity()) {  // nothing above -inf: token 0 (the devices' argmax)
    r.greedy = 0;
    return r;
  }
  const double inv_t = 1.0 / static_cast<double>(o.temperature);
  std::vector<double>& w = r.w;
  w.resize(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) {
    double a = static_cast<double>(x[i]) - static_cast<double>(m);
    if (inv_t != 1.0) a *= inv_t;
    w[i] = std::exp(a);
  }
  std::vector<uint8_t> keep(static_cast<size_t>(V), 1);
  if (o.top_k > 0 && o.top_k < V) {  // ties at the k-th value all kept (-0 == +0)
    std::vector<float> s(x);
    std::nth_element(s.begin(), s.begin() + (V - o.top_k), s.end());
    const float kth = s[V - o.top_k];
    for (int64_t i = 0; i < V; ++i) keep[i] = x[i] >= kth;
  }
  if (o.top_p < 1.f) {  // a value stays while the kept mass strictly above it is < top_p of the kept mass
    std::map<float, double, std::greater<float>> mass;  // kept value -> its kept mass, best first
    double total = 0;
    for (int64_t i = 0; i < V; ++i)
      if (keep[i]) mass[x[i]] += w[i], total += w[i];
    const double target = static_cast<double>(o.top_p) * total;
    double above = 0;
    float cut = mass.begin()->first;
    for (const auto& [v, mv] : mass) {
      if (!(above < target)) break;
      cut = v;
      above += mv;
    }
    for (int64_t i = 0; i < V; ++i) keep[i] = keep[i] && x[i] >= cut;
  }
  if (o.min_p > 0.f)
    for (int64_t i = 0; i < V; ++i) keep[i] = keep[i] && w[i] >= static_cast<double>(o.min_p);
  r.last = 0;  // past the end (rounding): the last kept token of positive weight
  for (int64_t i = 0; i < V; ++i) {
    if (!keep[i] || !(w[i] > 0.0)) w[i] = 0.0;
    if (w[i] > 0.0) r.total += w[i], r.last = i;
  }
  return r;
}

int32_t draw_weighted(const std::vector<double>& w, double total, int64_t last, float uniform) {
  const double target = static_cast<double>(uniform) * total;
  double cum = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (!(w[i] > 0.0)) continue;
    cum += w[i];
    if (cum > target) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

int32_t draw(const RowWeights& r, float uniform) {
  return r.greedy >= 0 ? static_cast<int32_t>(r.greedy) : draw_weighted(r.w, r.total, r.last, uniform);
}

int32_t sample_draw(const float* logits, int64_t V, const SampleOptions& o, std::vector<uint8_t>& seen,
                    std::vector<int32_t>& counts, float uniform) {
  if (seen.empty()) seen.assign(static_cast<size_t>(V), 0);
  if (counts.empty()) counts.assign(static_cast<size_t>(V), 0);
  const int32_t tok = draw(sample_weights(logits, V, o, seen, counts), uniform);
  seen[tok] = 1;
  counts[tok] += 1;
  return tok;
}

}  // namespace lily
