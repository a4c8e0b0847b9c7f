// The engine: validates requests, owns weights views and the backend, and runs the layer loop
// (x += mixer(norm(x)); x += moe(norm(x))) over prefill chunks of bounded size.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <map>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/config.h"
#include "core/state.h"
#include "core/weights.h"

namespace lily {

enum class LogitsMode { None, Last, All };

// Residual stream x [S, H] after each named sub-block ("embed", "mixer.L", "moe.L"), rows appended per
// chunk: lets tests compare every sub-block with lily.reference on the same inputs (style rule 8).
using Trace = std::map<std::string, std::vector<float>>;

// Parses "none" | "last" | "all"; throws std::invalid_argument otherwise.
LogitsMode parse_logits_mode(const std::string& s);

class Engine {
 public:
  static constexpr int64_t kDefaultChunkCpu = 256;

  // tensors: views that must outlive the engine (the binding keeps the arrays alive).
  // backend: "cpu" | "cuda" (see make_backend).
  Engine(const Config& cfg, const TensorMap& tensors, const QuantMap& quant, int threads, int64_t max_context,
         bool debug = false, const std::string& backend = "cpu");

  std::unique_ptr<State> new_state() const {
    return std::make_unique<State>(cfg_, max_context_, backend_->memory(), backend_->kv_elem());
  }

  // Throws std::invalid_argument naming the problem (empty, token out of range, context overflow).
  void validate(const State& st, const int32_t* tokens, int64_t S) const;

  // Runs S tokens (prefill in chunks of chunk_size rows, 0 = backend default; S == 1 is a decode step)
  // and advances st.position by S. logits: [rows(mode, S), V] with rows 0 / 1 / S for none / last / all.
  void forward(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size, float* logits,
               Trace* trace = nullptr);

  // Greedy decoding: n_steps tokens; out[i] = argmax (lowest index on ties) of the logits after feeding
  // token (i = 0) or out[i-1]; advances st.position by n_steps. On the device where the backend has a fast
  // path (no logits cross to the host), else a loop of forward steps.
  void decode_greedy(State& st, int32_t token, int64_t n_steps, int32_t* out);

  // Sampling on the device (backends that have it; see Backend::sampler_begin). sampler_begin validates the
  // options (std::invalid_argument naming the bad one) and returns an id for this generation, or 0 when the
  // backend has no device sampler. decode_sample runs `token` at st.position, advances st.position by 1 and
  // returns the next token drawn on the device with `uniform`; it returns -1 without running anything when
  // `id` is no longer the engine's current sampler (another generation began since: begin again with the
  // host's counts). decode_logits copies the logits [V] of st's last decode_sample step; false when the device no longer
  // holds them (another step ran since, on any state) or the backend has none.
  int64_t sampler_begin(const SampleOptions& opt);
  int32_t decode_sample(State& st, int32_t token, float uniform, int64_t id);
  bool decode_logits(const State& st, float* logits);

  // Backend switches (ablations) and counters; std::invalid_argument for a name the backend does not know.
  void set_backend_flag(const std::string& name, int64_t value);
  int64_t backend_flag(const std::string& name);

  static int64_t logits_rows(LogitsMode mode, int64_t S) {
    return mode == LogitsMode::All ? S : mode == LogitsMode::Last ? 1 : 0;
  }

  const Config& config() const { return cfg_; }
  int64_t max_context() const { return max_context_; }
  const char* backend_name() const { return backend_->name(); }
  int64_t default_chunk() const { return backend_->default_chunk(); }
  int threads() const { return backend_->threads(); }
  bool debug() const { return debug_; }

 private:
  void forward_locked(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size,
                      float* logits, Trace* trace);

  Config cfg_;
  Weights weights_;
  int64_t max_context_;
  bool debug_;
  std::unique_ptr<Backend> backend_;
  int64_t sampler_id_ = 0;     // current device sampler (0: none)
  const State* sampled_state_ = nullptr;  // the state of the last decode_sample (its logits are on the device)
  int64_t sampled_position_ = -1;
  int64_t sampler_issued_ = 0;
  std::mutex mu_;  // one forward at a time: backend buffers are shared
};

}  // namespace lily
