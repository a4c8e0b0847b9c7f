// The narrow Backend interface, at sub-block granularity. The engine's layer loop is written once
// against it; each backend fuses its own kernel chains inside a sub-block. The residual stream
// x [S, H] lives in the backend (device memory on GPU backends); only logits cross to the host.
// Every entry point takes S rows; decode is S == 1 (the backend's fused decode kernels), bracketed as a step.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/memory.h"
#include "core/sampling.h"
#include "core/state.h"
#include "core/weights.h"

namespace lily {

// One decode step: one token through the model, bracketed by Backend::begin_step / end_step.
struct DecodeStep {
  int64_t index = 0;      // the engine's step count (every stream's steps, in order); index & 1 picks device slots
  int32_t token = -1;     // the token fed: >= 0 given by the host; -1: the token step index - 1 drew on the device
  int64_t position = 0;   // position of that token (st.position before the step)
  bool draw = false;      // the device draws the next token (sampler_begin's options), else logits go to the host
  float uniform = 0.f;    // the draw's uniform number in [0, 1)
};

// The rows of a chunk by token stream: rows [row0, row0 + n) of x belong to one stream and run at positions pos0 ..
// pos0 + n - 1 with that stream's state of the layer: its DeltaNet state (DeltaNet layers) or its KV cache
// (attention layers, the MTP head's included). One segment: a prefill chunk, a decode step, a verify; several:
// streams decoded together (Engine::step_streams), each row as its stream alone computes it.
struct RowSegment {
  int64_t row0 = 0, n = 0, pos0 = 0;
  DeltaNetState* deltanet = nullptr;
  KVCache* kv = nullptr;
};
using RowSegments = std::vector<RowSegment>;

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

  // ---- sub-blocks: the engine's layer loop (core/engine.cpp) calls these for S rows -------------------------
  // With S == 1 a backend runs its fused decode kernels. x [S, H] is the residual stream, held by the backend.
  // x[S, H] = E[ids[S]]; starts a chunk of S rows.
  virtual void embed(const int32_t* ids, int64_t S) = 0;
  // x += DeltaNet(RMSNorm(x; in_norm)) for the segments' rows (all of x's rows, in order); advances each segment's
  // DeltaNet state (conv + recurrent) by its rows.
  virtual void deltanet_block(int layer, const RowSegments& segs) = 0;
  // x += Attention(RMSNorm(x; in_norm)), each segment's rows over its own KV cache (rows pos0 .. pos0 + n - 1 are
  // written there, then attended causally).
  virtual void attention_block(int layer, const RowSegments& segs) = 0;
  // Whether deltanet_block / attention_block take several segments (else Engine::step_streams steps the streams
  // one by one). A backend that does computes each segment's rows exactly as that segment alone would, with
  // exact_rows on (the rows of the projections, the MoE and the head as one-row steps make them).
  virtual bool batches_streams() const { return false; }
  // x += MoE(RMSNorm(x; post_norm)).
  virtual void moe_block(int layer, int64_t S) = 0;
  // out[S, H] (host) = the residual stream x; used to trace named intermediates in tests.
  virtual void read_residual(int64_t S, float* out) = 0;
  // logits[n, V] (host) = RMSNorm(x[row0 : row0+n]; final_norm) W_lm^T.
  virtual void head(int64_t row0, int64_t n, float* logits) = 0;

  // ---- the MTP head (docs/model.md §7): only called when has_mtp() -------------------------------------------
  // Its decoder layer is Weights::layers[cfg.n_layers] (an attention layer: attention_block / moe_block take that
  // index, with the State's mtp KV cache), its fc and norms are Weights::mtp. A chunk of the head's rows:
  // mtp_embed -> attention_block(n_layers) -> moe_block(n_layers) [-> mtp_head]; it overwrites x, so the engine
  // runs it after the main rows' head / head_step and keep_hidden.
  virtual bool has_mtp() const { return false; }
  // hid[S, H] = RMSNorm(x; final_norm) of the rows just run (the head's input), kept until the next keep_hidden.
  virtual void keep_hidden(int64_t S) { no_mtp(); }
  // dst [H] fp32 (a State buffer, in this backend's memory) = hid[row].
  virtual void store_hidden(int64_t row, Buffer& dst) { no_mtp(); }
  // Starts n rows of the head: x[n, H] = fc([RMSNorm(E[ids]; pre_fc_norm_embedding) | RMSNorm(h; pre_fc_norm_hidden)])
  // (embedding first). The hidden rows h: src Kept: *prev (when given) then hid[0 ..] (n rows in all); src Draft:
  // n == 1, prev null, the last row mtp_head kept (a chained draft). ids[i] == -1 (inside a decode step of a device
  // sampler): the token that step's embed read.
  enum class MtpHidden { Kept, Draft };
  virtual void mtp_embed(const int32_t* ids, int64_t n, const Buffer* prev, MtpHidden src) { no_mtp(); }
  // Streams decoded together: n head rows at once, row i pairing E[ids[i]] with *prev[i] (each stream's last hidden
  // state); false when the backend does not (the engine then runs each stream's head row alone).
  virtual bool mtp_embed_each(const int32_t* ids, int64_t n, const std::vector<const Buffer*>& prev) {
    return false;
  }
  // out[n, H] = RMSNorm(x[row0 : row0+n]; mtp.norm), kept (its last row is the next Draft hidden); logits [n, V]
  // (host) = out W_lm^T.
  virtual void mtp_head(int64_t row0, int64_t n, float* logits) { no_mtp(); }
  // on: an S-row forward computes every row as a one-row decode step would, bit for bit where the backend can
  // (the speculative verify, so that it decides exactly what plain decoding would). Default: no-op.
  virtual void exact_rows(bool on) {}
  // The speculative verify's roll-back: with keep_state_rows(true) an S-row forward also keeps every DeltaNet
  // layer's state after each row, and take_state_row(st, row) makes st's DeltaNet states the ones after `row` of
  // that forward. A backend without it (keeps_state_rows() false) has the engine copy the states before the verify
  // and run the kept rows again.
  virtual bool keeps_state_rows() const { return false; }
  virtual void keep_state_rows(bool on) {}
  virtual void take_state_row(State& st, int64_t row) {
    throw std::logic_error(std::string("[lily] backend '") + name() + "' keeps no DeltaNet state rows");
  }

  // ---- decode steps: the engine brackets every one-token step ---------------------------------------------
  // begin_step(st, d) -> [embed(&d.token, 1), the layer loop for 1 row, head_step(d)] -> end_step(st, d, logits).
  // begin_step returns false when the backend replays a step it recorded earlier (a CUDA graph): the engine then
  // issues nothing between the brackets. st is reserved for d.position + 1; the engine advances st.position.
  // With d.token == -1 the step's embed reads the token step d.index - 1 drew (backends with a device sampler).
  virtual bool begin_step(State& st, const DecodeStep& d) { return true; }
  // The step's logits row [V], kept by the backend (device slot d.index & 1); with d.draw, then the next token
  // drawn from it on the device (see sampler_begin), kept for drawn_token(d.index) and as step d.index + 1's input.
  virtual void head_step(const DecodeStep& d) = 0;
  // Ends (CUDA: launches) the step. logits != nullptr: the row [V] to the host, synchronously. Without logits a
  // device backend may return before the step ran: drawn_token waits for it.
  virtual void end_step(State& st, const DecodeStep& d, float* logits) = 0;

  // The sub-blocks the engine issued since the last chunk start or begin_step threw: drop what is half recorded or
  // half encoded (a CUDA capture, a Metal command buffer), so nothing of it runs later against freed buffers.
  virtual void abandon() {}

  // Device draws (the token loop's device mode). sampler_begin: the options of a new generation (seen / counts
  // as the host knows them); false when the backend cannot draw with them (the engine then runs lock-step: each
  // step's logits go to the host, which draws). drawn_token: the token step `index` drew, waiting for that step
  // (only the last two steps are held). step_logits: the logits row [V] of step `index` to the host; false when the
  // backend no longer holds it.
  virtual bool sampler_begin(const SampleOptions& opt) { return false; }
  virtual int32_t drawn_token(int64_t index) {
    throw std::logic_error(std::string("[lily] backend '") + name() + "' has no device sampler");
  }
  virtual bool step_logits(int64_t index, float* logits) { return false; }

  // Named switches for ablations (set, and read back); std::invalid_argument for an unknown name.
  virtual void set_flag(const std::string& flag_name, int64_t value) {
    throw std::invalid_argument(std::string("[lily] backend '") + name() + "' has no flag '" + flag_name + "'");
  }
  virtual int64_t flag(const std::string& flag_name) const {
    throw std::invalid_argument(std::string("[lily] backend '") + name() + "' has no flag '" + flag_name + "'");
  }
  // Counters for reports and tests (read only): name -> value since the backend was made.
  virtual std::map<std::string, int64_t> counters() const { return {}; }

 protected:
  // The rows the segments cover (std::logic_error unless they cover rows 0.. in order).
  static int64_t segment_rows(const RowSegments& segs) {
    int64_t n = 0;
    for (const RowSegment& g : segs) {
      if (g.row0 != n) throw std::logic_error("[lily] backend: segments must cover the rows in order");
      n += g.n;
    }
    return n;
  }
  // The one segment of a backend that runs one stream per forward (std::logic_error for several).
  const RowSegment& single_segment(const RowSegments& segs) const {
    if (segs.size() != 1 || segs[0].row0 != 0)
      throw std::logic_error(std::string("[lily] backend '") + name() + "' runs one stream's rows per forward, got " +
                             std::to_string(segs.size()) + " segments");
    return segs[0];
  }

 private:
  [[noreturn]] void no_mtp() const {
    throw std::logic_error(std::string("[lily] backend '") + name() + "' has no MTP head kernels");
  }
};

// debug: poison every scratch buffer with NaN at the start of each chunk.
std::unique_ptr<Backend> make_cpu_backend(const Config& cfg, const Weights& w, int threads, bool debug);
// Throws std::runtime_error("[lily] backend 'cuda': no CUDA device ...") when no device is visible.
std::unique_ptr<Backend> make_cuda_backend(const Config& cfg, const Weights& w, bool debug);

// Backend-specific construction options by name (e.g. the emulated Metal device's kernel libraries); a backend
// throws std::invalid_argument for a name it does not know.
using BackendOptions = std::map<std::string, std::string>;

// The one dispatch point: "cpu" | "cuda" | "metal". Throws std::invalid_argument for an unknown name and
// std::runtime_error for a backend not compiled into this build or with no device.
std::unique_ptr<Backend> make_backend(const std::string& name, const Config& cfg, const Weights& w, int threads,
                                      bool debug, const BackendOptions& options = {});

// SIMD features the CPU backend was compiled with, e.g. "avx2 fma avx512f".
std::string cpu_simd_features();

}  // namespace lily
