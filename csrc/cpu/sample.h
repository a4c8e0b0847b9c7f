// The device samplers' rule on the host (csrc/cuda/sample.cuh states it; lily.sampling.Sampler, the host sampler,
// is this function step for step: float32 processing, float64 weights, float32 options). The CPU backend uses it
// behind its test switch "device_draw", so the engine's device-mode token loop (run ahead, park, resume) runs in CI
// without a GPU, and it is lily._lily.sample_draw.
#pragma once
#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace lily::cpu {

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

}  // namespace lily::cpu
