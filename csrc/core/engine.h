// The engine: validates requests, owns weights views and the backend, and runs the layer loop
// (x += mixer(norm(x)); x += moe(norm(x))) over prefill chunks of bounded size.
#pragma once
#include <cstdint>
#include <functional>
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

// Options of one token stream (Engine::open_stream).
struct StreamOptions {
  int64_t max_tokens = 1;            // tokens next() returns at most (>= 1)
  std::vector<int32_t> stop_ids;     // a drawn stop id is returned and ends the stream
  bool device = true;                // draw on the device where the backend can, else in the extension; false:
                                     // lock-step (the host draws from each step's logits)
  bool batch = false;                // stepped with other streams (Engine::step_streams): with device, draw in
                                     // the extension even where the backend could on the device
  SampleOptions sample;              // the device draw; temperature 0 = greedy (lowest index on ties)
  uint64_t seed = 0;                 // the device draws' uniform numbers come from this seed
  // Speculative decoding with the MTP head (csrc/core/speculative.cpp): draft `speculative` tokens per step (0 =
  // off; needs Engine::has_mtp and a state whose head cache is current) and verify them in one forward; the
  // stream then draws on the host in the extension (core/sampling.h's rule), its output the same as plain decoding's
  // (greedy: token for token; sampling: the same distribution). adaptive: fall back to plain steps when drafting
  // does not pay (timed against plain steps over windows of verifies, across the engine's streams), saying so in
  // spec_stats().status; then new streams begin plain and every kRetryEvery-th drafts again (Engine::SpecHistory).
  int32_t speculative = 0;
  bool adaptive = true;
};

class Engine;

// One generation's token loop over one State, inside the extension (docs/engine_contract.md). The stream feeds
// `first` (the last token sampled, at st.position) and every token it returns.
//
// Device mode (the backend draws): next() launches the step that feeds the token it is about to return before
// waiting for the step that drew it, so the device runs one step ahead of the host and never waits for it. That
// step only ever feeds a token the host will accept (every returned token is part of the text; a stop id or a stop
// string ends the stream *after* its token), so the state never has to step back: after close() it holds
// `first` and every returned token, except that the last one stays unfed when max_tokens or the context ended the
// stream (fed() says how many tokens ran). Another engine call (a forward, another stream) parks the stream first:
// its launched steps finish and their tokens wait on the host; the stream resumes from them.
//
// Lock-step mode (a backend without a device sampler, or a host-side mask): step(token, logits) runs one token and
// returns its logits row; the host draws the next token.
class TokenStream {
 public:
  ~TokenStream();
  TokenStream(const TokenStream&) = delete;
  TokenStream& operator=(const TokenStream&) = delete;

  bool device() const { return device_; }
  // next() draws the tokens: on the device (device()), or in the extension on the host (the speculative loop, or a
  // plain stream of a backend without a device sampler: the same rule, core/sampling.h, with the same uniform numbers).
  bool draws() const { return device_ || spec_ != nullptr; }
  bool speculative() const;  // drafts with the MTP head (a speculative stream that fell back to plain steps too)
  // Device mode: the next token, or -1 when the stream has ended (max_tokens returned, a stop id returned, the
  // context full, or close() called).
  int32_t next();
  // Lock-step mode: runs `token` at st.position (one step) and writes its logits [V].
  void step(int32_t token, float* logits);
  // Waits for the launched steps and ends the stream (idempotent). logits != nullptr: the logits row [V] after the
  // last fed token, when one is held (returns false otherwise).
  bool close(float* logits = nullptr);
  // Tokens run through the model by this stream (first included); returned: tokens next() returned.
  int64_t fed() const { return launched_; }
  int64_t returned() const { return returned_; }
  bool ended() const { return ended_; }
  // Speculative streams: drafts made, drafts accepted, verify forwards, plain steps, and what the stream does
  // ("speculative k=3", or "plain: <why>" after a fallback).
  struct SpecStats {
    int64_t drafted = 0, accepted = 0, verifies = 0, plain_steps = 0;
    std::string status;
  };
  SpecStats spec_stats() const;

 private:
  friend class Engine;
  struct Spec;  // the speculative loop's state (speculative.cpp)
  TokenStream(Engine& eng, State& st, int32_t first, const StreamOptions& opt, bool device, bool extension);
  void launch(int32_t host_token);  // the step that feeds the next token (host_token >= 0, or the device slot)
  void park();                      // engine lock held: finish the launched steps, keep their draws on the host
  void note(int32_t token);         // host record of the generated tokens (seen / counts for a re-begin)
  float next_uniform();
  // speculative.cpp, engine lock held: the next returned token (-1: ended); one draft + verify (or plain) step
  // when nothing is queued; close's rewind of the fed tokens the host never took.
  int32_t spec_next();
  void spec_iterate();
  void spec_plain_step();
  void spec_rewind();
  void spec_begin(bool head_current);  // the constructor's part: the Spec, and whether it drafts from the start
  // A verify's pieces, run by spec_iterate alone and by Engine::step_streams beside other streams' rows (the forward
  // between them: Engine::decode_rows). spec_draft: the rewind point and k drafts into Spec::rows = [t, d_1 .. d_k]
  // (returns k; 0 when it cannot draft now: a plain step instead). spec_accept: the draws from the verify's logits
  // [k + 1, V] (returns a, the drafts kept). spec_roll_back: the state after [t, d_1 .. d_a] (true: restored to the
  // rewind point, the caller runs those a + 1 rows again). spec_commit: the tokens queued, stats, the adaptive rule
  // (seconds: what this verify cost).
  int64_t spec_draft();
  int64_t spec_accept(const float* logits);
  bool spec_roll_back(int64_t a, bool rows_kept);
  void spec_commit(int64_t a, double seconds);
  void restore_deltanet();  // the rewind point's DeltaNet states into st_
  // Engine::step_streams, engine lock held. row_offer: Plain when this stream's next token is one plain step away
  // (drawn in the extension, nothing queued, still going), Drafting when it would be but drafts with speculative
  // auto (stop_drafting_to_join makes it plain), Verify when it drafts with an explicit k (its verify rows join the
  // forward). take_row_draw: that step's draw from its logits row [V] (the state now at `position`), queued for
  // next().
  enum class RowOffer { None, Plain, Drafting, Verify };
  RowOffer row_offer() const;
  void stop_drafting_to_join();
  int32_t spec_pending() const;
  void take_row_draw(const float* logits, int64_t position);

  Engine& eng_;
  State& st_;
  StreamOptions opt_;
  bool device_;
  bool ended_ = false, closed_ = false;
  bool parked_ = false;            // the device slot no longer holds this stream's next token
  int32_t parked_token_ = -1;      // parked: the token the last launched step drew
  int64_t launched_ = 0;           // steps launched = tokens fed
  int64_t last_step_ = -1;         // the engine's index of the last step launched
  int64_t returned_ = 0;
  uint64_t rng_;
  std::unique_ptr<Spec> spec_;
};

class Engine {
 public:
  static constexpr int32_t kMaxDrafts = 8;  // StreamOptions::speculative at most

  // tensors: views that must outlive the engine (the binding keeps the arrays alive).
  // backend: "cpu" | "cuda" | "metal" (see make_backend).
  Engine(const Config& cfg, const TensorMap& tensors, const QuantMap& quant, int threads, int64_t max_context,
         bool debug = false, const std::string& backend = "cpu", const BackendOptions& options = {});
  ~Engine();

  std::unique_ptr<State> new_state() const {
    return std::make_unique<State>(cfg_, max_context_, backend_->memory(), backend_->kv_elem(), mtp_);
  }
  // The engine runs the MTP head (the weights carry it and the backend has its kernels): every forward and step
  // keeps the states' head caches current, and streams can draft with it.
  bool has_mtp() const { return mtp_; }

  // Throws std::invalid_argument naming the problem (empty, token out of range, context overflow).
  void validate(const State& st, const int32_t* tokens, int64_t S) const;

  // Runs S tokens (prefill in chunks of chunk_size rows, 0 = backend default; S == 1 without a trace is a decode
  // step) and advances st.position by S. logits: [rows(mode, S), V] with rows 0 / 1 / S for none / last / all.
  void forward(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size, float* logits,
               Trace* trace = nullptr);

  // A token stream from `first` at st.position (see TokenStream); validates the options (std::invalid_argument
  // naming the bad one). The stream must not outlive the engine or the state, and is the engine's only open
  // stream on st.
  std::unique_ptr<TokenStream> open_stream(State& st, int32_t first, const StreamOptions& opt);

  // The next step of several streams in one forward (concurrent generations decoded together): every stream whose
  // next token is one step away (drawn in the extension, nothing queued) joins: a plain stream with one row (its
  // pending token), a stream drafting with an explicit k with its verify's 1 + k rows (drafted first with the head;
  // then accepted, rolled back and its head rows run as its lone verify does them), one drafting with speculative
  // auto stops drafting and joins with one row. The tokens drawn wait for each stream's next(). Each row is computed
  // as its stream alone computes it and drawn with its own options and uniform numbers, so every stream returns
  // what it would alone and leaves the state it leaves alone. Returns the rows run together (0: fewer than 2
  // streams could join, or the backend runs one stream per forward; their next() steps them). Throws
  // std::invalid_argument for a stream of another engine or two streams over one state.
  int64_t step_streams(const std::vector<TokenStream*>& streams);
  // Whether step_streams decodes several streams in one forward on this backend.
  bool batches_streams() const { return backend_->batches_streams(); }

  // Greedy decoding: n_steps tokens from a device-mode stream where the backend has one, else lock-step argmax;
  // out[i] = argmax (lowest index on ties) after feeding token (i = 0) or out[i-1]. Advances st.position by n_steps.
  void decode_greedy(State& st, int32_t token, int64_t n_steps, int32_t* out);

  // k chained rows of the MTP head from st (position P >= 1, its head cache current: State::mtp_current): row 0
  // pairs st.last_hidden with `token` (the token at P), row j > 0 the head's own output with drafts[j - 1]; each
  // row's logits go to logits [k, V] and pick(j, row) chooses drafts[j] (nullptr: greedy, lowest index on ties).
  // st's head cache keeps its rows count (the rows land past it, scratch until a commit overwrites them).
  void draft(State& st, int32_t token, int64_t k, float* logits, int32_t* drafts,
             const std::function<int32_t(int64_t, const float*)>& pick = nullptr);

  // Waits until the device has finished every launched step (an open stream's run-ahead included), so a state's
  // arrays can be copied (snapshot, export) while a stream is open.
  void sync();

  // Backend switches (ablations) and counters; std::invalid_argument for a name the backend does not know.
  void set_backend_flag(const std::string& name, int64_t value);
  int64_t backend_flag(const std::string& name);
  std::map<std::string, int64_t> backend_counters();

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
  friend class TokenStream;
  // The layer loop, written once: x += mixer(norm(x)); x += moe(norm(x)) for the streams' rows (rows[i].n rows of
  // state rows[i].st at its position, in order).
  struct StreamRows {
    State* st;
    int64_t n;
  };
  void run_layers(const std::vector<StreamRows>& rows, Trace* trace);
  void run_layers(State& st, int64_t n, Trace* trace) { run_layers({{&st, n}}, trace); }
  // The streams' rows (ids: rows[0].n ids, then rows[1].n, ...) as one chunk, each stream's at its position; logits
  // [sum n, V] when given; keep: the rows' hidden states kept (keep_hidden); positions advanced. The caller sets
  // exact_rows and abandons on a throw.
  void forward_rows(const std::vector<StreamRows>& rows, const int32_t* ids, float* logits, bool keep);
  // One bracketed decode step (d.position == st.position); numbers it (d.index: the engine's step count, so a
  // backend's per-step slots tell the steps of every stream apart), advances st.position by 1, returns d.index.
  int64_t run_step(State& st, DecodeStep d, float* logits);
  void check_sample_options(const SampleOptions& o) const;
  // The head's rows after main rows ran and keep_hidden: `rows` rows pairing the hidden states ([st.last_hidden
  // when prev] then the kept rows) with next_ids, at positions st.mtp_rows.., then st.last_hidden = kept row
  // last_row. (docs/model.md §7: row (h_p, x_{p+1}) runs at position p.) exact: rows as one-row steps make them.
  void advance_mtp(State& st, const int32_t* next_ids, int64_t rows, bool prev, int64_t last_row,
                   bool exact = false);
  // n rows (a verify or a replay, n small) at st.position as one chunk, every row as a one-row step computes it
  // (Backend::exact_rows); logits [n, V] when given; the rows' hidden states kept; the head's cache untouched.
  void run_rows(State& st, const int32_t* ids, int64_t n, float* logits);
  // The head's rows of several streams after one forward that kept its hidden states: stream i's n rows pair
  // [its last_hidden when prev] then the kept rows row0 .. with ids, then its last_hidden = kept row
  // row0 + n - prev (advance_mtp's rows for a stream whose rows begin at row0).
  struct HeadRows {
    State* st;
    const int32_t* ids;
    int64_t n;
    bool prev;
    int64_t row0;
  };
  void advance_mtp(const std::vector<HeadRows>& heads);
  // One forward for the streams' Spec::rows, engine lock held: a plain row (the pending token) or a verify
  // [t, d_1 .. d_k] (spec_draft ran) each, as a segment over its own state, every row as its stream alone computes
  // it (exact_rows); then each plain row's draw, each verify's acceptance, head rows and roll-back (a replay of the
  // kept rows where the backend kept no state rows for it, in one more forward for the round's verifies), and
  // commit. Returns the rows run.
  int64_t decode_rows(const std::vector<TokenStream*>& streams);
  // Engine lock held: park the open device stream (if any) unless it is `keep`.
  void park_active(const TokenStream* keep);

  Config cfg_;
  Weights weights_;
  int64_t max_context_;
  bool debug_;
  std::unique_ptr<Backend> backend_;
  bool mtp_ = false;                // see has_mtp()
  // The adaptive rule's memory, across this engine's streams (speculative.cpp): a plain step's cost, the verifies
  // timed since the last judgement (streams too short to judge alone add up), and whether new streams draft.
  struct SpecHistory {
    double plain_s = 0;                 // the fastest plain step of the last probe (s per token; 0: none yet)
    double window_s = 0;                // verifies of the current window: time, tokens made, count
    int64_t window_tokens = 0, window_verifies = 0;
    bool warmed = false;                // the engine's first window (first-use allocations) is not judged
    bool drafting = true;               // new streams draft; else they begin plain ...
    int64_t wait = 0;                   // ... for this many more streams, then one drafts again (and re-probes)
    std::string why;                    // the judgement that stopped drafting
  } spec_history_;
  std::vector<float> batch_logits_;  // decode_rows: [rows, V]
  std::vector<Buffer> head_hidden_;  // advance_mtp of several streams: kept hidden rows [H] the head reads
  int64_t next_step_ = 0;           // decode steps run by this engine
  TokenStream* active_ = nullptr;   // the device stream whose steps may be in flight or own the sampler
  std::mutex mu_;  // one forward / step at a time: backend buffers are shared
};

}  // namespace lily
