#include "core/engine.h"
#include "core/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

namespace lily {

LogitsMode parse_logits_mode(const std::string& s) {
  if (s == "last") return LogitsMode::Last;
  if (s == "all") return LogitsMode::All;
  if (s == "none") return LogitsMode::None;
  throw std::invalid_argument("[lily] logits must be 'last', 'all' or 'none', got '" + s + "'");
}

Engine::Engine(const Config& cfg, const TensorMap& tensors, const QuantMap& quant, int threads,
               int64_t max_context, bool debug, const std::string& backend, const BackendOptions& options)
    : cfg_(cfg), weights_(load_weights(cfg_, tensors, quant)), max_context_(max_context), debug_(debug) {
  if (max_context < 1) throw std::invalid_argument("[lily] max_context must be >= 1");
  if (threads < 0) throw std::invalid_argument("[lily] threads must be >= 0 (0 = all hardware threads)");
  backend_ = make_backend(backend, cfg_, weights_, threads, debug, options);
  mtp_ = weights_.has_mtp && backend_->has_mtp();
}

void Engine::validate(const State& st, const int32_t* tokens, int64_t S) const {
  if (S < 1) throw std::invalid_argument("[lily] forward: tokens is empty (need at least one token)");
  if (st.max_context != max_context_ || st.mem != backend_->memory() || st.kv_row != static_cast<int64_t>(cfg_.n_kv_heads) * cfg_.head_dim ||
      st.layer_slot.size() != static_cast<size_t>(cfg_.n_layers))
    throw std::invalid_argument("[lily] forward: state was created by a different engine");
  if (st.position + S > max_context_)
    throw std::invalid_argument("[lily] forward: position " + std::to_string(st.position) + " + " +
                                std::to_string(S) + " tokens exceeds max_context " + std::to_string(max_context_));
  for (int64_t i = 0; i < S; ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg_.vocab)
      throw std::invalid_argument("[lily] forward: token id " + std::to_string(tokens[i]) + " at index " +
                                  std::to_string(i) + " is out of range for vocab_size " +
                                  std::to_string(cfg_.vocab));
}

Engine::~Engine() = default;

void Engine::run_layers(const std::vector<StreamRows>& rows, Trace* trace) {
  int64_t n = 0;
  RowSegments segs(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    segs[i].row0 = n, segs[i].n = rows[i].n, segs[i].pos0 = rows[i].st->position;
    n += rows[i].n;
  }
  auto record = [&](const std::string& name) {
    if (!trace) return;
    auto& v = (*trace)[name];
    const size_t old = v.size();
    v.resize(old + static_cast<size_t>(n) * cfg_.hidden);
    backend_->read_residual(n, v.data() + old);
  };
  record("embed");
  for (int L = 0; L < cfg_.n_layers; ++L) {
    const bool attention = cfg_.layer_types[L] == LayerType::Attention;
    for (size_t i = 0; i < rows.size(); ++i) {
      State& st = *rows[i].st;
      const int slot = st.layer_slot[L];
      segs[i].kv = attention ? &st.kv[slot] : nullptr;
      segs[i].deltanet = attention ? nullptr : &st.deltanet[slot];
    }
    if (attention) backend_->attention_block(L, segs);
    else backend_->deltanet_block(L, segs);
    record("mixer." + std::to_string(L));
    backend_->moe_block(L, n);
    record("moe." + std::to_string(L));
  }
}

void Engine::advance_mtp(State& st, const int32_t* next_ids, int64_t rows, bool prev, int64_t last_row,
                         bool exact) {
  if (rows > 0) {
    if (exact) backend_->exact_rows(true);
    try {
      backend_->mtp_embed(next_ids, rows, prev ? &st.last_hidden : nullptr, Backend::MtpHidden::Kept);
      backend_->attention_block(cfg_.n_layers, {RowSegment{0, rows, st.mtp_rows, nullptr, &st.mtp_kv}});
      backend_->moe_block(cfg_.n_layers, rows);
    } catch (...) {
      backend_->exact_rows(false);
      throw;
    }
    if (exact) backend_->exact_rows(false);
    st.mtp_rows += rows;
  }
  backend_->store_hidden(last_row, st.last_hidden);
}

void Engine::forward_rows(const std::vector<StreamRows>& rows, const int32_t* ids, float* logits, bool keep) {
  int64_t n = 0;
  for (const StreamRows& r : rows) {
    r.st->reserve(r.st->position + r.n);
    n += r.n;
  }
  backend_->embed(ids, n);
  run_layers(rows, nullptr);
  if (logits) backend_->head(0, n, logits);
  if (keep) backend_->keep_hidden(n);
  for (const StreamRows& r : rows) r.st->position += r.n;
}

void Engine::run_rows(State& st, const int32_t* ids, int64_t n, float* logits) {
  backend_->exact_rows(true);
  try {
    forward_rows({{&st, n}}, ids, logits, true);
  } catch (...) {
    backend_->exact_rows(false);
    backend_->abandon();
    throw;
  }
  backend_->exact_rows(false);
}

int64_t Engine::run_step(State& st, DecodeStep d, float* logits) {
  d.index = next_step_++;
  const bool head = mtp_ && st.mtp_current();
  try {
    if (backend_->begin_step(st, d)) {
      backend_->embed(&d.token, 1);
      run_layers(st, 1, nullptr);
      backend_->head_step(d);
      if (head) {  // the MTP head's row (h_{p-1}, x_p) for the token fed (x_p is this step's token)
        backend_->keep_hidden(1);
        if (d.position > 0) advance_mtp(st, &d.token, 1, true, 0);
        else advance_mtp(st, nullptr, 0, false, 0);
      }
    }
    backend_->end_step(st, d, logits);
  } catch (...) {
    backend_->abandon();
    throw;
  }
  st.position += 1;
  return d.index;
}

void Engine::forward(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size,
                     float* logits, Trace* trace) {
  std::lock_guard<std::mutex> lk(mu_);
  park_active(nullptr);
  validate(st, tokens, S);
  if (chunk_size < 0) throw std::invalid_argument("[lily] forward: chunk_size must be >= 0");
  const int64_t chunk = chunk_size > 0 ? chunk_size : backend_->default_chunk();
  const int64_t V = cfg_.vocab;
  if (debug_) std::fill(logits, logits + logits_rows(mode, S) * V, std::numeric_limits<float>::quiet_NaN());
  st.reserve(st.position + S);
  if (S == 1 && !trace) {  // a decode step, the same path as a token stream's lock-step
    std::vector<float> row;
    if (mode == LogitsMode::None) row.resize(static_cast<size_t>(V));
    run_step(st, DecodeStep{0, tokens[0], st.position, false, 0.f},
             mode == LogitsMode::None ? row.data() : logits);
    return;
  }
  try {
    for (int64_t c0 = 0; c0 < S; c0 += chunk) {
      const int64_t n = std::min(chunk, S - c0);
      const bool head = mtp_ && st.mtp_current();
      backend_->embed(tokens + c0, n);
      run_layers(st, n, trace);
      if (mode == LogitsMode::All) backend_->head(0, n, logits + c0 * V);
      else if (mode == LogitsMode::Last && c0 + n == S) backend_->head(n - 1, 1, logits);
      if (head) {  // the MTP head's rows (h_{p-1}, x_p) for the chunk's tokens x_p (none for x_0)
        backend_->keep_hidden(n);
        const bool prev = st.position > 0;
        advance_mtp(st, tokens + c0 + (prev ? 0 : 1), prev ? n : n - 1, prev, n - 1);
      }
      st.position += n;
    }
    backend_->sync();
  } catch (...) {
    backend_->abandon();
    throw;
  }
}

void Engine::check_sample_options(const SampleOptions& o) const {
  const int64_t V = cfg_.vocab;
  auto bad = [](const std::string& what) { throw std::invalid_argument("[lily] open_stream: " + what); };
  if (!(o.temperature >= 0.f) || !std::isfinite(o.temperature)) bad("temperature must be a finite number >= 0");
  if (!(o.top_p > 0.f && o.top_p <= 1.f)) bad("top_p must be in (0, 1]");
  if (!(o.min_p >= 0.f && o.min_p <= 1.f)) bad("min_p must be in [0, 1]");
  if (!(o.repetition_penalty > 0.f) || !std::isfinite(o.repetition_penalty))
    bad("repetition_penalty must be a finite number > 0");
  if (!std::isfinite(o.presence_penalty) || !std::isfinite(o.frequency_penalty)) bad("penalties must be finite");
  if (o.bias_ids.size() != o.bias_vals.size())
    bad("bias_ids has " + std::to_string(o.bias_ids.size()) + " entries and bias_vals " +
        std::to_string(o.bias_vals.size()) + ": expected the same length");
  std::vector<uint8_t> seen_id(static_cast<size_t>(V), 0);
  for (int32_t id : o.bias_ids) {
    if (id < 0 || id >= V) bad("bias id " + std::to_string(id) + " is outside 0.." + std::to_string(V - 1));
    if (seen_id[id]++) bad("bias id " + std::to_string(id) + " appears twice: expected distinct ids");
  }
  for (float b : o.bias_vals)
    if (std::isnan(b)) bad("a logit bias is NaN");
  if (!o.seen.empty() && static_cast<int64_t>(o.seen.size()) != V)
    bad("seen has " + std::to_string(o.seen.size()) + " entries: expected vocab_size " + std::to_string(V) +
        " (or none)");
  if (!o.counts.empty() && static_cast<int64_t>(o.counts.size()) != V)
    bad("counts has " + std::to_string(o.counts.size()) + " entries: expected vocab_size " + std::to_string(V) +
        " (or none)");
}

std::unique_ptr<TokenStream> Engine::open_stream(State& st, int32_t first, const StreamOptions& opt) {
  std::lock_guard<std::mutex> lk(mu_);
  park_active(nullptr);
  validate(st, &first, 1);
  if (opt.max_tokens < 1)
    throw std::invalid_argument("[lily] open_stream: max_tokens must be >= 1, got " + std::to_string(opt.max_tokens));
  for (int32_t id : opt.stop_ids)
    if (id < 0 || id >= cfg_.vocab)
      throw std::invalid_argument("[lily] open_stream: stop id " + std::to_string(id) + " is outside 0.." +
                                  std::to_string(cfg_.vocab - 1));
  check_sample_options(opt.sample);
  if (opt.speculative < 0 || opt.speculative > kMaxDrafts)
    throw std::invalid_argument("[lily] open_stream: speculative must be 0 (off) or 1.." + std::to_string(kMaxDrafts) +
                                " drafted tokens per step, got " + std::to_string(opt.speculative));
  if (opt.speculative > 0 && !mtp_)
    throw std::invalid_argument(std::string("[lily] open_stream: speculative decoding needs the MTP head, and this "
                                            "engine has none (") +
                                (weights_.has_mtp ? "backend '" + std::string(backend_->name()) +
                                                        "' has no MTP kernels yet"
                                                  : std::string("the weights carry no mtp.* tensors")) + ")");
  // device: the backend draws where it can; else (a backend without a device sampler) the stream draws in the
  // extension, as the speculative loop does, and step_streams can decode it together with others
  const bool device = opt.speculative == 0 && opt.device && !opt.batch && backend_->sampler_begin(opt.sample);
  const bool extension = opt.speculative > 0 || (opt.device && !device);
  std::unique_ptr<TokenStream> s(new TokenStream(*this, st, first, opt, device, extension));
  if (device) {
    active_ = s.get();
    s->launch(first);
  }
  return s;
}

void Engine::park_active(const TokenStream* keep) {
  if (active_ && active_ != keep) {
    TokenStream* s = active_;
    active_ = nullptr;
    s->park();
  }
}

void Engine::decode_greedy(State& st, int32_t token, int64_t n_steps, int32_t* out) {
  if (n_steps < 0) throw std::invalid_argument("[lily] decode_greedy: n_steps must be >= 0");
  if (n_steps == 0) return;
  if (st.position + n_steps > max_context_)
    throw std::invalid_argument("[lily] decode_greedy: position " + std::to_string(st.position) + " + " +
                                std::to_string(n_steps) + " steps exceeds max_context " + std::to_string(max_context_));
  StreamOptions opt;
  opt.max_tokens = n_steps;
  opt.sample.temperature = 0.f;
  std::unique_ptr<TokenStream> s = open_stream(st, token, opt);
  if (s->draws()) {
    for (int64_t i = 0; i < n_steps; ++i) out[i] = s->next();
    s->close();
    return;
  }
  std::vector<float> lg(static_cast<size_t>(cfg_.vocab));
  for (int64_t i = 0; i < n_steps; ++i) {
    s->step(token, lg.data());
    token = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    out[i] = token;
  }
  s->close();
}

// The head reads kept rows from row 0 on (Backend::mtp_embed): with one stream there, its rows run as one chunk;
// else each row's hidden state goes in as a buffer (the stream's last_hidden, or a copy of its kept row), the rows
// together where the backend can (mtp_embed_each), one by one otherwise. Each row as a one-row step computes it
// (the caller's exact_rows). Every last_hidden is written after every row read it.
void Engine::advance_mtp(const std::vector<HeadRows>& heads) {
  if (heads.size() == 1 && heads[0].row0 == 0) {
    const HeadRows& h = heads[0];
    return advance_mtp(*h.st, h.ids, h.n, h.prev, h.n - h.prev);
  }
  size_t copies = 0;  // kept rows read: their buffers made first (prev points into head_hidden_)
  for (const HeadRows& h : heads) copies += static_cast<size_t>(h.n - (h.n > 0 && h.prev));
  while (head_hidden_.size() < copies) head_hidden_.emplace_back(backend_->memory(), cfg_.hidden * 4);
  std::vector<const Buffer*> prev;  // [rows]: each row's hidden state
  std::vector<int32_t> ids;
  RowSegments segs;
  copies = 0;
  for (const HeadRows& h : heads) {
    if (h.n == 0) continue;
    segs.push_back(RowSegment{static_cast<int64_t>(ids.size()), h.n, h.st->mtp_rows, nullptr, &h.st->mtp_kv});
    for (int64_t j = 0; j < h.n; ++j) {
      ids.push_back(h.ids[j]);
      if (h.prev && j == 0) {
        prev.push_back(&h.st->last_hidden);
        continue;
      }
      Buffer& b = head_hidden_[copies++];
      backend_->store_hidden(h.row0 + j - h.prev, b);
      prev.push_back(&b);
    }
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n > 1 && backend_->mtp_embed_each(ids.data(), n, prev)) {
    backend_->attention_block(cfg_.n_layers, segs);
    backend_->moe_block(cfg_.n_layers, n);
  } else {
    for (const RowSegment& g : segs)
      for (int64_t i = 0; i < g.n; ++i) {
        backend_->mtp_embed(&ids[g.row0 + i], 1, prev[g.row0 + i], Backend::MtpHidden::Kept);
        backend_->attention_block(cfg_.n_layers, {RowSegment{0, 1, g.pos0 + i, nullptr, g.kv}});
        backend_->moe_block(cfg_.n_layers, 1);
      }
  }
  for (const HeadRows& h : heads) {
    h.st->mtp_rows += h.n;
    backend_->store_hidden(h.row0 + h.n - h.prev, h.st->last_hidden);
  }
}

int64_t Engine::step_streams(const std::vector<TokenStream*>& streams) {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<TokenStream*> ready;
  for (size_t i = 0; i < streams.size(); ++i) {
    TokenStream* s = streams[i];
    if (&s->eng_ != this) throw std::invalid_argument("[lily] step_streams: stream " + std::to_string(i) +
                                                      " belongs to another engine");
    for (size_t j = 0; j < i; ++j)
      if (&streams[j]->st_ == &s->st_)
        throw std::invalid_argument("[lily] step_streams: streams " + std::to_string(j) + " and " +
                                    std::to_string(i) + " run over one state: expected one stream per state");
    if (s->row_offer() != TokenStream::RowOffer::None) ready.push_back(s);
  }
  if (ready.size() < 2 || !backend_->batches_streams()) return 0;
  park_active(nullptr);
  for (TokenStream* s : ready) {
    const TokenStream::RowOffer offer = s->row_offer();
    // speculative auto stops drafting beside others (see stop_drafting_to_join); an explicit k drafts now and its
    // verify rows join the forward, or it takes a plain row where it cannot draft (one token left, no head row)
    if (offer == TokenStream::RowOffer::Drafting) s->stop_drafting_to_join();
    if (offer != TokenStream::RowOffer::Verify || s->spec_draft() == 0) s->spec_->rows.assign(1, s->spec_pending());
  }
  return decode_rows(ready);
}

int64_t Engine::decode_rows(const std::vector<TokenStream*>& streams) {
  const auto t0 = std::chrono::steady_clock::now();
  const size_t M = streams.size();
  const int64_t V = cfg_.vocab;
  std::vector<StreamRows> rows(M);
  std::vector<int64_t> row0(M), accepted(M, 0);
  std::vector<char> head(M);  // a plain row's head row runs (its stream's head cache is current), as in run_step
  std::vector<int32_t> ids;
  for (size_t i = 0; i < M; ++i) {
    State& st = streams[i]->st_;
    const std::vector<int32_t>& r = streams[i]->spec_->rows;
    validate(st, r.data(), static_cast<int64_t>(r.size()));
    rows[i] = {&st, static_cast<int64_t>(r.size())};
    row0[i] = static_cast<int64_t>(ids.size());
    head[i] = r.size() == 1 && mtp_ && st.mtp_current();
    ids.insert(ids.end(), r.begin(), r.end());
  }
  const int64_t R = static_cast<int64_t>(ids.size());
  // The backend keeps each row's DeltaNet states for a forward of one stream: a lone verify rolls back by them, one
  // beside other streams by a replay of its kept rows (one more forward, shared by the round's verifies).
  const bool kept = M == 1 && R > 1 && backend_->keeps_state_rows();
  batch_logits_.resize(static_cast<size_t>(R * V));
  backend_->exact_rows(true);
  try {
    if (kept) backend_->keep_state_rows(true);
    forward_rows(rows, ids.data(), batch_logits_.data(), mtp_);
    backend_->keep_state_rows(false);
    std::vector<HeadRows> heads;
    for (size_t i = 0; i < M; ++i) {
      TokenStream& s = *streams[i];
      State& st = s.st_;
      const float* logits = &batch_logits_[static_cast<size_t>(row0[i] * V)];
      if (rows[i].n == 1) {  // a plain row: its draw, and the head's row (h_{p-1}, x_p) for the token fed at p
        s.take_row_draw(logits, st.position);
        const bool p = st.position > 1;
        if (head[i]) heads.push_back({&st, s.spec_->rows.data(), p ? 1 : 0, p, row0[i]});
      } else {  // a verify: its acceptance and the head's rows (h_{P+i}, d_{i+1}) from the verified hidden states
        accepted[i] = s.spec_accept(logits);
        heads.push_back({&st, s.spec_->rows.data() + 1, accepted[i], false, row0[i]});
      }
    }
    if (!heads.empty()) advance_mtp(heads);
    std::vector<StreamRows> replay;
    std::vector<int32_t> replay_ids;
    for (size_t i = 0; i < M; ++i)
      if (rows[i].n > 1 && streams[i]->spec_roll_back(accepted[i], kept)) {
        replay.push_back({rows[i].st, accepted[i] + 1});
        replay_ids.insert(replay_ids.end(), ids.begin() + row0[i], ids.begin() + row0[i] + accepted[i] + 1);
      }
    if (!replay.empty()) forward_rows(replay, replay_ids.data(), nullptr, false);
  } catch (...) {
    backend_->keep_state_rows(false);
    backend_->exact_rows(false);
    backend_->abandon();
    throw;
  }
  backend_->exact_rows(false);
  // A verify's cost for the adaptive rule: its drafting, and the round's forwards by its share of the rows (alone:
  // all of them; beside other streams, what its rows add to a forward that runs anyway is about that share).
  const double round_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < M; ++i)
    if (rows[i].n > 1)
      streams[i]->spec_commit(accepted[i], streams[i]->spec_->draft_s +
                                               round_s * static_cast<double>(rows[i].n) / static_cast<double>(R));
  return R;
}

void Engine::draft(State& st, int32_t token, int64_t k, float* logits, int32_t* drafts,
                   const std::function<int32_t(int64_t, const float*)>& pick) {
  const int64_t V = cfg_.vocab;
  if (!mtp_) throw std::invalid_argument("[lily] draft: this engine does not run an MTP head");
  if (st.position < 1 || !st.mtp_current())
    throw std::invalid_argument("[lily] draft: the state needs at least one token and a current head cache (position " +
                                std::to_string(st.position) + ", head rows " + std::to_string(st.mtp_rows) + ")");
  if (k < 1 || st.mtp_rows + k > max_context_)
    throw std::invalid_argument("[lily] draft: k must be in 1.." + std::to_string(max_context_ - st.mtp_rows) +
                                ", got " + std::to_string(k));
  if (token < 0 || token >= V) throw std::invalid_argument("[lily] draft: token id out of range");
  st.reserve(st.mtp_rows + k);
  int32_t tok = token;
  try {
    for (int64_t j = 0; j < k; ++j) {
      backend_->mtp_embed(&tok, 1, j == 0 ? &st.last_hidden : nullptr,
                          j == 0 ? Backend::MtpHidden::Kept : Backend::MtpHidden::Draft);
      backend_->attention_block(cfg_.n_layers, {RowSegment{0, 1, st.mtp_rows + j, nullptr, &st.mtp_kv}});
      backend_->moe_block(cfg_.n_layers, 1);
      float* row = logits + j * V;
      backend_->mtp_head(0, 1, row);
      tok = pick ? pick(j, row) : static_cast<int32_t>(std::max_element(row, row + V) - row);
      drafts[j] = tok;
    }
  } catch (...) {
    backend_->abandon();
    throw;
  }
}

void Engine::sync() {
  std::lock_guard<std::mutex> lk(mu_);
  backend_->sync();
}

void Engine::set_backend_flag(const std::string& name, int64_t value) {
  std::lock_guard<std::mutex> lk(mu_);
  park_active(nullptr);
  backend_->set_flag(name, value);
}

int64_t Engine::backend_flag(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  return backend_->flag(name);
}

std::map<std::string, int64_t> Engine::backend_counters() {
  std::lock_guard<std::mutex> lk(mu_);
  return backend_->counters();
}

// ---- TokenStream ------------------------------------------------------------------------------------------------

TokenStream::TokenStream(Engine& eng, State& st, int32_t first, const StreamOptions& opt, bool device,
                         bool extension)
    : eng_(eng), st_(st), opt_(opt), device_(device), rng_(opt.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {
  const size_t V = static_cast<size_t>(eng.cfg_.vocab);
  if (opt_.sample.seen.empty()) opt_.sample.seen.assign(V, 0);
  if (opt_.sample.counts.empty()) opt_.sample.counts.assign(V, 0);
  if (extension) {  // the speculative loop's machinery; k = 0: plain steps only
    spec_ = std::make_unique<Spec>(opt_, first);
    if (opt_.speculative > 0) spec_begin(st.mtp_current());
  }
}

TokenStream::~TokenStream() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; close() explicitly to see errors
  }
}

// splitmix64: the device draws' uniform numbers, a fixed sequence per seed (24 random bits: exact in float32).
float TokenStream::next_uniform() {
  uint64_t z = (rng_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.f / 16777216.f);
}

void TokenStream::note(int32_t token) {
  opt_.sample.seen[token] = 1;
  opt_.sample.counts[token] += 1;
}

// Engine lock held. Step launched_ feeds host_token (>= 0) or what step launched_ - 1 drew (device slot).
void TokenStream::launch(int32_t host_token) {
  State& st = st_;
  st.reserve(st.position + 1);
  last_step_ = eng_.run_step(st, DecodeStep{0, host_token, st.position, true, next_uniform()}, nullptr);
  ++launched_;
}

void TokenStream::park() {
  if (parked_ || closed_ || launched_ == returned_) {
    parked_ = true;
    return;
  }
  // launched_ == returned_ + 1: the last launched step drew the token next() returns next
  parked_token_ = eng_.backend_->drawn_token(last_step_);
  parked_ = true;
}

int32_t TokenStream::next() {
  if (spec_) {
    std::lock_guard<std::mutex> lk(eng_.mu_);
    return spec_next();
  }
  if (!device_) throw std::logic_error("[lily] TokenStream.next: a lock-step stream takes step(token)");
  std::lock_guard<std::mutex> lk(eng_.mu_);
  if (ended_ || closed_) return -1;
  if (launched_ == returned_) {  // the context (or max_tokens) stopped the launches: nothing more to draw
    ended_ = true;
    return -1;
  }
  eng_.park_active(this);
  const int32_t known = parked_ ? parked_token_ : -1;  // parked: the draw of the last launched step, on the host
  if (parked_) {
    // Another generation used the device: its sampler options and the slot are gone. Begin again from the host's
    // record, which must hold the parked draw already: the device had counted it, and the step launched below
    // draws after it.
    note(known);
    if (!eng_.backend_->sampler_begin(opt_.sample))
      throw std::logic_error("[lily] TokenStream.next: the backend declined a sampler it accepted before");
    eng_.active_ = this;
  }
  const int64_t idx = last_step_;  // the step that draws the token returned now
  // Run ahead: the step that feeds this token goes out before we wait for it, unless the token is the last one.
  const bool more = returned_ + 1 < opt_.max_tokens && st_.position < eng_.max_context_;
  if (more) launch(known);  // known < 0: the device slot holds it
  const int32_t tok = known >= 0 ? known : eng_.backend_->drawn_token(idx);
  if (known < 0) note(tok);
  parked_ = false;
  parked_token_ = -1;
  ++returned_;
  for (int32_t s : opt_.stop_ids)
    if (s == tok) ended_ = true;
  if (returned_ >= opt_.max_tokens) ended_ = true;
  return tok;
}

void TokenStream::step(int32_t token, float* logits) {
  if (spec_) throw std::logic_error("[lily] TokenStream.step: this stream draws its own tokens (next())");
  if (device_) throw std::logic_error("[lily] TokenStream.step: a device stream draws its own tokens (next())");
  std::lock_guard<std::mutex> lk(eng_.mu_);
  if (closed_) throw std::logic_error("[lily] TokenStream.step: the stream is closed");
  eng_.park_active(nullptr);
  eng_.validate(st_, &token, 1);
  st_.reserve(st_.position + 1);
  last_step_ = eng_.run_step(st_, DecodeStep{0, token, st_.position, false, 0.f}, logits);
  ++launched_;
}

bool TokenStream::close(float* logits) {
  std::lock_guard<std::mutex> lk(eng_.mu_);
  bool have = false;
  if (!closed_ && spec_) spec_rewind();
  if (!closed_ && device_ && launched_ > 0) {
    if (eng_.active_ == this) {
      eng_.active_ = nullptr;
      eng_.backend_->drawn_token(last_step_);  // waits for the last launched step (its draw is dropped)
      if (logits) have = eng_.backend_->step_logits(last_step_, logits);
    }
  }
  closed_ = true;
  ended_ = true;
  return have;
}

}  // namespace lily
