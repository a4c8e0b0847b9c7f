// CUDA backend: bf16 activations into every matrix product (fp32 accumulate), fp32 residual stream, norms,
// softmax and DeltaNet state; bf16 KV cache. Weights are copied to the device once at construction.
// Everything of a chunk is queued on one stream; the host waits only in head/read_residual/sync.
//
// Decode (one token, decode_step / decode_greedy): the fused kernels of decode.cu (norms folded into the
// projections, projections that read the same row in one launch, MoE combine fused into the down projection,
// conv into the in-projection) on dedicated scratch, with the token and position in a device control block so
// the whole step (embed -> layers -> head -> argmax) is one replayable CUDA graph. Flag "cuda_decode":
// 0 = the sub-block path (engine layer loop), 1 = fused kernels launched one by one, 2 = fused + CUDA graph
// (default; env LILY_CUDA_DECODE=legacy|fused|graph or 0|1|2 sets the default).
#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "cuda/cuda_memory.h"
#include "cuda/decode.cuh"
#include "cuda/kernels.cuh"
#include "cuda/gemm_mma.cuh"
#include "cuda/linear.cuh"
#include "cuda/runtime.h"
#include "cuda/sample.cuh"

namespace lily {
namespace {

using cuda::bf16;
using cuda::DLinear;

struct DLayer {
  const float* in_norm = nullptr;
  const float* post_norm = nullptr;
  DLinear qkv, z, b, a, out;  // DeltaNet
  const float *conv_w = nullptr, *dt_bias = nullptr, *a_log = nullptr, *dn_norm = nullptr;
  DLinear q, k, v, o;  // attention
  const float *q_norm = nullptr, *k_norm = nullptr;
  DLinear router, gate, up, down, sh_gate, sh_up, sh_down, sh_expert_gate;  // MoE
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

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Config& cfg, const Weights& w, bool debug)
      : cfg_(cfg), mem_(std::make_shared<CudaMemory>()), st_(mem_->stream()), debug_(debug) {
    check_supported();
    LILY_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, 0));
    upload(w);
    decode_mode_ = default_decode_mode();
    fused_ok_ = fused_supported();
    if (fused_ok_) alloc_decode();
  }

  ~CudaBackend() override {
    drop_graph();
    if (ctl_host_) cudaFreeHost(ctl_host_);
    if (lg_host_) cudaFreeHost(lg_host_);
  }

  const char* name() const override { return "cuda"; }
  int threads() const override { return 1; }
  std::shared_ptr<Memory> memory() const override { return mem_; }
  Elem kv_elem() const override { return Elem::BF16; }
  int64_t default_chunk() const override { return 2048; }
  void sync() override { LILY_CUDA_CHECK(cudaStreamSynchronize(st_)); }

  bool decode_step(State& st, int32_t token, float* logits) override {
    if (decode_mode_ == 0 || !fused_ok_) return false;
    *ctl_host_ = cuda::dec::Ctl{token, static_cast<int32_t>(st.position), 0, 0, 0.f};
    LILY_CUDA_CHECK(cudaMemcpyAsync(dctl_, ctl_host_, sizeof(cuda::dec::Ctl), cudaMemcpyHostToDevice, st_));
    run_step(st);
    // Through pinned memory: a pageable device-to-host copy of the 1 MB of logits is several times slower.
    if (logits)
      LILY_CUDA_CHECK(cudaMemcpyAsync(lg_host_, dlg_, cfg_.vocab * sizeof(float), cudaMemcpyDeviceToHost, st_));
    sync();
    if (logits) std::memcpy(logits, lg_host_, cfg_.vocab * sizeof(float));
    return true;
  }

  bool decode_greedy(State& st, int32_t token, int64_t n, int32_t* out) override {
    if (decode_mode_ == 0 || !fused_ok_) return false;
    for (int64_t done = 0; done < n;) {
      const int64_t m = std::min<int64_t>(kOutCap, n - done);
      // The first batch sets token and position; later ones only reset the output index (the device advanced
      // token and position itself).
      *ctl_host_ = cuda::dec::Ctl{token, static_cast<int32_t>(st.position), 0, static_cast<int32_t>(m), 0.f};
      const size_t off = done == 0 ? 0 : offsetof(cuda::dec::Ctl, step);
      LILY_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(dctl_) + off, reinterpret_cast<char*>(ctl_host_) + off,
                                      sizeof(cuda::dec::Ctl) - off, cudaMemcpyHostToDevice, st_));
      for (int64_t i = 0; i < m; ++i) run_step(st);
      LILY_CUDA_CHECK(cudaMemcpyAsync(out + done, dout_, m * sizeof(int32_t), cudaMemcpyDeviceToHost, st_));
      sync();
      done += m;
    }
    return true;
  }

  bool sampler_begin(const SampleOptions& o) override {
    // (a vocabulary past the sampler's grid would only fail after the step ran: the host samples it instead)
    if (decode_mode_ == 0 || !fused_ok_ || cfg_.vocab > int64_t{cuda::sample::kThreads} * cuda::sample::kSpan)
      return false;
    sampler_.begin(st_, o, static_cast<int32_t>(cfg_.vocab));
    return true;
  }

  // The step's graph ends with the argmax in dctl_->token; the sampler overwrites it with its draw.
  bool decode_sample(State& st, int32_t token, float uniform, int32_t* next) override {
    if (decode_mode_ == 0 || !fused_ok_ || !sampler_.ready()) return false;
    *ctl_host_ = cuda::dec::Ctl{token, static_cast<int32_t>(st.position), 0, 0, uniform};
    LILY_CUDA_CHECK(cudaMemcpyAsync(dctl_, ctl_host_, sizeof(cuda::dec::Ctl), cudaMemcpyHostToDevice, st_));
    run_step(st);
    sampler_.draw(st_, dlg_, &dctl_->uniform, &dctl_->token);
    LILY_CUDA_CHECK(cudaMemcpyAsync(&ctl_host_->token, &dctl_->token, sizeof(int32_t), cudaMemcpyDeviceToHost, st_));
    sync();
    *next = ctl_host_->token;
    return true;
  }

  bool decode_logits(float* logits) override {
    if (!fused_ok_ || !dlg_) return false;
    LILY_CUDA_CHECK(cudaMemcpyAsync(lg_host_, dlg_, cfg_.vocab * sizeof(float), cudaMemcpyDeviceToHost, st_));
    sync();
    std::memcpy(logits, lg_host_, cfg_.vocab * sizeof(float));
    return true;
  }

  // Switches for ablations and debugging (Engine.set_backend_flag); each names the technique it turns off.
  struct Switch {
    const char* name;
    int* field;
    int lo, hi;
  };
  std::array<Switch, 14> switches() {
    return {{{"cuda_decode", &decode_mode_, 0, 2}, {"gemv_impl", &gemv_impl_, 0, 4}, {"pdl", &pdl_, 0, 1},
             {"routing_sync", &routing_sync_, 0, 1}, {"gqa_pack", &gqa_pack_, 0, 1}, {"split_k", &split_k_, 0, 1},
             {"expert_tile", &expert_tile_, 0, 128}, {"gemm_impl", &gemm_impl_, 0, 1}, {"attn_impl", &attn_impl_, 0, 1},
             {"dn_form", &dn_form_, 0, 4}, {"l2_prefetch", &l2_prefetch_, 0, 1}, {"l2_ahead", &l2_ahead_, 0, 1},
             {"attn_pipe", &attn_pipe_, 0, 1}, {"attn_decode_tc", &attn_decode_tc_, 0, 1}}};
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
      drop_graph();  // a captured step holds the old choices
      return;
    }
    Backend::set_flag(name, value);
  }

  int64_t flag(const std::string& name) const override {
    for (const Switch& w : const_cast<CudaBackend*>(this)->switches())
      if (name == w.name) return *w.field;
    if (name == "fused_decode_supported") return fused_ok_ ? 1 : 0;
    if (name == "graph_nodes") return graph_nodes_;
    if (name == "graph_kernels") return graph_kernels_;
    if (name == "graph_captures") return graph_captures_;
    if (name == "decode_launches") return step_launches_;
    return Backend::flag(name);
  }

  void embed(const int32_t* ids, int64_t S) override {
    reserve(S);
    LILY_CUDA_CHECK(cudaMemcpyAsync(ids_, ids, S * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
    cuda::embed(st_, embed_, ids_, S, x_);
  }

  void deltanet_block(int layer, DeltaNetState& st, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.qkv, h_, H, S, qkv_, L.qkv.p.out, false, gemm_impl_);
    cuda::linear(st_, L.z, h_, H, S, z_, L.z.p.out, false, gemm_impl_);
    cuda::linear(st_, L.b, h_, H, S, b_, L.b.p.out, false, gemm_impl_);
    cuda::linear(st_, L.a, h_, H, S, a_, L.a.p.out, false, gemm_impl_);
    const kp::DeltaNetParams p{cfg_.lin_k_heads, cfg_.lin_v_heads, cfg_.lin_k_dim, cfg_.lin_v_dim, cfg_.conv_kernel,
                               cfg_.conv_dim(), cfg_.rms_eps, 1e-6f, S};
    cuda::deltanet_conv(st_, p, qkv_, L.conv_w, st.conv.as<float>(), u_);
    const int form = cuda::deltanet_scan_pick(p, dn_form_);
    const size_t scratch = form == cuda::kScanChunked || form == cuda::kScanChunkedFp32
                               ? cuda::deltanet_chunk_scratch_bytes(p) : 0;  // chunked forms' W, U, P, decays
    float* dn_scratch = scratch ? s_dn_.get<float>(mem_, static_cast<int64_t>((scratch + 3) / 4)) : nullptr;
    cuda::deltanet_scan(st_, p, u_, b_, a_, L.dt_bias, L.a_log, st.ssm.as<float>(), y_, form, dn_scratch, scratch);
    cuda::deltanet_gated_norm(st_, p, y_, z_, L.dn_norm, yb_);
    cuda::linear(st_, L.out, yb_, cfg_.value_dim(), S, x_, H, /*accumulate=*/true, gemm_impl_);
  }

  void attention_block(int layer, KVCache& kv, int64_t pos0, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden, D = cfg_.head_dim;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.q, h_, H, S, qg_, L.q.p.out, false, gemm_impl_);
    cuda::linear(st_, L.k, h_, H, S, k_, L.k.p.out, false, gemm_impl_);
    cuda::linear(st_, L.v, h_, H, S, v_, L.v.p.out, false, gemm_impl_);
    const kp::AttentionParams p{cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim, cfg_.rotary_dim,
                                static_cast<float>(cfg_.rope_theta), cfg_.rms_eps,
                                1.f / std::sqrt(static_cast<float>(D)), 0, pos0, S};
    cuda::attention_prep(st_, p, qg_, k_, v_, L.q_norm, L.k_norm, q_, kv.k.as<bf16>(), kv.v.as<bf16>());
    const kp::AttnSplitParams sp = cuda::attention_plan(p, sm_count_, attn_impl_);
    float* part = part_.get<float>(mem_, S * cfg_.n_heads * sp.n_splits * (D + 2));
    cuda::attention(st_, p, sp, q_, qg_, kv.k.as<bf16>(), kv.v.as<bf16>(), part, ob_, nullptr, attn_impl_,
                    attn_pipe_);
    cuda::linear(st_, L.o, ob_, cfg_.n_heads * D, S, x_, H, /*accumulate=*/true, gemm_impl_);
  }

  void moe_block(int layer, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden, I = cfg_.moe_inter, Is = cfg_.shared_inter;
    const int k = cfg_.top_k;
    const kp::MoeParams p{cfg_.hidden, cfg_.n_experts, cfg_.top_k, cfg_.moe_inter, cfg_.shared_inter,
                          cfg_.norm_topk_prob ? 1 : 0, S};
    cuda::rms_norm(st_, x_, L.post_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.router, h_, H, S, logits_, cfg_.n_experts, false, gemm_impl_);
    cuda::moe_route(st_, p, logits_, top_idx_, top_w_);
    cuda::linear_silu_mul(st_, L.sh_gate, L.sh_up, h_, H, S, sact_, Is, gemm_impl_);
    cuda::linear(st_, L.sh_down, sact_, Is, S, shd_, H, false, gemm_impl_);
    cuda::linear(st_, L.sh_expert_gate, h_, H, S, sg_, 1, false, gemm_impl_);
    if (S == 1) {
      cuda::experts_gate_up(st_, L.gate, L.up, top_idx_, k, h_, act_);
      cuda::experts_down(st_, L.down, top_idx_, top_w_, k, act_, d_);
    } else {
      // Rows per expert tile from the mean rows per expert (or the ablation's fixed size); the wmma GEMM holds
      // at most kGemmBM rows per tile.
      int tr = expert_tile_ ? expert_tile_ : cuda::pick_expert_tile(S * k, cfg_.n_experts);
      const bool mma = gemm_impl_ == cuda::kGemmImplMma && cuda::gemm_mma_supported(L.gate, &L.up, h_, H) &&
                       cuda::gemm_mma_supported(L.down, nullptr, act_, cfg_.moe_inter);
      if (!mma) tr = std::min(tr, cuda::kGemmBM);  // the wmma GEMM (also the fallback) holds <= 64 rows
      cuda::moe_sort(st_, p, top_idx_, top_w_, tr, pair_row_, pair_id_, pair_w_, n_tiles_, tile_expert_, tile_row0_,
                     tile_rows_);
      int64_t tiles = cuda::grouped_max_tiles(S * k, cfg_.n_experts, tr);  // grid bound; the count is on the device
      if (routing_sync_) {             // ablation: wait for the count on the host and launch exactly that
        int32_t n = 0;
        LILY_CUDA_CHECK(cudaMemcpyAsync(&n, n_tiles_, sizeof(n), cudaMemcpyDeviceToHost, st_));
        sync();
        tiles = n;
      }
      cuda::GroupMap g{n_tiles_, tile_expert_, tile_row0_, tile_rows_, pair_row_, pair_id_, pair_w_, tiles};
      cuda::grouped_gate_up(st_, L.gate, L.up, g, h_, H, act_, tr, gemm_impl_);
      cuda::grouped_down(st_, L.down, g, act_, d_, tr, gemm_impl_);
    }
    (void)I;
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
      cuda::rms_norm(st_, x_ + (row0 + r) * H, final_norm_, cfg_.rms_eps, m, H, h_);
      cuda::linear(st_, lm_head_, h_, H, m, lg, V, false, gemm_impl_);
      LILY_CUDA_CHECK(cudaMemcpyAsync(logits + r * V, lg, m * V * sizeof(float), cudaMemcpyDeviceToHost, st_));
      sync();
    }
  }

 private:
  // Tile-map capacity for S rows at the smallest expert tile (any tile size fits).
  int64_t max_tiles(int64_t S) const { return cuda::grouped_max_tiles(S * cfg_.top_k, cfg_.n_experts, 16); }

  // ---- decode fast path -------------------------------------------------------------------------------
  static constexpr int64_t kOutCap = 4096;  // greedy tokens per host round trip

  static int default_decode_mode() {
    const char* e = std::getenv("LILY_CUDA_DECODE");
    if (!e || !*e) return 2;
    const std::string v(e);
    if (v == "0" || v == "legacy") return 0;
    if (v == "1" || v == "fused") return 1;
    if (v == "2" || v == "graph") return 2;
    throw std::invalid_argument("[lily] LILY_CUDA_DECODE must be legacy|fused|graph (or 0|1|2), got '" + v + "'");
  }

  static bool same_format(const DLinear& a, const DLinear& b) {
    return a.p.kind == b.p.kind && a.p.bits == b.p.bits && a.p.group == b.p.group && a.p.out == b.p.out &&
           a.p.in == b.p.in && a.p.expert_words == b.p.expert_words && a.p.expert_groups == b.p.expert_groups &&
           a.p.expert_elems == b.p.expert_elems;
  }

  bool fused_supported() const {
    if (cfg_.top_k > cuda::dec::kMaxTopK || cfg_.n_experts > 256) return false;
    for (const DLayer& L : layers_)
      if (!same_format(L.gate, L.up) || !same_format(L.sh_gate, L.sh_up)) return false;
    return true;
  }

  template <class T>
  T* dalloc(int64_t n, bool poison) {
    dec_bufs_.emplace_back(mem_, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T));
    if (poison) dec_poison_.emplace_back(dec_bufs_.back().data(), dec_bufs_.back().bytes());
    return dec_bufs_.back().as<T>();
  }

  // Dedicated decode scratch: fixed pointers for the lifetime of the backend (a captured graph holds them).
  void alloc_decode() {
    const int64_t H = cfg_.hidden, D = cfg_.head_dim, Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads;
    dctl_ = dalloc<cuda::dec::Ctl>(1, false);
    dout_ = dalloc<int32_t>(kOutCap, false);
    dx_ = dalloc<float>(H, true);
    dh_ = dalloc<bf16>(H, true);
    du_ = dalloc<float>(cfg_.conv_dim(), true);
    dz_ = dalloc<float>(cfg_.value_dim(), true);
    dy_ = dalloc<float>(cfg_.value_dim(), true);
    db_ = dalloc<float>(cfg_.lin_v_heads, true);
    da_ = dalloc<float>(cfg_.lin_v_heads, true);
    dqg_ = dalloc<float>(2 * Hq * D, true);
    dq_ = dalloc<float>(Hq * D, true);
    dk_ = dalloc<float>(Hkv * D, true);
    dv_ = dalloc<float>(Hkv * D, true);
    dob_ = dalloc<bf16>(Hq * D, true);
    drl_ = dalloc<float>(cfg_.n_experts, true);
    dtop_idx_ = dalloc<int32_t>(cfg_.top_k, false);
    dtop_w_ = dalloc<float>(cfg_.top_k, true);
    dact_ = dalloc<bf16>(static_cast<int64_t>(cfg_.top_k) * cfg_.moe_inter, true);
    dsact_ = dalloc<bf16>(cfg_.shared_inter, true);
    dsg_ = dalloc<float>(1, true);
    max_splits_ = std::max<int64_t>(1, (2 * sm_count_ + std::max(Hkv, int64_t{1}) - 1) / std::max(Hkv, int64_t{1}));
    dpart_ = dalloc<float>(Hq * max_splits_ * (D + 2), true);
    dlg_ = dalloc<float>(cfg_.vocab, true);
    head_blocks_ = cuda::dec::head_blocks(cfg_.vocab);
    damax_ = dalloc<unsigned long long>(head_blocks_, false);
    LILY_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ctl_host_), sizeof(cuda::dec::Ctl)));
    LILY_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&lg_host_), cfg_.vocab * sizeof(float)));
  }

  cuda::dec::Seg seg(const DLinear& w, int mode, float* y, bf16* yb = nullptr) const {
    cuda::dec::Seg g;
    g.w0 = w;
    g.w1 = w;
    g.mode = mode;
    g.y = y;
    g.yb = yb;
    return g;
  }

  unsigned run_proj(cuda::dec::ProjArgs a) {
    a.l2_prefetch = l2_prefetch_;
    return cuda::dec::proj(st_, a, gemv_impl_, pdl_);
  }

  // The L2 prefetch list of weights a later kernel reads (empty with the flag l2_ahead off).
  cuda::dec::L2Ahead ahead(std::initializer_list<const DLinear*> ws) const {
    cuda::dec::L2Ahead h;
    if (l2_ahead_)
      for (const DLinear* w : ws) cuda::dec::ahead_add(h, *w);
    return h;
  }
  // The first projection of a layer's mixer (the next layer's weights, asked for by this layer's MoE down).
  cuda::dec::L2Ahead ahead_first(const DLayer* L, bool attention) const {
    if (L == nullptr) return {};
    return attention ? ahead({&L->q, &L->k, &L->v}) : ahead({&L->qkv, &L->z, &L->b, &L->a});
  }

  cuda::dec::ProjArgs norm_args(const float* w) const {
    cuda::dec::ProjArgs a;
    a.xmode = cuda::dec::kXNorm;
    a.in = cfg_.hidden;
    a.eps = cfg_.rms_eps;
    a.xf = dx_;
    a.nw = w;
    return a;
  }

  void dec_deltanet(const DLayer& L, DeltaNetState& s) {
    namespace d = cuda::dec;
    d::ProjArgs a = norm_args(L.in_norm);
    a.nseg = 4;
    a.seg[0] = seg(L.qkv, d::kOConv, nullptr);
    a.seg[1] = seg(L.z, d::kOStore, dz_);
    a.seg[2] = seg(L.b, d::kOStore, db_);
    a.seg[3] = seg(L.a, d::kOStore, da_);
    a.conv_w = L.conv_w;
    a.conv_state = s.conv.as<float>();
    a.u = du_;
    a.conv_dim = cfg_.conv_dim();
    a.conv_k = cfg_.conv_kernel;
    a.ahead = ahead({&L.out});
    run_proj(a);
    const kp::DeltaNetParams p{cfg_.lin_k_heads, cfg_.lin_v_heads, cfg_.lin_k_dim, cfg_.lin_v_dim, cfg_.conv_kernel,
                               cfg_.conv_dim(), cfg_.rms_eps, 1e-6f, 1};
    d::dn_scan(st_, p, du_, db_, da_, L.dt_bias, L.a_log, s.ssm.as<float>(), dy_, pdl_);
    d::ProjArgs o;
    o.nseg = 1;
    o.xmode = d::kXGated;
    o.in = cfg_.value_dim();
    o.gdim = cfg_.lin_v_dim;
    o.eps = cfg_.rms_eps;
    o.xf = dy_;
    o.zf = dz_;
    o.nw = L.dn_norm;
    o.seg[0] = seg(L.out, d::kOAccum, dx_);
    o.ahead = ahead({&L.router, &L.sh_gate, &L.sh_up, &L.sh_expert_gate});
    run_proj(o);
    step_launches_ += 3;
  }

  void dec_attention(const DLayer& L, KVCache& kv) {
    namespace d = cuda::dec;
    const int64_t D = cfg_.head_dim;
    d::ProjArgs a = norm_args(L.in_norm);
    a.nseg = 3;
    a.seg[0] = seg(L.q, d::kOStore, dqg_);
    a.seg[1] = seg(L.k, d::kOStore, dk_);
    a.seg[2] = seg(L.v, d::kOStore, dv_);
    a.ahead = ahead({&L.o});
    run_proj(a);
    const kp::AttentionParams p{cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim, cfg_.rotary_dim,
                                static_cast<float>(cfg_.rope_theta), cfg_.rms_eps,
                                1.f / std::sqrt(static_cast<float>(D)), 0, 0, 1};
    const int32_t* dpos = &dctl_->pos;
    cuda::attention_prep(st_, p, dqg_, dk_, dv_, L.q_norm, L.k_norm, dq_, kv.k.as<bf16>(), kv.v.as<bf16>(), dpos);
    // Split count fixed by the capacity (the graph is captured per capacity); split length follows the position.
    kp::AttentionParams cap = p;
    cap.pos0 = kv.capacity - 1;
    kp::AttnSplitParams sp = cuda::attention_plan(cap, sm_count_);
    if (!split_k_) sp.n_splits = 1;      // ablation: one block per (row tile, KV head) reads every key
    if (!gqa_pack_) sp.heads_per_block = 1;  // ablation: one query head per block, K/V loaded once per head
    if (sp.n_splits > max_splits_) throw std::logic_error("[lily] cuda decode: attention split count");
    cuda::attention(st_, p, sp, dq_, dqg_, kv.k.as<bf16>(), kv.v.as<bf16>(), dpart_, dob_, dpos,
                    attn_decode_tc_ && gqa_pack_ ? 2 : 1, attn_pipe_);  // the tc kernel always packs 8 heads
    d::ProjArgs o;
    o.nseg = 1;
    o.xmode = d::kXBf16;
    o.in = cfg_.n_heads * cfg_.head_dim;
    o.xb = dob_;
    o.seg[0] = seg(L.o, d::kOAccum, dx_);
    o.ahead = ahead({&L.router, &L.sh_gate, &L.sh_up, &L.sh_expert_gate});
    run_proj(o);
    step_launches_ += 5;
  }

  // next: the following layer (nullptr after the last), whose first projection the MoE down asks L2 for.
  void dec_moe(const DLayer& L, const DLayer* next, bool next_attention) {
    namespace d = cuda::dec;
    const int k = cfg_.top_k;
    d::ProjArgs a = norm_args(L.post_norm);
    a.h_out = dh_;
    a.nseg = 3;
    a.seg[0] = seg(L.router, d::kOStore, drl_);
    a.seg[1] = seg(L.sh_gate, d::kODual, nullptr, dsact_);
    a.seg[1].w1 = L.sh_up;
    a.seg[2] = seg(L.sh_expert_gate, d::kOStore, dsg_);
    a.ahead = ahead({&L.sh_down});
    run_proj(a);
    d::ProjArgs e;
    e.nseg = 1;
    e.xmode = d::kXBf16;
    e.in = cfg_.hidden;
    e.xb = dh_;
    e.route = 1;
    e.rlogits = drl_;
    e.E = cfg_.n_experts;
    e.top_k = k;
    e.norm_topk = cfg_.norm_topk_prob ? 1 : 0;
    e.top_idx = dtop_idx_;
    e.top_w = dtop_w_;
    e.seg[0] = seg(L.gate, d::kODual, nullptr, dact_);
    e.seg[0].w1 = L.up;
    e.seg[0].routed = 1;
    e.seg[0].slots = k;
    e.seg[0].y_step = cfg_.moe_inter;
    if (l2_ahead_) e.ahead.routed = L.down;  // the chosen experts' down rows, once the prologue has routed
    run_proj(e);
    d::DownArgs dn;
    dn.wd = L.down;
    dn.ws = L.sh_down;
    dn.act = dact_;
    dn.sact = dsact_;
    dn.top_idx = dtop_idx_;
    dn.top_w = dtop_w_;
    dn.sgate = dsg_;
    dn.x = dx_;
    dn.k = k;
    dn.ahead = ahead_first(next, next_attention);
    d::moe_down(st_, dn, gemv_impl_, pdl_);
    step_launches_ += 3;
  }

  // One decode step on the stream: token and position come from dctl_; ends with the argmax of the logits
  // written to the control block (the next step's token) and the position advanced.
  void enqueue_step(State& st) {
    step_launches_ = 0;
    if (debug_)
      for (auto& [p, n] : dec_poison_) cuda::poison(st_, p, n);
    cuda::embed(st_, embed_, &dctl_->token, 1, dx_);
    for (int L = 0; L < cfg_.n_layers; ++L) {
      const int slot = st.layer_slot[L];
      if (cfg_.layer_types[L] == LayerType::Attention) dec_attention(layers_[L], st.kv[slot]);
      else dec_deltanet(layers_[L], st.dn[slot]);
      const bool last = L + 1 == cfg_.n_layers;
      dec_moe(layers_[L], last ? nullptr : &layers_[L + 1],
              !last && cfg_.layer_types[L + 1] == LayerType::Attention);
    }
    cuda::dec::ProjArgs h = norm_args(final_norm_);
    h.nseg = 1;
    h.seg[0] = seg(lm_head_, cuda::dec::kOStore, dlg_);
    h.amax = damax_;
    const unsigned nb = run_proj(h);
    if (nb > head_blocks_) throw std::logic_error("[lily] cuda decode: head block count");
    cuda::dec::finish(st_, damax_, static_cast<int>(nb), dctl_, dout_, pdl_);
    step_launches_ += 3;
  }

  // The buffers a captured step depends on besides the backend's own: the state's arrays and KV capacity.
  std::vector<uintptr_t> graph_key(const State& st) const {
    std::vector<uintptr_t> k;
    for (const auto& c : st.kv)
      k.insert(k.end(), {reinterpret_cast<uintptr_t>(c.k.data()), reinterpret_cast<uintptr_t>(c.v.data()),
                         static_cast<uintptr_t>(c.capacity)});
    for (const auto& d : st.dn)
      k.insert(k.end(), {reinterpret_cast<uintptr_t>(d.ssm.data()), reinterpret_cast<uintptr_t>(d.conv.data())});
    return k;
  }

  void drop_graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
    key_.clear();
  }

  void capture(State& st) {
    drop_graph();
    LILY_CUDA_CHECK(cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_step(st);
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(st_, &g);
      if (g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    LILY_CUDA_CHECK(cudaStreamEndCapture(st_, &graph_));
    LILY_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
    size_t n = 0;
    LILY_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    LILY_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &n));
    graph_nodes_ = static_cast<int64_t>(n);
    graph_kernels_ = 0;
    for (auto nd : nodes) {
      cudaGraphNodeType t;
      LILY_CUDA_CHECK(cudaGraphNodeGetType(nd, &t));
      graph_kernels_ += t == cudaGraphNodeTypeKernel;
    }
    key_ = graph_key(st);
    ++graph_captures_;
  }

  void run_step(State& st) {
    if (decode_mode_ == 2) {
      if (!exec_ || key_ != graph_key(st)) {
        try {
          capture(st);
        } catch (const std::exception& e) {  // keep decoding, without the graph
          std::fprintf(stderr, "[lily] cuda: decode graph capture failed (%s); continuing without a graph\n",
                       e.what());
          drop_graph();
          decode_mode_ = 1;
          enqueue_step(st);
          return;
        }
      }
      LILY_CUDA_CHECK(cudaGraphLaunch(exec_, st_));
      return;
    }
    enqueue_step(st);
  }

  void check_supported() const {
    auto fail = [](const std::string& m) { throw std::invalid_argument("[lily] backend 'cuda': " + m); };
    if (cfg_.n_experts > 256) fail("more than 256 experts");
    if (cfg_.n_attention_layers() && cfg_.head_dim != 32 && cfg_.head_dim != 64 && cfg_.head_dim != 128 &&
        cfg_.head_dim != 256)
      fail("head_dim must be 32, 64, 128 or 256");
    if (cfg_.n_deltanet_layers() && cfg_.lin_k_dim > 128) fail("linear_key_head_dim > 128");
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
    b_ = s_b_.get<float>(mem_, S * cfg_.lin_v_heads);
    a_ = s_a_.get<float>(mem_, S * cfg_.lin_v_heads);
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
    act_ = s_act_.get<bf16>(mem_, P * cfg_.moe_inter);
    d_ = s_d_.get<float>(mem_, P * H);
    sact_ = s_sact_.get<bf16>(mem_, S * cfg_.shared_inter);
    shd_ = s_shd_.get<float>(mem_, S * H);
    sg_ = s_sg_.get<float>(mem_, S);
    if (debug_)
      for (Scratch* s : {&s_x_, &s_h_, &s_qkv_, &s_u_, &s_z_, &s_y_, &s_yb_, &s_b_, &s_a_, &s_qg_, &s_q_, &s_k_, &s_v_,
                         &s_ob_, &s_logits_, &s_top_w_, &s_pair_w_, &s_act_, &s_d_, &s_sact_, &s_shd_, &s_sg_,
                         &part_, &lg_})
        cuda::poison(st_, s->buf.data(), s->buf.bytes());
  }

  const void* put(const void* src, size_t bytes) {
    owned_.emplace_back(mem_, bytes);
    mem_->from_host(owned_.back().data(), src, bytes);
    return owned_.back().data();
  }
  const float* put_vec(const float* src, int64_t n) { return static_cast<const float*>(put(src, n * sizeof(float))); }

  DLinear put_linear(const Linear& l) {
    DLinear d;
    const int64_t ne = std::max<int64_t>(1, l.experts);
    d.p.kind = l.kind == Linear::Kind::Quant ? 0 : l.kind == Linear::Kind::DenseBF16 ? 1 : 2;
    d.p.bits = l.bits;
    d.p.group = l.group;
    d.p.out = l.out;
    d.p.in = l.in;
    d.p.expert_words = l.out * (l.kind == Linear::Kind::Quant ? l.words_per_row() : 0);
    d.p.expert_groups = l.out * l.groups_per_row();
    d.p.expert_elems = l.out * l.in;
    if (l.kind == Linear::Kind::Quant) {
      d.codes = static_cast<const uint32_t*>(put(l.codes, ne * d.p.expert_words * 4));
      d.scales = static_cast<const uint16_t*>(put(l.scales, ne * d.p.expert_groups * 2));
      d.biases = static_cast<const uint16_t*>(put(l.biases, ne * d.p.expert_groups * 2));
    } else {
      d.dense = put(l.dense, ne * d.p.expert_elems * (l.kind == Linear::Kind::DenseBF16 ? 2 : 4));
    }
    return d;
  }

  void upload(const Weights& w) {
    const int64_t H = cfg_.hidden;
    embed_ = put_linear(w.embed);
    lm_head_ = put_linear(w.lm_head);
    final_norm_ = put_vec(w.final_norm, H);
    for (int i = 0; i < cfg_.n_layers; ++i) {
      const LayerWeights& lw = w.layers[i];
      DLayer L;
      L.in_norm = put_vec(lw.in_norm, H);
      L.post_norm = put_vec(lw.post_norm, H);
      if (lw.type == LayerType::DeltaNet) {
        L.qkv = put_linear(lw.dn.qkv);
        L.z = put_linear(lw.dn.z);
        L.b = put_linear(lw.dn.b);
        L.a = put_linear(lw.dn.a);
        L.out = put_linear(lw.dn.out);
        L.conv_w = put_vec(lw.dn.conv_w, static_cast<int64_t>(cfg_.conv_dim()) * cfg_.conv_kernel);
        L.dt_bias = put_vec(lw.dn.dt_bias, cfg_.lin_v_heads);
        L.a_log = put_vec(lw.dn.a_log, cfg_.lin_v_heads);
        L.dn_norm = put_vec(lw.dn.norm, cfg_.lin_v_dim);
      } else {
        L.q = put_linear(lw.attn.q);
        L.k = put_linear(lw.attn.k);
        L.v = put_linear(lw.attn.v);
        L.o = put_linear(lw.attn.o);
        L.q_norm = put_vec(lw.attn.q_norm, cfg_.head_dim);
        L.k_norm = put_vec(lw.attn.k_norm, cfg_.head_dim);
      }
      L.router = put_linear(lw.moe.router);
      L.gate = put_linear(lw.moe.gate);
      L.up = put_linear(lw.moe.up);
      L.down = put_linear(lw.moe.down);
      L.sh_gate = put_linear(lw.moe.sh_gate);
      L.sh_up = put_linear(lw.moe.sh_up);
      L.sh_down = put_linear(lw.moe.sh_down);
      L.sh_expert_gate = put_linear(lw.moe.sh_expert_gate);
      layers_.push_back(L);
    }
  }

  const Config& cfg_;
  std::shared_ptr<CudaMemory> mem_;
  cudaStream_t st_;
  bool debug_;
  int sm_count_ = 0;
  std::vector<Buffer> owned_;  // device copies of the weights
  DLinear embed_, lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<DLayer> layers_;

  Scratch s_ids_, s_x_, s_h_, s_qkv_, s_u_, s_z_, s_y_, s_yb_, s_b_, s_a_, s_qg_, s_q_, s_k_, s_v_, s_ob_, s_logits_,
      s_top_idx_, s_top_w_, s_pair_row_, s_pair_id_, s_pair_w_, s_n_tiles_, s_tile_expert_, s_tile_row0_,
      s_tile_rows_, s_act_, s_d_, s_sact_, s_shd_, s_sg_, part_, lg_, s_dn_;
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
  bf16* act_ = nullptr;                                 // [S*k, I]
  float* d_ = nullptr;                                  // [S*k, H]
  bf16* sact_ = nullptr;                                // [S, Is]
  float *shd_ = nullptr, *sg_ = nullptr;                // [S, H], [S]

  // decode fast path (dedicated scratch, one token)
  int decode_mode_ = 2;
  // Ablation switches (set_flag): defaults are the fast paths.
  int gemv_impl_ = 3;       // decode GEMVs: 3 auto, 2 tensor cores + bulk copies, 1 tensor cores, 0 scalar
  int pdl_ = 1;             // programmatic dependent launch between decode kernels
  int routing_sync_ = 0;    // prefill MoE: host-synchronised tile count instead of a device-sized grid
  int l2_prefetch_ = 0;     // experiment: ring projections prefetch their rows into L2 before the PDL wait
  int l2_ahead_ = 0;        // experiment: each decode kernel asks L2 for the next projection's weights (L2Ahead)
  int attn_pipe_ = 1;       // CUDA-core attention (decode; prefill ablation): next K/V tile copied during this one
  int attn_decode_tc_ = 1;  // decode attention on the tensor cores (attention_decode_tc.cu)
  int gqa_pack_ = 1;        // decode attention: the query heads of a KV head share each K/V load
  int split_k_ = 1;         // decode attention: keys split over blocks (flash-decoding)
  int expert_tile_ = 0;     // prefill MoE rows per expert tile: 0 auto, else 16/32/64/128
  int gemm_impl_ = 1;       // prefill GEMM: 1 tensor-core pipeline, 0 the wmma kernel
  int attn_impl_ = 1;       // prefill attention: 1 tensor-core flash, 0 CUDA-core
  int dn_form_ = 3;         // DeltaNet prefill: 0 old scan, 1 new scan, 2 chunked (TF32), 3 auto, 4 chunked fp32
  bool fused_ok_ = false;
  std::vector<Buffer> dec_bufs_;
  std::vector<std::pair<void*, size_t>> dec_poison_;
  cuda::dec::Ctl* dctl_ = nullptr;
  cuda::dec::Ctl* ctl_host_ = nullptr;  // pinned
  cuda::sample::DeviceSampler sampler_;
  float* lg_host_ = nullptr;            // pinned [V]
  int32_t* dout_ = nullptr;
  float *dx_ = nullptr, *du_ = nullptr, *dz_ = nullptr, *dy_ = nullptr, *db_ = nullptr, *da_ = nullptr;
  float *dqg_ = nullptr, *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr, *drl_ = nullptr, *dtop_w_ = nullptr;
  float *dsg_ = nullptr, *dpart_ = nullptr, *dlg_ = nullptr;
  bf16 *dh_ = nullptr, *dob_ = nullptr, *dact_ = nullptr, *dsact_ = nullptr;
  int32_t* dtop_idx_ = nullptr;
  unsigned long long* damax_ = nullptr;
  int64_t max_splits_ = 0, head_blocks_ = 0;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<uintptr_t> key_;
  int64_t graph_nodes_ = 0, graph_kernels_ = 0, graph_captures_ = 0, step_launches_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Config& cfg, const Weights& w, bool debug) {
  if (cuda::device_count() == 0)
    throw std::runtime_error("[lily] backend 'cuda': no CUDA device is visible (check the driver and "
                             "CUDA_VISIBLE_DEVICES), or use backend='cpu'");
  return std::make_unique<CudaBackend>(cfg, w, debug);
}

}  // namespace lily
