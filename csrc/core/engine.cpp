#include "core/engine.h"

#include <algorithm>
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
               int64_t max_context, bool debug, const std::string& backend)
    : cfg_(cfg), weights_(load_weights(cfg_, tensors, quant)), max_context_(max_context), debug_(debug) {
  if (max_context < 1) throw std::invalid_argument("[lily] max_context must be >= 1");
  if (threads < 0) throw std::invalid_argument("[lily] threads must be >= 0 (0 = all hardware threads)");
  backend_ = make_backend(backend, cfg_, weights_, threads, debug);
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

void Engine::forward(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size,
                     float* logits, Trace* trace) {
  std::lock_guard<std::mutex> lk(mu_);
  forward_locked(st, tokens, S, mode, chunk_size, logits, trace);
}

void Engine::forward_locked(State& st, const int32_t* tokens, int64_t S, LogitsMode mode, int64_t chunk_size,
                            float* logits, Trace* trace) {
  validate(st, tokens, S);
  sampled_state_ = nullptr;  // a step may overwrite the device logits a decode_sample left
  if (chunk_size < 0) throw std::invalid_argument("[lily] forward: chunk_size must be >= 0");
  const int64_t chunk = chunk_size > 0 ? chunk_size : backend_->default_chunk();
  const int64_t V = cfg_.vocab;
  if (debug_) std::fill(logits, logits + logits_rows(mode, S) * V, std::numeric_limits<float>::quiet_NaN());
  st.reserve(st.position + S);
  // One token without a trace: the backend's decode fast path where it has one.
  if (S == 1 && !trace && backend_->decode_step(st, tokens[0], mode == LogitsMode::None ? nullptr : logits)) {
    st.position += 1;
    return;
  }
  for (int64_t c0 = 0; c0 < S; c0 += chunk) {
    const int64_t n = std::min(chunk, S - c0);
    auto record = [&](const std::string& name) {
      if (!trace) return;
      auto& v = (*trace)[name];
      const size_t old = v.size();
      v.resize(old + static_cast<size_t>(n) * cfg_.hidden);
      backend_->read_residual(n, v.data() + old);
    };
    backend_->embed(tokens + c0, n);
    record("embed");
    for (int L = 0; L < cfg_.n_layers; ++L) {
      const int slot = st.layer_slot[L];
      if (cfg_.layer_types[L] == LayerType::Attention) backend_->attention_block(L, st.kv[slot], st.position, n);
      else backend_->deltanet_block(L, st.dn[slot], n);
      record("mixer." + std::to_string(L));
      backend_->moe_block(L, n);
      record("moe." + std::to_string(L));
    }
    if (mode == LogitsMode::All) backend_->head(0, n, logits + c0 * V);
    else if (mode == LogitsMode::Last && c0 + n == S) backend_->head(n - 1, 1, logits);
    st.position += n;
  }
  backend_->sync();
}

void Engine::decode_greedy(State& st, int32_t token, int64_t n_steps, int32_t* out) {
  std::lock_guard<std::mutex> lk(mu_);
  if (n_steps < 0) throw std::invalid_argument("[lily] decode_greedy: n_steps must be >= 0");
  validate(st, &token, 1);
  sampled_state_ = nullptr;
  if (st.position + n_steps > max_context_)
    throw std::invalid_argument("[lily] decode_greedy: position " + std::to_string(st.position) + " + " +
                                std::to_string(n_steps) + " steps exceeds max_context " + std::to_string(max_context_));
  if (n_steps == 0) return;
  st.reserve(st.position + n_steps);
  if (backend_->decode_greedy(st, token, n_steps, out)) {
    st.position += n_steps;
    return;
  }
  std::vector<float> lg(static_cast<size_t>(cfg_.vocab));
  for (int64_t i = 0; i < n_steps; ++i) {
    forward_locked(st, &token, 1, LogitsMode::Last, 0, lg.data(), nullptr);
    token = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    out[i] = token;
  }
}

int64_t Engine::sampler_begin(const SampleOptions& o) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t V = cfg_.vocab;
  auto bad = [](const std::string& what) { throw std::invalid_argument("[lily] sampler_begin: " + what); };
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
  if (!o.seen.empty() && static_cast<int64_t>(o.seen.size()) != V)
    bad("seen has " + std::to_string(o.seen.size()) + " entries: expected vocab_size " + std::to_string(V) +
        " (or none)");
  if (!o.counts.empty() && static_cast<int64_t>(o.counts.size()) != V)
    bad("counts has " + std::to_string(o.counts.size()) + " entries: expected vocab_size " + std::to_string(V) +
        " (or none)");
  sampler_id_ = backend_->sampler_begin(o) ? ++sampler_issued_ : 0;
  return sampler_id_;
}

int32_t Engine::decode_sample(State& st, int32_t token, float uniform, int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  if (id <= 0 || id > sampler_issued_)
    throw std::invalid_argument("[lily] decode_sample: sampler id " + std::to_string(id) +
                                " was not returned by sampler_begin");
  if (id != sampler_id_) return -1;
  if (!(uniform >= 0.f && uniform < 1.f))
    throw std::invalid_argument("[lily] decode_sample: uniform must be in [0, 1), got " + std::to_string(uniform));
  validate(st, &token, 1);
  st.reserve(st.position + 1);
  int32_t next = -1;
  if (!backend_->decode_sample(st, token, uniform, &next))
    throw std::logic_error(std::string("[lily] decode_sample: backend '") + backend_->name() +
                           "' declined the step after accepting the sampler");
  st.position += 1;
  sampled_state_ = &st;
  sampled_position_ = st.position;
  return next;
}

bool Engine::decode_logits(const State& st, float* logits) {
  std::lock_guard<std::mutex> lk(mu_);
  if (sampled_state_ != &st || sampled_position_ != st.position) return false;
  return backend_->decode_logits(logits);
}

void Engine::set_backend_flag(const std::string& name, int64_t value) {
  std::lock_guard<std::mutex> lk(mu_);
  backend_->set_flag(name, value);
}

int64_t Engine::backend_flag(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  return backend_->flag(name);
}

}  // namespace lily
