// CPU backend: fp32 activations, multithreaded, weights dequantized on the fly.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core/backend.h"
#include "cpu/attention.h"
#include "cpu/deltanet.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "core/sampling.h"
#include "cpu/thread_pool.h"

namespace lily {
namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Config& cfg, const Weights& w, int threads, bool debug)
      : cfg_(cfg), w_(w), pool_(threads), debug_(debug) {}

  const char* name() const override { return "cpu"; }
  int threads() const override { return pool_.size(); }
  std::shared_ptr<Memory> memory() const override { return host_memory(); }
  Elem kv_elem() const override { return Elem::F32; }
  int64_t default_chunk() const override { return 256; }

  void embed(const int32_t* ids, int64_t S) override {
    reserve(S);
    int32_t drawn = step_token(ids);
    cpu::embed(pool_, w_.embed, drawn >= 0 ? &drawn : ids, S, x_.data());
  }

  // ---- the MTP head (docs/model.md §7) ----
  bool has_mtp() const override { return w_.has_mtp; }
  void keep_hidden(int64_t S) override {
    const int64_t H = cfg_.hidden;
    if (static_cast<int64_t>(hid_.size()) < S * H) hid_.resize(S * H);
    cpu::rms_norm(pool_, x_.data(), w_.final_norm, cfg_.rms_eps, S, H, hid_.data());
  }
  void store_hidden(int64_t row, Buffer& dst) override {
    const int64_t H = cfg_.hidden;
    std::copy(hid_.data() + row * H, hid_.data() + (row + 1) * H, dst.as<float>());
  }
  void mtp_embed(const int32_t* ids, int64_t n, const Buffer* prev, MtpHidden src) override {
    const int64_t H = cfg_.hidden;
    if (src == MtpHidden::Draft && (n != 1 || prev || draft_h_.empty()))
      throw std::logic_error("[lily] backend 'cpu': a chained MTP row needs n == 1 after mtp_head");
    const float* kept = hid_.data();
    embed_head_rows(ids, n, [&](int64_t i) {
      return src == MtpHidden::Draft ? draft_h_.data()
             : prev ? (i == 0 ? prev->as<float>() : kept + (i - 1) * H) : kept + i * H;
    });
  }
  bool mtp_embed_each(const int32_t* ids, int64_t n, const std::vector<const Buffer*>& prev) override {
    embed_head_rows(ids, n, [&](int64_t i) { return prev.at(static_cast<size_t>(i))->as<float>(); });
    return true;
  }
  void mtp_head(int64_t row0, int64_t n, float* logits) override {
    const int64_t H = cfg_.hidden;
    cpu::rms_norm(pool_, x_.data() + row0 * H, w_.mtp.norm, cfg_.rms_eps, n, H, h_.data());
    draft_h_.assign(h_.data() + (n - 1) * H, h_.data() + n * H);
    cpu::linear(pool_, w_.lm_head, h_.data(), n, logits);
  }
  void exact_rows(bool on) override { cpu::set_exact_rows(on); }
  bool keeps_state_rows() const override { return state_rows_on_; }
  void keep_state_rows(bool on) override {
    keep_rows_ = on;
    if (on) {  // the vectors stay allocated from one verify to the next
      state_rows_.resize(static_cast<size_t>(cfg_.n_layers));
      for (StateRows& r : state_rows_) r.rows = 0;
    }
  }
  void take_state_row(State& st, int64_t row) override {
    for (int L = 0; L < cfg_.n_layers; ++L) {
      if (cfg_.layer_types[L] != LayerType::DeltaNet) continue;
      const StateRows& r = state_rows_.at(L);
      if (row < 0 || row >= r.rows) throw std::logic_error("[lily] backend 'cpu': no kept DeltaNet state row");
      DeltaNetState& d = st.deltanet[st.layer_slot[L]];
      const size_t ssm = static_cast<size_t>(st.ssm_size), conv = static_cast<size_t>(st.conv_size);
      std::copy(r.ssm.begin() + row * ssm, r.ssm.begin() + (row + 1) * ssm, d.ssm.as<float>());
      std::copy(r.conv.begin() + row * conv, r.conv.begin() + (row + 1) * conv, d.conv.as<float>());
    }
  }

  // Several segments (streams decoded together): the projections and the MoE run over all rows at once (each row
  // as a one-row step computes it, exact_rows), the recurrence and the attention per segment on its own state.
  bool batches_streams() const override { return true; }

  void deltanet_block(int layer, const RowSegments& segs) override {
    const LayerWeights& lw = w_.layers[layer];
    const DeltaNetWeights& w = lw.deltanet;
    const int64_t H = cfg_.hidden, S = segment_rows(segs);
    cpu::rms_norm(pool_, x_.data(), lw.in_norm, cfg_.rms_eps, S, H, h_.data());
    cpu::linear(pool_, w.qkv, h_.data(), S, qkv_.data());
    cpu::linear(pool_, w.z, h_.data(), S, z_.data());
    cpu::linear(pool_, w.b, h_.data(), S, b_.data());
    cpu::linear(pool_, w.a, h_.data(), S, a_.data());
    const int64_t C = cfg_.conv_dim(), VD = cfg_.value_dim(), Hv = cfg_.deltanet_v_heads;
    float *ssm_rows = nullptr, *conv_rows = nullptr;
    if (keep_rows_) {  // a verify: one stream's rows
      if (segs.size() != 1) throw std::logic_error("[lily] backend 'cpu': state rows are kept for one stream only");
      const int64_t ssm = Hv * cfg_.deltanet_v_dim * cfg_.deltanet_k_dim;
      const int64_t conv = static_cast<int64_t>(cfg_.conv_kernel - 1) * C;
      StateRows& r = state_rows_[layer];
      r.ssm.resize(S * ssm), r.conv.resize(S * conv), r.rows = S;
      ssm_rows = r.ssm.data(), conv_rows = r.conv.data();
    }
    for_segments(segs, [&](const RowSegment& g) {
      kp::DeltaNetParams p{cfg_.deltanet_k_heads, cfg_.deltanet_v_heads, cfg_.deltanet_k_dim, cfg_.deltanet_v_dim,
                           cfg_.conv_kernel, cfg_.conv_dim(), cfg_.rms_eps, 1e-6f, g.n};
      const int64_t r = g.row0;
      cpu::deltanet_forward(pool_, p, qkv_.data() + r * C, z_.data() + r * VD, b_.data() + r * Hv, a_.data() + r * Hv,
                            w.conv_w, w.dt_bias, w.a_log, w.norm, g.deltanet->conv.as<float>(),
                            g.deltanet->ssm.as<float>(), u_.data() + r * C, y_.data() + r * VD, ssm_rows, conv_rows);
    });
    cpu::linear(pool_, w.out, y_.data(), S, t_.data());
    add_residual(S);
  }

  void attention_block(int layer, const RowSegments& segs) override {
    const LayerWeights& lw = w_.layers[layer];
    const AttentionWeights& w = lw.attn;
    const int64_t H = cfg_.hidden, S = segment_rows(segs), D = cfg_.head_dim;
    cpu::rms_norm(pool_, x_.data(), lw.in_norm, cfg_.rms_eps, S, H, h_.data());
    cpu::linear(pool_, w.q, h_.data(), S, qg_.data());
    cpu::linear(pool_, w.k, h_.data(), S, k_.data());
    cpu::linear(pool_, w.v, h_.data(), S, v_.data());
    const int64_t QG = 2 * cfg_.n_heads * D, KV = cfg_.n_kv_heads * D, O = cfg_.n_heads * D;
    for_segments(segs, [&](const RowSegment& g) {
      kp::AttentionParams p{cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim, cfg_.rotary_dim,
                            static_cast<float>(cfg_.rope_theta), cfg_.rms_eps,
                            1.f / std::sqrt(static_cast<float>(cfg_.head_dim)), 0, g.pos0, g.n};
      const int64_t r = g.row0;
      cpu::attention_forward(pool_, p, qg_.data() + r * QG, k_.data() + r * KV, v_.data() + r * KV, w.q_norm,
                             w.k_norm, g.kv->k.as<float>(), g.kv->v.as<float>(), o_.data() + r * O);
    });
    cpu::linear(pool_, w.o, o_.data(), S, t_.data());
    add_residual(S);
  }

  void moe_block(int layer, int64_t S) override {
    const LayerWeights& lw = w_.layers[layer];
    const int64_t H = cfg_.hidden;
    cpu::rms_norm(pool_, x_.data(), lw.post_norm, cfg_.rms_eps, S, H, h_.data());
    kp::MoeParams p{cfg_.hidden, cfg_.n_experts, cfg_.top_k, cfg_.moe_inter, cfg_.shared_inter,
                    cfg_.norm_topk_prob ? 1 : 0, S};
    cpu::moe_forward(pool_, p, lw.moe, h_.data(), t_.data(), moe_);
    add_residual(S);
  }

  void read_residual(int64_t S, float* out) override {
    std::copy(x_.data(), x_.data() + S * cfg_.hidden, out);
  }

  void head(int64_t row0, int64_t n, float* logits) override {
    const int64_t H = cfg_.hidden;
    cpu::rms_norm(pool_, x_.data() + row0 * H, w_.final_norm, cfg_.rms_eps, n, H, h_.data());
    cpu::linear(pool_, w_.lm_head, h_.data(), n, logits);
  }

  // Decode steps run synchronously on the host. Lock-step by default (the host draws); the test switch
  // "device_draw" makes this backend draw as a device backend does (core/sampling.h), so the engine's device-mode
  // token loop is exercised without a GPU.
  bool begin_step(State&, const DecodeStep& d) override {
    step_ = d;
    return true;
  }
  void head_step(const DecodeStep& d) override {
    Slot& s = slots_[d.index & 1];
    s.logits.resize(static_cast<size_t>(cfg_.vocab));
    head(0, 1, s.logits.data());
    s.index = d.index;
    s.token = -1;
    if (d.draw) {
      if (!sampler_ready_) throw std::logic_error("[lily] backend 'cpu': a drawing step without sampler_begin");
      s.token = sample_draw(s.logits.data(), cfg_.vocab, sampler_, sampler_.seen, sampler_.counts, d.uniform);
    }
  }
  void end_step(State&, const DecodeStep& d, float* logits) override {
    const Slot& s = slots_[d.index & 1];
    if (logits) std::copy(s.logits.begin(), s.logits.end(), logits);
    step_.index = -1;
  }
  bool sampler_begin(const SampleOptions& opt) override {
    if (!device_draw_) return false;
    sampler_ = opt;
    sampler_ready_ = true;
    ++sampler_begins_;
    return true;
  }
  int32_t drawn_token(int64_t index) override {
    const Slot& s = slots_[index & 1];
    if (s.index != index || s.token < 0)
      throw std::logic_error("[lily] backend 'cpu': step " + std::to_string(index) + " drew no token that is held");
    return s.token;
  }
  bool step_logits(int64_t index, float* logits) override {
    const Slot& s = slots_[index & 1];
    if (s.index != index) return false;
    std::copy(s.logits.begin(), s.logits.end(), logits);
    return true;
  }
  void set_flag(const std::string& name, int64_t value) override {
    if (name == "state_rows") {  // ablation: 0 rolls a verify back by replay instead of its kept DeltaNet rows
      if (value != 0 && value != 1)
        throw std::invalid_argument("[lily] backend flag 'state_rows' must be 0 or 1, got " + std::to_string(value));
      state_rows_on_ = value != 0;
      return;
    }
    if (name != "device_draw") return Backend::set_flag(name, value);
    if (value != 0 && value != 1)
      throw std::invalid_argument("[lily] backend flag 'device_draw' must be 0 or 1, got " + std::to_string(value));
    device_draw_ = value != 0;
    sampler_ready_ = false;
  }
  int64_t flag(const std::string& name) const override {
    if (name == "state_rows") return int64_t{state_rows_on_};
    return name == "device_draw" ? int64_t{device_draw_} : Backend::flag(name);
  }
  // sampler_begins: generations begun with the extension's draws (resumed streams too)
  std::map<std::string, int64_t> counters() const override { return {{"sampler_begins", sampler_begins_}}; }

 private:
  // The head's input rows: x[n, H] = fc([RMSNorm(E[ids[i]]) | RMSNorm(hidden(i))]) (embedding first).
  template <class Hidden>
  void embed_head_rows(const int32_t* ids, int64_t n, Hidden hidden) {
    const int64_t H = cfg_.hidden;
    reserve(n);
    if (static_cast<int64_t>(cat_.size()) < n * 2 * H) cat_.resize(n * 2 * H);
    int32_t drawn = step_token(ids);
    cpu::embed(pool_, w_.embed, drawn >= 0 ? &drawn : ids, n, t_.data());
    for (int64_t i = 0; i < n; ++i) {
      float* row = cat_.data() + i * 2 * H;
      cpu::rms_norm_row(t_.data() + i * H, w_.mtp.norm_embed, cfg_.rms_eps, H, row);
      cpu::rms_norm_row(hidden(i), w_.mtp.norm_hidden, cfg_.rms_eps, H, row + H);
    }
    cpu::linear(pool_, w_.mtp.fc, cat_.data(), n, x_.data());
  }

  // ids[0] < 0 inside a step fed by the previous step's device draw: that draw (else -1, ids as given).
  int32_t step_token(const int32_t* ids) const {
    if (step_.index < 0 || ids[0] >= 0) return -1;
    const Slot& prev = slots_[(step_.index - 1) & 1];
    if (prev.index != step_.index - 1 || prev.token < 0)
      throw std::logic_error("[lily] backend 'cpu': the step's token comes from a draw that is not held");
    return prev.token;
  }

  // fn(segment) for each: one segment uses the pool inside fn; several are spread over the pool, one thread each
  // (the pool runs nested calls inline), so a step of M streams costs one dispatch per phase, not M. Every row's
  // arithmetic is the same either way (each kernel's work split never changes a row's sums).
  template <class F>
  void for_segments(const RowSegments& segs, F&& fn) {
    if (segs.size() == 1) return fn(segs[0]);
    pool_.parallel_for(static_cast<int64_t>(segs.size()), 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) fn(segs[i]);
    });
  }

  void add_residual(int64_t S) {
    float* x = x_.data();
    const float* t = t_.data();
    const int64_t n = S * cfg_.hidden;
    pool_.parallel_for(n, 1 << 14, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) x[i] += t[i];
    });
  }

  // Buffers bounded by the chunk's row count S.
  void reserve(int64_t S) {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim;
    auto grow = [&](std::vector<float>& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
      if (debug_) std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
    };
    grow(x_, S * H);
    grow(h_, S * H);
    grow(t_, S * H);
    if (cfg_.n_attention_layers()) {
      grow(qg_, S * 2 * cfg_.n_heads * D);
      grow(k_, S * cfg_.n_kv_heads * D);
      grow(v_, S * cfg_.n_kv_heads * D);
      grow(o_, S * cfg_.n_heads * D);
    }
    if (cfg_.n_deltanet_layers()) {
      grow(qkv_, S * cfg_.conv_dim());
      grow(u_, S * cfg_.conv_dim());
      grow(z_, S * cfg_.value_dim());
      grow(y_, S * cfg_.value_dim());
      grow(b_, S * cfg_.deltanet_v_heads);
      grow(a_, S * cfg_.deltanet_v_heads);
    }
    if (debug_) {
      for (auto* v : {&moe_.logits, &moe_.top_w, &moe_.row_w, &moe_.hb, &moe_.g, &moe_.up, &moe_.d, &moe_.sg,
                      &moe_.su, &moe_.sig})
        std::fill(v->begin(), v->end(), std::numeric_limits<float>::quiet_NaN());
    }
  }

  const Config& cfg_;
  const Weights& w_;
  ThreadPool pool_;
  bool debug_;
  std::vector<float> x_, h_, t_;         // [S, H] residual, normed input, sub-block output
  std::vector<float> qg_, k_, v_, o_;    // attention: [S, 2*Hq*D], [S, Hkv*D] x2, [S, Hq*D]
  std::vector<float> qkv_, u_, z_, y_;   // deltanet: [S, C] x2, [S, Hv*Dv] x2
  std::vector<float> b_, a_;             // deltanet: [S, Hv]
  std::vector<float> hid_, cat_, draft_h_;  // MTP: kept hidden [S, H], [embedding | hidden] [n, 2H], draft [H]
  struct StateRows {                     // a DeltaNet layer's state after each row of the last kept forward
    int64_t rows = 0;
    std::vector<float> ssm, conv;        // [rows, Hv*Dv*Dk], [rows, (K-1)*C]
  };
  bool keep_rows_ = false, state_rows_on_ = true;
  std::vector<StateRows> state_rows_;    // by layer
  struct Slot {                          // one of the last two decode steps
    int64_t index = -1;
    int32_t token = -1;                  // its draw (device_draw)
    std::vector<float> logits;           // [V]
  };
  Slot slots_[2];
  DecodeStep step_{-1, -1, 0, false, 0.f};  // the step being run (index -1: none)
  bool device_draw_ = false, sampler_ready_ = false;
  int64_t sampler_begins_ = 0;
  SampleOptions sampler_;
  cpu::MoeScratch moe_;
};

}  // namespace

std::string cpu_simd_features() {
  std::string f;
#ifdef __SSE4_2__
  f += "sse4.2 ";
#endif
#ifdef __AVX2__
  f += "avx2 ";
#endif
#ifdef __FMA__
  f += "fma ";
#endif
#ifdef __AVX512F__
  f += "avx512f ";
#endif
#ifdef __ARM_NEON
  f += "neon ";
#endif
  if (!f.empty()) f.pop_back();
  return f;
}

std::unique_ptr<Backend> make_cpu_backend(const Config& cfg, const Weights& w, int threads, bool debug) {
  return std::make_unique<CpuBackend>(cfg, w, threads, debug);
}

}  // namespace lily
