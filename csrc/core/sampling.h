// Sampling: one rule on every backend, and its host implementation (the CPU backend's draws, the speculative
// loop's and batched streams' draws in the extension, lily._lily.sample_draw). lily.sampling.Sampler, the Python
// host sampler, follows it step for step; the CUDA and Metal device samplers (csrc/cuda/sample.cuh,
// metal/sample.metal) implement it on the device.
//
// The rule:
//   options as SampleOptions holds them: float32 (top_p = 0.9 is 0.89999998; a top_p that rounds to 1 is off);
//   x = logits + logit_bias; repetition penalty on tokens marked `seen` (x/rp if x > 0 else x*rp);
//   x -= frequency * count + presence * (count > 0) on generated tokens; every one of these a float32 operation
//   rounded once (the penalty's product and sum never fused), so the processed row and every tie at a cut are
//   bit-identical on every backend.
//   greedy (temperature 0): argmax x, lowest index on ties. A T whose float 1/T overflows (T < 2.9e-39) gives NaN
//   weights at the max and 0 elsewhere, which every path below counts as no weight: the argmax again.
//   else w = exp((x - max x) / T) (max over the processed row, NaN ignored; w = 1 at the max); kept = top-k by x
//   (ties at the k-th value all kept, -0 == +0), then top-p on the kept (a value stays while the kept mass
//   strictly above it is < top_p * the kept mass; ties kept; the largest value always), then min-p (w >= min_p);
//   the token is the first index i (vocab order) whose inclusive cumulative kept weight exceeds u * total; past
//   the end (rounding), the last kept token of positive weight.
//   u is the step's uniform number: step j of a stream opened with seed s takes number j of s's splitmix64
//   sequence, 24 bits (TokenStream::next_uniform, lily.sampling.stream_uniform); a session draws its first token
//   on the host (number 0 of its seed) and opens the stream with seed + 1 (Sampler.stream_seed), so step j is the
//   host's draw j + 1.
// Numerics here: float32 processing, float64 weights, float32 options. The GPUs' weights are float32 (their
// notes), so a device draw can differ from this one only where u, or a top-p / min-p threshold, lies within
// float32 rounding of a step (a few 1e-7 relative).
#pragma once
#include <cstdint>
#include <vector>

namespace lily {

// Options of one generation (the rule above).
struct SampleOptions {
  float temperature = 1.f;  // 0: greedy
  int32_t top_k = 0;        // <= 0: off
  float top_p = 1.f;
  float min_p = 0.f;
  float repetition_penalty = 1.f;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  std::vector<int32_t> bias_ids;   // distinct ids < V
  std::vector<float> bias_vals;    // same length
  std::vector<uint8_t> seen;       // [V] or empty: tokens already in the context (repetition penalty)
  std::vector<int32_t> counts;     // [V] or empty: times each token was generated (presence / frequency)
};

// The rule's greedy test (T = 0), and 1 / T in float32 as the device samplers take it (1 when greedy).
inline bool is_greedy(const SampleOptions& o) { return o.temperature == 0.f; }
inline float inverse_temperature(const SampleOptions& o) { return is_greedy(o) ? 1.f : 1.f / o.temperature; }

// The options from an API's float64 / int64 values, each rounded to float32 once (top_k clamped to int32); every
// binding builds them here. seen / counts stay empty.
SampleOptions sample_options(double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
                             double presence_penalty, double frequency_penalty, std::vector<int32_t> bias_ids,
                             std::vector<float> bias_vals);

// The processed row of logits [V] under the rule: greedy (T = 0): the token it picks (lowest index on ties), w
// empty; else w [V] the kept tokens' weights (0 for a token not kept), their total, and the last kept token (the
// draw's answer past the end by rounding). seen / counts [V] (empty = all zero) are read for the penalties.
struct RowWeights {
  int64_t greedy = -1;
  std::vector<double> w;
  double total = 0;
  int64_t last = 0;
};
RowWeights sample_weights(const float* logits, int64_t V, const SampleOptions& opt, const std::vector<uint8_t>& seen,
                          const std::vector<int32_t>& counts);
// The token the rule draws with `uniform` in [0, 1): greedy's pick, or the first token whose cumulative weight
// (in vocabulary order) exceeds uniform * total. draw_weighted: the same walk over any weights [V].
int32_t draw(const RowWeights& r, float uniform);
int32_t draw_weighted(const std::vector<double>& w, double total, int64_t last, float uniform);

// The token drawn from logits [V] with `uniform` in [0, 1); seen [V] / counts [V] (as SampleOptions: empty =
// all zero) are read for the penalties and then record the drawn token.
int32_t sample_draw(const float* logits, int64_t V, const SampleOptions& opt, std::vector<uint8_t>& seen,
                    std::vector<int32_t>& counts, float uniform);

}  // namespace lily
