// CUDA backend: bf16 activations into every matrix product (fp32 accumulate), fp32 residual stream, norms,
// softmax and DeltaNet state; bf16 KV cache. Weights are copied to the device once at construction.
// Everything is queued on one stream; the host waits only in head / read_residual / sync and for a step's
// logits or drawn token.
//
// Sub-blocks (core/backend.h) run the prefill kernels for any S, except S == 1 inside a step bracket
// (begin_step .. end_step): there they run the fused decode sub-blocks (decode_layers.cuh, on the decode GEMV of
// gemv.cuh: norms folded into the projections, projections that read the same row in one launch, conv into the
// in-projection, MoE combine into the down projection) on dedicated buffers, with the token and position in a device
// control block, so the whole step (embed -> layers -> head -> draw) is one CUDA graph, recorded once per key
// (step_key) and replayed.
// Flag "cuda_graph" (1 default, 0: the step's kernels launched one by one, no capture).
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "cuda/cuda_memory.h"
#include "cuda/attention.cuh"
#include "cuda/decode_layers.cuh"
#include "cuda/deltanet.cuh"
#include "cuda/embed_norm.cuh"
#include "cuda/gemm.cuh"
#include "cuda/gemv.cuh"
#include "cuda/moe.cuh"
#include "cuda/mtp_head.cuh"
#include "cuda/runtime.h"
#include "cuda/sample.cuh"
#include "cuda/weights_cuda.h"

namespace lily {
namespace {

using cuda::bf16;
using cuda::DLinear;
using DLayer = cuda::DeviceLayer;

// Device control block of the decode steps: two slots alternate by step parity (DecodeStep::index & 1). Step p
// reads its token, position and uniform from slot[p] (the host writes them, except a token the previous step drew)
// and writes the token it draws into slot[1 - p].token, the next step's input.
struct StepSlot {
  int32_t token;  // input token of the step
  int32_t pos;    // its position
  float uniform;  // device sampling: the step's draw in [0, 1)
  int32_t pad_;
};
struct StepCtl {
  StepSlot slot[2];
};

// A device scratch buffer that only grows.
struct Scratch {
  Buffer buf;
  template <class T>
  T* get(const std::shared_ptr<Memory>& m, int64_t n) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    if (buf.bytes() < bytes) buf = Buffer(m, bytes);
    return buf.as<T>();
  }
};

// A recorded decode step: the graph of one key (step_key), kept while it may be replayed.
struct StepGraph {
  std::vector<uintptr_t> key;
  cudaGraphExec_t exec = nullptr;
  int64_t last_use = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Config& cfg, const Weights& w, bool debug)
      : cfg_(cfg), host_w_(w), mem_(std::make_shared<CudaMemory>()), st_(mem_->stream()), debug_(debug),
        mtp_(cfg, mem_, st_) {
    check_supported();
    LILY_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, 0));
    w_ = cuda::upload_weights(cfg_, w, mem_);
    fused_ok_ = cuda::fused_decode_fits(cfg_, w_);
    dec_.cfg = &cfg_, dec_.st = st_, dec_.sm_count = sm_count_;
    alloc_decode();
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(st_);  // recorded steps may still run
    drop_graphs();
    for (cudaEvent_t e : {step_done_[0], step_done_[1], in_copied_[0], in_copied_[1]})
      if (e) cudaEventDestroy(e);
    for (void* p : {static_cast<void*>(in_host_), static_cast<void*>(lg_host_), static_cast<void*>(drawn_host_)})
      if (p) cudaFreeHost(p);
  }

  const char* name() const override { return "cuda"; }
  int threads() const override { return 1; }
  std::shared_ptr<Memory> memory() const override { return mem_; }
  Elem kv_elem() const override { return Elem::BF16; }
  // Prefill chunk rows (compare_builds_chunk_h200.json: 2048 / 4096 / 8192 gave 20.7K / 23.7K / 25.9K tok/s at 16K)
  int64_t default_chunk() const override { return 8192; }
  void sync() override { LILY_CUDA_CHECK(cudaStreamSynchronize(st_)); }

  // ---- step brackets ---------------------------------------------------------------------------------------
  bool begin_step(State& st, const DecodeStep& d) override {
    if (in_step_) close_failed_step();
    if (d.draw && !sampler_.ready()) throw std::logic_error("[lily] cuda: a drawing step without sampler_begin");
    if (d.token < 0 && !fused_ok_) throw std::logic_error("[lily] cuda: a device token without fused decode");
    step_ = d;
    in_step_ = true;
    write_inputs(d);
    fused_ = fused_ok_;
    capturing_ = false;
    replay_ = nullptr;
    calls_.clear();
    if (!fused_ || !graph_on_) return true;  // launched one by one (the unfused path embeds host ids: no graph)
    const std::vector<uintptr_t> key = step_key(st, d);
    for (StepGraph& g : graphs_)
      if (g.key == key) {
        replay_ = &g;
        g.last_use = ++graph_clock_;
        return false;
      }
    key_ = key;
    LILY_CUDA_CHECK(cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    return true;
  }

  // The step's logits into slot p = index & 1, then (d.draw) the next token into the next step's input slot
  // (slot 1 - p of the control block) and into the pinned drawn_host_[p].
  void head_step(const DecodeStep& d) override {
    if (!in_step_) throw std::logic_error("[lily] cuda: head_step outside a step");
    issue([this, d] {
      const int p = static_cast<int>(d.index & 1);
      float* lg = dlg_ + p * cfg_.vocab;
      if (!fused_) {
        cuda::rms_norm(st_, x_, w_.final_norm, cfg_.rms_eps, 1, cfg_.hidden, h_);
        cuda::linear(st_, w_.lm_head, h_, cfg_.hidden, 1, lg, cfg_.vocab, false);
        return;
      }
      cuda::gemv::ProjArgs h = dec_.norm_args(w_.final_norm);
      h.nseg = 1;
      h.seg[0] = cuda::decode_seg(w_.lm_head, cuda::gemv::kOStore, lg);
      h.amax = damax_;  // always: the head kernel is then the same whether the step draws or not
      const unsigned nb = cuda::gemv::proj(st_, h);
      if (nb > head_blocks_) throw std::logic_error("[lily] cuda decode: head block count");
      step_launches_ += 1;
      if (!d.draw) return;
      int32_t* next = &dctl_->slot[1 - p].token;
      if (draw_argmax_) cuda::sample::argmax_from_block_keys(st_, damax_, static_cast<int>(nb), next);
      else sampler_.draw(st_, lg, &dctl_->slot[p].uniform, next);
      LILY_CUDA_CHECK(cudaMemcpyAsync(&drawn_host_[p], next, sizeof(int32_t), cudaMemcpyDeviceToHost, st_));
      step_launches_ += draw_argmax_ ? 1 : 3;
    });
  }

  void end_step(State& st, const DecodeStep& d, float* logits) override {
    (void)st;
    if (!in_step_) throw std::logic_error("[lily] cuda: end_step outside a step");
    in_step_ = false;
    const int p = static_cast<int>(d.index & 1);
    if (capturing_) {
      cudaGraph_t g = nullptr;
      const cudaError_t e = cudaStreamEndCapture(st_, &g);
      capturing_ = false;
      if (e != cudaSuccess || g == nullptr) {
        if (g) cudaGraphDestroy(g);
        abandon_capture(cudaGetErrorString(e), /*already_ended=*/true);
      } else {
        replay_ = record(g);
      }
    }
    if (replay_) LILY_CUDA_CHECK(cudaGraphLaunch(replay_->exec, st_));
    replay_ = nullptr;
    calls_.clear();
    LILY_CUDA_CHECK(cudaEventRecord(step_done_[p], st_));
    held_[p] = d.index;
    drew_[p] = d.draw;
    if (logits) copy_logits(p, logits);
  }

  // ---- device draws ----------------------------------------------------------------------------------------
  bool sampler_begin(const SampleOptions& o) override {
    // (a vocabulary past the sampler's grid would only fail after the step ran: the host samples it instead)
    if (!fused_ok_ || cfg_.vocab > int64_t{cuda::sample::kThreads} * cuda::sample::kSpan) return false;
    // Greedy without logit processing is the fused argmax of the head; anything else the sampler's kernels.
    draw_argmax_ = o.temperature == 0.f && o.bias_ids.empty() && o.repetition_penalty == 1.f &&
                   o.presence_penalty == 0.f && o.frequency_penalty == 0.f;
    sampler_.begin(st_, o, static_cast<int32_t>(cfg_.vocab));
    ++sampler_begins_;
    return true;
  }

  int32_t drawn_token(int64_t index) override {
    const int p = static_cast<int>(index & 1);
    if (index < 0 || held_[p] != index || !drew_[p])
      throw std::logic_error("[lily] cuda: drawn_token(" + std::to_string(index) +
                             "): not one of the last two steps, or that step did not draw");
    LILY_CUDA_CHECK(cudaEventSynchronize(step_done_[p]));
    return drawn_host_[p];
  }

  bool step_logits(int64_t index, float* logits) override {
    const int p = static_cast<int>(index & 1);
    if (index < 0 || held_[p] != index) return false;
    copy_logits(p, logits);
    return true;
  }

  // ---- switches --------------------------------------------------------------------------------------------
  // Ablations (Engine.set_backend_flag); each names the technique it turns off or the alternative it picks.
  struct Switch { const char* name; int* field; int lo, hi; };
  std::vector<Switch> switches() {
    return {{"cuda_graph", &graph_on_, 0, 1},       {"routing_sync", &routing_sync_, 0, 1},
            {"gqa_pack", &gqa_pack_, 0, 1},
            {"split_k", &split_k_, 0, 1},          {"deltanet_form", &deltanet_form_, 0, 2},
            {"expert_tile", &expert_tile_, 0, 128}};
  }

  void set_flag(const std::string& name, int64_t value) override {
    for (const Switch& w : switches()) {
      if (name != w.name) continue;
      if (value < w.lo || value > w.hi)
        throw std::invalid_argument("[lily] backend flag '" + name + "' must be in [" + std::to_string(w.lo) + ", " +
                                    std::to_string(w.hi) + "], got " + std::to_string(value));
      if (name == "expert_tile" && value != 0 && value != 16 && value != 32 && value != 64 && value != 128)
        throw std::invalid_argument("[lily] backend flag 'expert_tile' must be 0 (auto), 16, 32, 64 or 128, got " +
                                    std::to_string(value));
      *w.field = static_cast<int>(value);
      sync();
      drop_graphs();  // a recorded step holds the old choices
      return;
    }
    Backend::set_flag(name, value);
  }

  int64_t flag(const std::string& name) const override {
    for (const Switch& w : const_cast<CudaBackend*>(this)->switches())
      if (name == w.name) return *w.field;
    return Backend::flag(name);
  }
  // fused_decode_supported: whether this model's shapes take the fused decode step (a fact of the load, read only)
  std::map<std::string, int64_t> counters() const override {
    return {{"fused_decode_supported", fused_ok_ ? 1 : 0}, {"graph_nodes", graph_nodes_},
            {"graph_kernels", graph_kernels_}, {"graph_captures", graph_captures_},
            {"decode_launches", step_launches_}, {"sampler_begins", sampler_begins_}};
  }

  // ---- sub-blocks ------------------------------------------------------------------------------------------
  void embed(const int32_t* ids, int64_t S) override {
    if (fused_step(S)) {  // the token is in the control block (begin_step, or the previous step's draw)
      issue([this] {
        step_launches_ = 0;
        if (debug_) {  // NaN in every scratch buffer of the step, so a read of something unwritten shows
          for (auto& [p, n] : dec_poison_) cuda::poison(st_, p, n);
          cuda::poison(st_, dlg_ + (step_.index & 1) * cfg_.vocab, cfg_.vocab * sizeof(float));  // not the other
        }                                                                   // slot: the previous step's logits stay held
        cuda::embed(st_, w_.embed, &dctl_->slot[step_.index & 1].token, 1, dec_.b.x);
        step_launches_ += 1;
      });
      return;
    }
    reserve(S);
    LILY_CUDA_CHECK(cudaMemcpyAsync(ids_, ids, S * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
    cuda::embed(st_, w_.embed, ids_, S, x_);
  }

  void deltanet_block(int layer, const RowSegments& segs) override {
    const RowSegment& seg = single_segment(segs);  // (one stream per forward until the M-row kernels land)
    DeltaNetState& st = *seg.deltanet;
    const int64_t S = seg.n;
    const DLayer& L = layer_weights(layer);
    if (fused_step(S)) return issue([this, &L, &st] { step_launches_ += dec_.deltanet(L, st); });
    const int64_t H = cfg_.hidden;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    {  // qkv, z, b, a: one GEMM over their concatenated rows
      const cuda::DLinear parts[] = {L.qkv, L.z, L.b, L.a};
      float* const y[] = {qkv_, z_, b_, a_};
      const int64_t ldy[] = {L.qkv.p.out, L.z.p.out, L.b.p.out, L.a.p.out};
      cuda::linear_concat(st_, L.deltanet_in, parts, 4, h_, H, S, y, ldy);
    }
    const kp::DeltaNetParams p = cuda::deltanet_params(cfg_, S);
    cuda::deltanet_conv(st_, p, qkv_, L.conv_w, st.conv.as<float>(), u_);
    const int form = cuda::deltanet_scan_pick(p, deltanet_form_);
    const size_t scratch = form == cuda::kScanChunked ? cuda::deltanet_chunk_scratch_bytes(p) : 0;  // W, U, decays, S_n
    float* ws = scratch ? s_deltanet_.get<float>(mem_, static_cast<int64_t>((scratch + 3) / 4)) : nullptr;
    cuda::deltanet_scan_norm(st_, p, u_, b_, a_, L.dt_bias, L.a_log, st.ssm.as<float>(), y_, z_, L.deltanet_norm, yb_,
                             form, ws, scratch);  // y_: scratch (the chunked form's fused norm never writes it)
    cuda::linear(st_, L.out, yb_, cfg_.value_dim(), S, x_, H, /*accumulate=*/true);
  }

  void attention_block(int layer, const RowSegments& segs) override {
    const RowSegment& seg = single_segment(segs);
    KVCache& kv = *seg.kv;
    const int64_t pos0 = seg.pos0, S = seg.n;
    const DLayer& L = layer_weights(layer);
    if (fused_step(S) && layer < cfg_.n_layers)
      return issue([this, &L, &kv] {
        step_launches_ += dec_.attention(L, kv, &dctl_->slot[step_.index & 1].pos, split_k_, gqa_pack_);
      });
    const int64_t H = cfg_.hidden, D = cfg_.head_dim;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    {  // q (with its gate), k, v: one GEMM over their concatenated rows
      const cuda::DLinear parts[] = {L.q, L.k, L.v};
      float* const y[] = {qg_, k_, v_};
      const int64_t ldy[] = {L.q.p.out, L.k.p.out, L.v.p.out};
      cuda::linear_concat(st_, L.attn_in, parts, 3, h_, H, S, y, ldy);
    }
    const kp::AttentionParams p = cuda::attention_params(cfg_, pos0, S);
    cuda::attention_prep(st_, p, qg_, k_, v_, L.q_norm, L.k_norm, q_, kv.k.as<bf16>(), kv.v.as<bf16>());
    const kp::AttnSplitParams sp = cuda::attention_plan(p, sm_count_);
    float* part = part_.get<float>(mem_, S * cfg_.n_heads * sp.n_splits * (D + 2));
    cuda::attention(st_, p, sp, q_, qg_, kv.k.as<bf16>(), kv.v.as<bf16>(), part, ob_);
    cuda::linear(st_, L.o, ob_, cfg_.n_heads * D, S, x_, H, /*accumulate=*/true);
  }

  void moe_block(int layer, int64_t S) override {
    const DLayer& L = layer_weights(layer);
    if (fused_step(S) && layer < cfg_.n_layers) return issue([this, &L] { step_launches_ += dec_.moe(L); });
    const int64_t H = cfg_.hidden, Is = cfg_.shared_inter;
    const int k = cfg_.top_k;
    const kp::MoeParams p{cfg_.hidden, cfg_.n_experts, cfg_.top_k, cfg_.moe_inter, cfg_.shared_inter,
                          cfg_.norm_topk_prob ? 1 : 0, S};
    cuda::rms_norm(st_, x_, L.post_norm, cfg_.rms_eps, S, H, h_);
    // The router and the shared expert's gate apart: concatenated (257 rows), the gate's one row took a third
    // 128-row column block of the 8-bit GEMM (68 us per layer of a 4K prefill on the H200); alone the router fills
    // two and the gate is the one-output kernel's (1.014x at 4K, compare_builds_tenth_h200.json).
    cuda::linear(st_, L.router, h_, H, S, logits_, cfg_.n_experts);
    cuda::linear(st_, L.sh_expert_gate, h_, H, S, sg_, 1);
    cuda::moe_route(st_, p, logits_, top_idx_, top_w_);
    cuda::linear_silu_mul(st_, L.sh_gate, L.sh_up, h_, H, S, sact_, Is);
    cuda::linear(st_, L.sh_down, sact_, Is, S, shd_, H, false);
    if (S == 1) {
      cuda::experts_gate_up(st_, L.gate, L.up, top_idx_, k, h_, act_);
      cuda::experts_down(st_, L.down, top_idx_, top_w_, k, act_, d_);
    } else {
      const cuda::SortBuffers b{pair_row_, pair_id_, pair_w_, n_tiles_, tile_expert_, tile_row0_, tile_rows_, sort_base_};
      cuda::moe_experts(st_, p, L.gate, L.up, L.down, h_, top_idx_, top_w_, b, act_, d_, expert_tile_, routing_sync_);
    }
    cuda::moe_combine(st_, p, shd_, sg_, d_, x_);
  }

  void read_residual(int64_t S, float* out) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(out, x_, S * cfg_.hidden * sizeof(float), cudaMemcpyDeviceToHost, st_));
    sync();
  }

  void head(int64_t row0, int64_t n, float* logits) override {
    const int64_t H = cfg_.hidden, V = cfg_.vocab;
    // Sub-chunks bound the device logits buffer at full vocabulary.
    constexpr int64_t kHeadRows = 256;
    for (int64_t r = 0; r < n; r += kHeadRows) {
      const int64_t m = std::min(kHeadRows, n - r);
      float* lg = lg_.get<float>(mem_, m * V);
      cuda::rms_norm(st_, x_ + (row0 + r) * H, w_.final_norm, cfg_.rms_eps, m, H, h_);
      cuda::linear(st_, w_.lm_head, h_, H, m, lg, V, false);
      LILY_CUDA_CHECK(cudaMemcpyAsync(logits + r * V, lg, m * V * sizeof(float), cudaMemcpyDeviceToHost, st_));
      sync();
    }
  }

  // ---- the MTP head (mtp_head.cuh): not reported (has_mtp() false) until it has run on a device (issue 43) ----
  void keep_hidden(int64_t S) override { mtp_.keep_hidden(x_, w_.final_norm, S); }
  void store_hidden(int64_t row, Buffer& dst) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst.as<float>(), mtp_.hidden(row), cfg_.hidden * sizeof(float),
                                    cudaMemcpyDeviceToDevice, st_));
  }
  void mtp_embed(const int32_t* ids, int64_t n, const Buffer* prev, MtpHidden src) override {
    std::vector<const float*> rows;
    if (src == MtpHidden::Draft) {
      if (n != 1 || prev || !mtp_.draft_hidden())
        throw std::logic_error("[lily] backend 'cuda': a chained MTP row needs n == 1 after mtp_head");
      rows.push_back(mtp_.draft_hidden());
    } else {
      for (int64_t i = 0; i < n; ++i)
        rows.push_back(prev ? (i == 0 ? prev->as<float>() : mtp_.hidden(i - 1)) : mtp_.hidden(i));
    }
    mtp_embed_rows(ids, rows);
  }
  bool mtp_embed_each(const int32_t* ids, int64_t n, const std::vector<const Buffer*>& prev) override {
    std::vector<const float*> rows;
    for (int64_t i = 0; i < n; ++i) rows.push_back(prev.at(static_cast<size_t>(i))->as<float>());
    mtp_embed_rows(ids, rows);
    return true;
  }
  void mtp_head(int64_t row0, int64_t n, float* logits) override {
    const int64_t V = cfg_.vocab;
    float* lg = lg_.get<float>(mem_, n * V);
    mtp_.head(mtp_weights(), w_.lm_head, x_ + row0 * cfg_.hidden, n, lg);
    LILY_CUDA_CHECK(cudaMemcpyAsync(logits, lg, n * V * sizeof(float), cudaMemcpyDeviceToHost, st_));
    sync();
  }

 private:
  // The head's input rows from host tokens (a step's device draw does not reach the head here yet).
  void mtp_embed_rows(const int32_t* ids, const std::vector<const float*>& rows) {
    const int64_t n = static_cast<int64_t>(rows.size());
    for (int64_t i = 0; i < n; ++i)
      if (ids[i] < 0) throw std::logic_error("[lily] backend 'cuda': the MTP head takes host tokens");
    reserve(n);
    LILY_CUDA_CHECK(cudaMemcpyAsync(ids_, ids, n * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
    mtp_.embed(mtp_weights(), w_.embed, ids_, rows, x_);
  }
  // The MTP head's weights, copied on first use.
  const cuda::DeviceMtpWeights& mtp_weights() {
    if (!mtp_w_) mtp_w_ = std::make_unique<cuda::DeviceMtpWeights>(cuda::upload_mtp_weights(cfg_, host_w_, mem_));
    return *mtp_w_;
  }
  // Layer `layer`'s weights: the MTP head's decoder layer at cfg.n_layers.
  const DLayer& layer_weights(int layer) { return layer == cfg_.n_layers ? mtp_weights().layer : w_.layers[layer]; }

  // Tile-map capacity for S rows at the smallest expert tile (any tile size fits).
  int64_t max_tiles(int64_t S) const { return cuda::grouped_max_tiles(S * cfg_.top_k, cfg_.n_experts, 16); }

  // ---- decode steps: inputs, graphs (the fused sub-blocks: decode_layers.cuh) -----------------------------
  bool fused_step(int64_t S) const { return in_step_ && fused_ && S == 1; }

  // The step's inputs into control slot p: position and uniform always, the token when the host gives it (else
  // the previous step's draw is already there). From a pinned ring of two: the copy of step index - 2 (the last
  // one that used this host slot) has run before it is overwritten.
  void write_inputs(const DecodeStep& d) {
    const int p = static_cast<int>(d.index & 1);
    LILY_CUDA_CHECK(cudaEventSynchronize(in_copied_[p]));
    StepSlot& h = in_host_[p];
    h.token = d.token;
    h.pos = static_cast<int32_t>(d.position);
    h.uniform = d.uniform;
    // slot layout {token, pos, uniform}: copy from the token on, or from pos on
    const size_t off = d.token >= 0 ? 0 : offsetof(StepSlot, pos);
    const size_t bytes = offsetof(StepSlot, uniform) + sizeof(float) - off;
    LILY_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(&dctl_->slot[p]) + off,
                                    reinterpret_cast<const char*>(&h) + off, bytes, cudaMemcpyHostToDevice, st_));
    LILY_CUDA_CHECK(cudaEventRecord(in_copied_[p], st_));
  }

  void abandon() override { if (in_step_) close_failed_step(); }

  // A step that threw between its brackets left them open (the engine does not call end_step then): drop its
  // capture; what it issued directly has run or will, and its slot's token and logits are no longer held.
  void close_failed_step() {
    if (capturing_) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(st_, &g);
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
    }
    const int p = static_cast<int>(step_.index & 1);
    held_[p] = -1;
    in_step_ = capturing_ = false;
    replay_ = nullptr;
    calls_.clear();
  }

  // Runs one piece of a step's issue; while capturing, also keeps it, so a capture that fails can be issued
  // again without the graph (capture enqueues nothing: the state is untouched until the step really runs).
  void issue(std::function<void()> f) {
    if (!capturing_) return f();
    calls_.push_back(f);
    try {
      f();
    } catch (const std::exception& e) {
      abandon_capture(e.what(), /*already_ended=*/false);
    }
  }

  // Ends a failed capture and issues what the step has queued so far directly; decoding goes on without graphs.
  void abandon_capture(const char* why, bool already_ended) {
    if (!already_ended) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(st_, &g);
      if (g) cudaGraphDestroy(g);
    }
    cudaGetLastError();
    capturing_ = false;
    graph_on_ = 0;
    std::fprintf(stderr, "[lily] cuda: decode graph capture failed (%s); continuing without a graph\n", why);
    std::vector<std::function<void()>> calls;
    calls.swap(calls_);
    for (auto& f : calls) f();  // a call that fails for a reason of its own throws again, now to the caller
  }

  // What a recorded step depends on besides the backend's own fixed buffers: the state's arrays and KV capacity,
  // the control slot (parity), whether and how it draws, and the sampler's buffers.
  std::vector<uintptr_t> step_key(const State& st, const DecodeStep& d) const {
    std::vector<uintptr_t> k{static_cast<uintptr_t>(d.index & 1), static_cast<uintptr_t>(d.draw),
                             static_cast<uintptr_t>(d.draw && draw_argmax_)};
    for (const auto& c : st.kv)
      k.insert(k.end(), {reinterpret_cast<uintptr_t>(c.k.data()), reinterpret_cast<uintptr_t>(c.v.data()),
                         static_cast<uintptr_t>(c.capacity)});
    for (const auto& s : st.deltanet)
      k.insert(k.end(), {reinterpret_cast<uintptr_t>(s.ssm.data()), reinterpret_cast<uintptr_t>(s.conv.data())});
    if (d.draw && !draw_argmax_) {
      const std::vector<uintptr_t> sb = sampler_.buffers();
      k.insert(k.end(), sb.begin(), sb.end());
    }
    return k;
  }

  // Instantiates a captured step and keeps it (the least recently used one goes when kMaxGraphs are held).
  StepGraph* record(cudaGraph_t g) {
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    size_t n = 0;
    if (e == cudaSuccess) LILY_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    if (n) LILY_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
    int64_t kernels = 0;
    for (auto nd : nodes) {
      cudaGraphNodeType t;
      LILY_CUDA_CHECK(cudaGraphNodeGetType(nd, &t));
      kernels += t == cudaGraphNodeTypeKernel;
    }
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
      abandon_capture(cudaGetErrorString(e), /*already_ended=*/true);
      return nullptr;
    }
    graph_nodes_ = static_cast<int64_t>(n);
    graph_kernels_ = kernels;
    ++graph_captures_;
    if (graphs_.size() >= kMaxGraphs) {
      auto old = std::min_element(graphs_.begin(), graphs_.end(),
                                  [](const StepGraph& a, const StepGraph& b) { return a.last_use < b.last_use; });
      sync();  // it may still run
      cudaGraphExecDestroy(old->exec);
      graphs_.erase(old);
    }
    graphs_.push_back(StepGraph{key_, exec, ++graph_clock_});
    return &graphs_.back();
  }

  void drop_graphs() {
    for (StepGraph& g : graphs_) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  // Logits of step slot p to the host, through pinned memory (a pageable copy of ~1 MB is several times slower).
  void copy_logits(int p, float* logits) {
    const size_t bytes = cfg_.vocab * sizeof(float);
    LILY_CUDA_CHECK(cudaMemcpyAsync(lg_host_, dlg_ + p * cfg_.vocab, bytes, cudaMemcpyDeviceToHost, st_));
    sync();
    std::memcpy(logits, lg_host_, bytes);
  }

  template <class T>
  T* dalloc(int64_t n, bool poison) {
    dec_bufs_.emplace_back(mem_, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T));
    if (poison) dec_poison_.emplace_back(dec_bufs_.back().data(), dec_bufs_.back().bytes());
    return dec_bufs_.back().as<T>();
  }

  // Dedicated decode scratch: fixed pointers for the lifetime of the backend (a recorded step holds them).
  void alloc_decode() {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim, Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads;
    dctl_ = dalloc<StepCtl>(1, false);
    dlg_ = dalloc<float>(2 * cfg_.vocab, false);  // one logits row per step slot (debug: poisoned per slot)
    for (cudaEvent_t* e : {&step_done_[0], &step_done_[1], &in_copied_[0], &in_copied_[1]})
      LILY_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    LILY_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&in_host_), 2 * sizeof(StepSlot)));
    LILY_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&drawn_host_), 2 * sizeof(int32_t)));
    LILY_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&lg_host_), cfg_.vocab * sizeof(float)));
    if (!fused_ok_) return;
    cuda::DecodeBuffers& b = dec_.b;
    b.x = dalloc<float>(H, true);
    b.h = dalloc<bf16>(H, true);
    b.u = dalloc<float>(cfg_.conv_dim(), true);
    b.z = dalloc<float>(cfg_.value_dim(), true);
    b.y = dalloc<float>(cfg_.value_dim(), true);
    b.yb = dalloc<bf16>(cfg_.value_dim(), true);
    b.head_done = dalloc<int32_t>(cfg_.deltanet_v_heads, false);  // deltanet_step's counters: zero, and left zero
    LILY_CUDA_CHECK(cudaMemset(b.head_done, 0, std::max<int64_t>(cfg_.deltanet_v_heads, 1) * sizeof(int32_t)));
    b.b = dalloc<float>(cfg_.deltanet_v_heads, true);
    b.a = dalloc<float>(cfg_.deltanet_v_heads, true);
    b.qg = dalloc<float>(2 * Hq * D, true);
    b.q = dalloc<float>(Hq * D, true);
    b.k = dalloc<float>(Hkv * D, true);
    b.v = dalloc<float>(Hkv * D, true);
    b.ob = dalloc<bf16>(Hq * D, true);
    b.router = dalloc<float>(cfg_.n_experts, true);
    b.top_idx = dalloc<int32_t>(cfg_.top_k, false);
    b.top_w = dalloc<float>(cfg_.top_k, true);
    b.act = dalloc<bf16>(static_cast<int64_t>(cfg_.top_k) * cfg_.moe_inter, true);
    b.sact = dalloc<bf16>(cfg_.shared_inter, true);
    b.sgate = dalloc<float>(1, true);
    b.max_splits = std::max<int64_t>(1, (2 * sm_count_ + std::max(Hkv, int64_t{1}) - 1) / std::max(Hkv, int64_t{1}));
    b.part = dalloc<float>(Hq * b.max_splits * (D + 2), true);
    head_blocks_ = cuda::gemv::head_blocks(cfg_.vocab);
    damax_ = dalloc<unsigned long long>(head_blocks_, false);
  }

  void check_supported() const {
    auto fail = [](const std::string& m) { throw std::invalid_argument("[lily] backend 'cuda': " + m); };
    if (cfg_.n_experts > 256) fail("more than 256 experts");
    if (cfg_.n_attention_layers() && cfg_.head_dim != 32 && cfg_.head_dim != 64 && cfg_.head_dim != 128 &&
        cfg_.head_dim != 256)
      fail("head_dim must be 32, 64, 128 or 256");
    if (cfg_.n_deltanet_layers() && cfg_.deltanet_k_dim > 128) fail("linear_key_head_dim > 128");
  }

  // Scratch sized for a chunk of S rows; NaN-poisoned in debug mode so unwritten reads show.
  void reserve(int64_t S) {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim, k = cfg_.top_k, P = S * k;
    ids_ = s_ids_.get<int32_t>(mem_, S);
    x_ = s_x_.get<float>(mem_, S * H);
    h_ = s_h_.get<bf16>(mem_, S * H);
    qkv_ = s_qkv_.get<float>(mem_, S * cfg_.conv_dim());
    u_ = s_u_.get<float>(mem_, S * cfg_.conv_dim());
    z_ = s_z_.get<float>(mem_, S * cfg_.value_dim());
    y_ = s_y_.get<float>(mem_, S * cfg_.value_dim());
    yb_ = s_yb_.get<bf16>(mem_, S * cfg_.value_dim());
    b_ = s_b_.get<float>(mem_, S * cfg_.deltanet_v_heads);
    a_ = s_a_.get<float>(mem_, S * cfg_.deltanet_v_heads);
    qg_ = s_qg_.get<float>(mem_, S * 2 * cfg_.n_heads * D);
    q_ = s_q_.get<float>(mem_, S * cfg_.n_heads * D);
    k_ = s_k_.get<float>(mem_, S * cfg_.n_kv_heads * D);
    v_ = s_v_.get<float>(mem_, S * cfg_.n_kv_heads * D);
    ob_ = s_ob_.get<bf16>(mem_, S * cfg_.n_heads * D);
    logits_ = s_logits_.get<float>(mem_, S * cfg_.n_experts);
    top_idx_ = s_top_idx_.get<int32_t>(mem_, P);
    top_w_ = s_top_w_.get<float>(mem_, P);
    pair_row_ = s_pair_row_.get<int32_t>(mem_, P);
    pair_id_ = s_pair_id_.get<int32_t>(mem_, P);
    pair_w_ = s_pair_w_.get<float>(mem_, P);
    n_tiles_ = s_n_tiles_.get<int32_t>(mem_, 1);
    tile_expert_ = s_tile_expert_.get<int32_t>(mem_, max_tiles(S));
    tile_row0_ = s_tile_row0_.get<int32_t>(mem_, max_tiles(S));
    tile_rows_ = s_tile_rows_.get<int32_t>(mem_, max_tiles(S));
    sort_base_ = s_sort_.get<int32_t>(mem_, cuda::moe_sort_scratch(P, cfg_.n_experts));
    act_ = s_act_.get<bf16>(mem_, P * cfg_.moe_inter);
    d_ = s_d_.get<bf16>(mem_, P * H);
    sact_ = s_sact_.get<bf16>(mem_, S * cfg_.shared_inter);
    shd_ = s_shd_.get<float>(mem_, S * H);
    sg_ = s_sg_.get<float>(mem_, S);
    if (debug_)
      for (Scratch* s : {&s_x_, &s_h_, &s_qkv_, &s_u_, &s_z_, &s_y_, &s_yb_, &s_b_, &s_a_, &s_qg_, &s_q_, &s_k_, &s_v_,
                         &s_ob_, &s_logits_, &s_top_w_, &s_pair_w_, &s_act_, &s_d_, &s_sact_, &s_shd_, &s_sg_,
                         &part_, &lg_})
        cuda::poison(st_, s->buf.data(), s->buf.bytes());
  }

  const Config& cfg_;
  const Weights& host_w_;  // the engine's (the MTP head's tensors are copied from it on first use)
  std::shared_ptr<CudaMemory> mem_;
  cudaStream_t st_;
  bool debug_;
  cuda::MtpHead mtp_;
  int sm_count_ = 0;
  cuda::DeviceWeights w_;  // device copies of the weights
  std::unique_ptr<cuda::DeviceMtpWeights> mtp_w_;

  Scratch s_ids_, s_x_, s_h_, s_qkv_, s_u_, s_z_, s_y_, s_yb_, s_b_, s_a_, s_qg_, s_q_, s_k_, s_v_, s_ob_, s_logits_,
      s_top_idx_, s_top_w_, s_pair_row_, s_pair_id_, s_pair_w_, s_n_tiles_, s_tile_expert_, s_tile_row0_,
      s_tile_rows_, s_sort_, s_act_, s_d_, s_sact_, s_shd_, s_sg_, part_, lg_, s_deltanet_;
  int32_t* ids_ = nullptr;
  float* x_ = nullptr;                                  // [S, H] residual stream
  bf16* h_ = nullptr;                                   // [S, H] normed input of the sub-block
  float *qkv_ = nullptr, *u_ = nullptr;                 // [S, C]
  float *z_ = nullptr, *y_ = nullptr;                   // [S, Hv*Dv]
  bf16* yb_ = nullptr;                                  // [S, Hv*Dv]
  float *b_ = nullptr, *a_ = nullptr;                   // [S, Hv]
  float *qg_ = nullptr, *q_ = nullptr;                  // [S, Hq, 2D], [S, Hq, D]
  float *k_ = nullptr, *v_ = nullptr;                   // [S, Hkv*D]
  bf16* ob_ = nullptr;                                  // [S, Hq*D]
  float* logits_ = nullptr;                             // [S, E]
  int32_t* top_idx_ = nullptr;                          // [S, k]
  float* top_w_ = nullptr;                              // [S, k]
  int32_t *pair_row_ = nullptr, *pair_id_ = nullptr;    // [S*k]
  float* pair_w_ = nullptr;                             // [S*k]
  int32_t *n_tiles_ = nullptr, *tile_expert_ = nullptr, *tile_row0_ = nullptr, *tile_rows_ = nullptr;
  int32_t* sort_base_ = nullptr;                        // moe_sort's per-block counts / positions
  bf16* act_ = nullptr;                                 // [S*k, I]
  bf16* d_ = nullptr;                                   // [S*k, H]
  bf16* sact_ = nullptr;                                // [S, Is]
  float *shd_ = nullptr, *sg_ = nullptr;                // [S, H], [S]

  // Ablation switches (set_flag): defaults are the fast paths.
  int graph_on_ = 1;        // decode steps recorded as CUDA graphs and replayed
  int routing_sync_ = 0;    // prefill MoE: host-synchronised tile count instead of a device-sized grid
  int gqa_pack_ = 1;        // decode attention: the query heads of a KV head share each K/V load (tensor cores)
  int split_k_ = 1;         // decode attention: keys split over blocks (flash-decoding)
  int expert_tile_ = 0;     // prefill MoE rows per expert tile: 0 auto, else 16/32/64/128
  int deltanet_form_ = 0;   // DeltaNet prefill scan: 0 auto, 1 sequential, 2 chunked (cuda::DeltaNetScanForm)

  // decode steps (dedicated scratch, one token)
  bool fused_ok_ = false;   // the config fits the fused decode kernels
  bool in_step_ = false, fused_ = false, capturing_ = false;
  bool draw_argmax_ = false;  // sampler_begin: greedy without logit processing (the head's fused argmax)
  DecodeStep step_;
  std::vector<std::function<void()>> calls_;  // the current capture's pieces (issue)
  std::vector<uintptr_t> key_;                // the current capture's key
  StepGraph* replay_ = nullptr;
  static constexpr size_t kMaxGraphs = 8;     // 2 parities x draw modes x a few states
  std::vector<StepGraph> graphs_;
  int64_t graph_clock_ = 0;
  int64_t held_[2] = {-1, -1};     // step index whose logits / draw slot p holds
  bool drew_[2] = {false, false};
  cudaEvent_t step_done_[2] = {nullptr, nullptr};  // recorded after step slot p's work
  cudaEvent_t in_copied_[2] = {nullptr, nullptr};  // recorded after the copy from in_host_[p]
  std::vector<Buffer> dec_bufs_;
  std::vector<std::pair<void*, size_t>> dec_poison_;
  StepCtl* dctl_ = nullptr;
  StepSlot* in_host_ = nullptr;  // pinned [2]
  int32_t* drawn_host_ = nullptr;           // pinned [2]: the token step slot p drew
  float* lg_host_ = nullptr;                // pinned [V]
  cuda::sample::DeviceSampler sampler_;
  cuda::DecodeLayers dec_;  // the fused sub-blocks and their buffers
  float* dlg_ = nullptr;    // [2, V] logits per step slot
  unsigned long long* damax_ = nullptr;
  int64_t head_blocks_ = 0;
  int64_t graph_nodes_ = 0, graph_kernels_ = 0, graph_captures_ = 0, step_launches_ = 0;
  int64_t sampler_begins_ = 0;  // samplers accepted (device-mode streams begun or resumed)
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Config& cfg, const Weights& w, bool debug) {
  if (cuda::device_count() == 0)
    throw std::runtime_error("[lily] backend 'cuda': no CUDA device is visible (check the driver and "
                             "CUDA_VISIBLE_DEVICES), or use backend='cpu'");
  return std::make_unique<CudaBackend>(cfg, w, debug);
}

}  // namespace lily
