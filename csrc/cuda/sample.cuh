// Sampling on the device: the logits row becomes the next token without leaving the GPU (sample.cu: three launches).
// The rule is csrc/core/sampling.h's (one semantics on every backend); here every float32 operation of the processed
// row is rounded once by __fmul_rn / __fadd_rn (never fused).
// Numerics: the weights are float32 here (__expf of a float32 (x - m) * (1/T)), the sums float or double as noted
// at each; the host and the CPU twin take the same exponent in float64. So a draw can differ from the host's only
// where u, or the top-p / min-p threshold, lies within float32 rounding of a step (a few 1e-7 relative).
// The chosen token is written to `token` (the next decode step's input) and recorded in seen/counts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "core/backend.h"

namespace lily::cuda::sample {

constexpr int kThreads = 1024;       // the final block
constexpr int kGridThreads = 256;    // the grid passes
constexpr int kSpan = 2048;          // row entries per grid block (the vocab may be up to kThreads * kSpan)
constexpr int kCandCap = 32768;      // candidates the final block selects from (a list in L2)
constexpr float kCandTau = 1e-5f;    // candidate: weight >= kCandTau relative to the row max

// Options of one generation, resident on the device (written once per generation by the host).
struct Options {
  float inv_temperature = 1.f;  // 1 / T (unused when greedy)
  int32_t greedy = 0;
  int32_t top_k = 0;            // <= 0 or >= V: off
  float top_p = 1.f;            // 1: off
  float min_p = 0.f;            // 0: off
  float repetition_penalty = 1.f;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  int32_t n_bias = 0;           // entries in bias_ids / bias_vals
};
// The device options of one generation's SampleOptions (DeviceSampler::begin's, and the kernel suite's op table's).
Options options_of(const SampleOptions& so);

struct Args {
  const float* logits = nullptr;    // [V] raw logits of the step (left unchanged)
  float* x = nullptr;               // [V] scratch: the processed logits
  float* work = nullptr;            // [workspace_floats(V)] scratch: block partials and candidate lists
  const Options* opt = nullptr;     // device
  const int32_t* bias_ids = nullptr;  // [n_bias] distinct token ids
  const float* bias_vals = nullptr;   // [n_bias]
  uint8_t* seen = nullptr;          // [V] 1: prompt or generated token (repetition penalty); updated
  int32_t* counts = nullptr;        // [V] generated counts (presence / frequency); updated
  const float* uniform = nullptr;   // device scalar in [0, 1): this step's draw
  int32_t* token = nullptr;         // out: device scalar
  int32_t vocab = 0;                // V >= 1
};

size_t workspace_floats(int V);

// Greedy without logit processing, fused into the decode head: *token = the row of the largest key among the head
// launch's per-block maxima amax[n] (gemv's argmax_key; ties -> lowest row). One block, PDL launch. rows > 1: the
// M-row head's keys amax [n, rows] (gemv_rows) -> token[rows], a block each.
void argmax_from_block_keys(cudaStream_t st, const unsigned long long* amax, int n, int32_t* token, int rows = 1);

// Three kernels on the stream (two grid passes, one final block).
void launch(cudaStream_t st, const Args& a);

// The device buffers of one engine's sampler (options, bias, seen, counts, scratch row), sized on first use.
class DeviceSampler {
 public:
  DeviceSampler() = default;
  DeviceSampler(const DeviceSampler&) = delete;
  DeviceSampler& operator=(const DeviceSampler&) = delete;
  ~DeviceSampler();
  // Uploads one generation's options (seen / counts empty: all zero) on the stream; vocab V.
  void begin(cudaStream_t st, const SampleOptions& opt, int32_t V);
  bool ready() const { return ready_; }
  // The device buffers a recorded draw reads (a step graph is keyed by them: begin may reallocate the bias).
  std::vector<uintptr_t> buffers() const {
    return {reinterpret_cast<uintptr_t>(opt_), reinterpret_cast<uintptr_t>(bias_ids_),
            reinterpret_cast<uintptr_t>(bias_vals_), reinterpret_cast<uintptr_t>(seen_),
            reinterpret_cast<uintptr_t>(counts_), reinterpret_cast<uintptr_t>(x_), reinterpret_cast<uintptr_t>(work_)};
  }
  // Draws from logits [V] with *uniform (device) into *token (device).
  void draw(cudaStream_t st, const float* logits, const float* uniform, int32_t* token);

 private:
  bool ready_ = false;
  int32_t V_ = 0, bias_cap_ = 0;
  Options* opt_ = nullptr;
  int32_t* bias_ids_ = nullptr;
  float* bias_vals_ = nullptr;
  uint8_t* seen_ = nullptr;
  int32_t* counts_ = nullptr;
  float* x_ = nullptr;
  float* work_ = nullptr;
};

}  // namespace lily::cuda::sample
