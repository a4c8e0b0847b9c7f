// The narrow Backend interface, at sub-block granularity. The engine's layer loop is written once
// against it; each backend fuses its own kernel chains inside a sub-block. The residual stream
// x [S, H] lives in the backend (device memory on GPU backends); only logits cross to the host.
// Every entry point takes S rows; decode is S == 1 and may take a specialised path.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/memory.h"
#include "core/state.h"
#include "core/weights.h"

namespace lily {

// Options of one generation for a device sampler (the semantics: csrc/cuda/sample.cuh).
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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int threads() const = 0;
  // Where State arrays live, and the KV cache element type (fp32 on CPU, bf16 on GPUs).
  virtual std::shared_ptr<Memory> memory() const = 0;
  virtual Elem kv_elem() const = 0;
  // Prefill chunk rows when the caller passes 0: bounds temporary memory.
  virtual int64_t default_chunk() const = 0;
  // Waits until all queued work is done (GPU backends queue asynchronously); called at the end of forward.
  virtual void sync() {}

  // x[S, H] = E[ids[S]]; starts a chunk of S rows.
  virtual void embed(const int32_t* ids, int64_t S) = 0;
  // x += DeltaNet(RMSNorm(x; in_norm)); advances st (conv + recurrent state) by S rows.
  virtual void deltanet_block(int layer, DeltaNetState& st, int64_t S) = 0;
  // x += Attention(RMSNorm(x; in_norm)) for positions pos0..pos0+S-1; writes those rows of kv.
  virtual void attention_block(int layer, KVCache& kv, int64_t pos0, int64_t S) = 0;
  // x += MoE(RMSNorm(x; post_norm)).
  virtual void moe_block(int layer, int64_t S) = 0;
  // out[S, H] (host) = the residual stream x; used to trace named intermediates in tests.
  virtual void read_residual(int64_t S, float* out) = 0;
  // logits[n, V] (host) = RMSNorm(x[row0 : row0+n]; final_norm) W_lm^T.
  virtual void head(int64_t row0, int64_t n, float* logits) = 0;

  // Optional decode fast path for one token at st.position (st already reserved for position + 1): the whole
  // step in the backend's own fused form; logits [V] to the host when logits != nullptr. Does not advance
  // st.position. Returns false when the backend has none (the engine then runs the sub-block loop).
  virtual bool decode_step(State& st, int32_t token, float* logits) { return false; }
  // Optional greedy decoding on the device: n steps from `token` (st reserved for position + n); out[i] is the
  // argmax (lowest index on ties) of the logits after step i and the input of step i + 1. Does not advance
  // st.position. Returns false when the backend has none.
  virtual bool decode_greedy(State& st, int32_t token, int64_t n, int32_t* out) { return false; }
  // Optional sampling on the device. sampler_begin: options of a new generation (generated-token counts start
  // at zero); false when the backend has no device sampler. decode_sample: one decode step of `token` at
  // st.position (st reserved for position + 1), then the next token drawn on the device with `uniform` in
  // [0, 1) into *next; does not advance st.position; false when unsupported or no sampler_begin happened.
  // decode_logits: the logits row [V] of the last decode step, to the host (false when none is held).
  virtual bool sampler_begin(const SampleOptions& opt) { return false; }
  virtual bool decode_sample(State& st, int32_t token, float uniform, int32_t* next) { return false; }
  virtual bool decode_logits(float* logits) { return false; }
  // Named switches for ablations and counters for reports; std::invalid_argument for an unknown name.
  virtual void set_flag(const std::string& flag_name, int64_t value) {
    throw std::invalid_argument(std::string("[lily] backend '") + name() + "' has no flag '" + flag_name + "'");
  }
  virtual int64_t flag(const std::string& flag_name) const {
    throw std::invalid_argument(std::string("[lily] backend '") + name() + "' has no flag '" + flag_name + "'");
  }
};

// debug: poison every scratch buffer with NaN at the start of each chunk.
std::unique_ptr<Backend> make_cpu_backend(const Config& cfg, const Weights& w, int threads, bool debug);
// Throws std::runtime_error("[lily] backend 'cuda': no CUDA device ...") when no device is visible.
std::unique_ptr<Backend> make_cuda_backend(const Config& cfg, const Weights& w, bool debug);

// The one dispatch point: "cpu" | "cuda". Throws std::invalid_argument for an unknown name and
// std::runtime_error for a backend not compiled into this build or with no device.
std::unique_ptr<Backend> make_backend(const std::string& name, const Config& cfg, const Weights& w, int threads,
                                      bool debug);

// SIMD features the CPU backend was compiled with, e.g. "avx2 fma avx512f".
std::string cpu_simd_features();

}  // namespace lily
