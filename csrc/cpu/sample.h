// The device samplers' rule on the host (csrc/cuda/sample.cuh states it; lily.sampling.Sampler, the host sampler,
// is this function step for step: float32 processing, float64 weights, float32 options). The CPU backend uses it
// behind its test switch "device_draw", so the engine's device-mode token loop (run ahead, park, resume) runs in CI
// without a GPU, and it is lily._lily.sample_draw.
#pragma once
#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace lily::cpu {

// The token drawn from logits [V] with `uniform` in [0, 1); seen [V] / counts [V] (as SampleOptions: empty =
// all zero) are read for the penalties and then record the drawn token.
int32_t sample_draw(const float* logits, int64_t V, const SampleOptions& opt, std::vector<uint8_t>& seen,
                    std::vector<int32_t>& counts, float uniform);

}  // namespace lily::cpu
