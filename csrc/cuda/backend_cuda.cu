// CUDA backend: bf16 activations into every matrix product (fp32 accumulate), fp32 residual stream, norms,
// softmax and DeltaNet state; bf16 KV cache. Weights are copied to the device once at construction.
// Everything of a chunk is queued on one stream; the host waits only in head/read_residual/sync.
#include <memory>
#include <vector>

#include "core/backend.h"
#include "cuda/kernels.cuh"
#include "cuda/linear.cuh"
#include "cuda/runtime.h"

namespace lily {
namespace {

using cuda::bf16;
using cuda::DLinear;

// Device memory on the backend's stream; every call completes before it returns (the State contract).
class CudaMemory final : public Memory {
 public:
  CudaMemory() { LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking)); }
  ~CudaMemory() override { cudaStreamDestroy(st_); }
  cudaStream_t stream() const { return st_; }

  void* alloc(size_t bytes) override {
    void* p = nullptr;
    cuda::check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    LILY_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    LILY_CUDA_CHECK(cudaStreamSynchronize(st_));
    return p;
  }
  // cudaFree waits for queued work that may still use p.
  void release(void* p) noexcept override { cudaFree(p); }
  void copy(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyDeviceToDevice); }
  void to_host(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyDeviceToHost); }
  void from_host(void* dst, const void* src, size_t n) override { xfer(dst, src, n, cudaMemcpyHostToDevice); }

 private:
  void xfer(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, kind, st_));
    LILY_CUDA_CHECK(cudaStreamSynchronize(st_));
  }
  cudaStream_t st_ = nullptr;
};

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
  }

  const char* name() const override { return "cuda"; }
  int threads() const override { return 1; }
  std::shared_ptr<Memory> memory() const override { return mem_; }
  Elem kv_elem() const override { return Elem::BF16; }
  int64_t default_chunk() const override { return 2048; }
  void sync() override { LILY_CUDA_CHECK(cudaStreamSynchronize(st_)); }

  void embed(const int32_t* ids, int64_t S) override {
    reserve(S);
    LILY_CUDA_CHECK(cudaMemcpyAsync(ids_, ids, S * sizeof(int32_t), cudaMemcpyHostToDevice, st_));
    cuda::embed(st_, embed_, ids_, S, x_);
  }

  void deltanet_block(int layer, DeltaNetState& st, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.qkv, h_, H, S, qkv_, L.qkv.p.out);
    cuda::linear(st_, L.z, h_, H, S, z_, L.z.p.out);
    cuda::linear(st_, L.b, h_, H, S, b_, L.b.p.out);
    cuda::linear(st_, L.a, h_, H, S, a_, L.a.p.out);
    const kp::DeltaNetParams p{cfg_.lin_k_heads, cfg_.lin_v_heads, cfg_.lin_k_dim, cfg_.lin_v_dim, cfg_.conv_kernel,
                               cfg_.conv_dim(), cfg_.rms_eps, 1e-6f, S};
    cuda::deltanet_conv(st_, p, qkv_, L.conv_w, st.conv.as<float>(), u_);
    cuda::deltanet_scan(st_, p, u_, b_, a_, L.dt_bias, L.a_log, st.ssm.as<float>(), y_);
    cuda::deltanet_gated_norm(st_, p, y_, z_, L.dn_norm, yb_);
    cuda::linear(st_, L.out, yb_, cfg_.value_dim(), S, x_, H, /*accumulate=*/true);
  }

  void attention_block(int layer, KVCache& kv, int64_t pos0, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden, D = cfg_.head_dim;
    cuda::rms_norm(st_, x_, L.in_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.q, h_, H, S, qg_, L.q.p.out);
    cuda::linear(st_, L.k, h_, H, S, k_, L.k.p.out);
    cuda::linear(st_, L.v, h_, H, S, v_, L.v.p.out);
    const kp::AttentionParams p{cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim, cfg_.rotary_dim,
                                static_cast<float>(cfg_.rope_theta), cfg_.rms_eps,
                                1.f / std::sqrt(static_cast<float>(D)), 0, pos0, S};
    cuda::attention_prep(st_, p, qg_, k_, v_, L.q_norm, L.k_norm, q_, kv.k.as<bf16>(), kv.v.as<bf16>());
    const kp::AttnSplitParams sp = cuda::attention_plan(p, sm_count_);
    float* part = part_.get<float>(mem_, S * cfg_.n_heads * sp.n_splits * (D + 2));
    cuda::attention(st_, p, sp, q_, qg_, kv.k.as<bf16>(), kv.v.as<bf16>(), part, ob_);
    cuda::linear(st_, L.o, ob_, cfg_.n_heads * D, S, x_, H, /*accumulate=*/true);
  }

  void moe_block(int layer, int64_t S) override {
    const DLayer& L = layers_[layer];
    const int64_t H = cfg_.hidden, I = cfg_.moe_inter, Is = cfg_.shared_inter;
    const int k = cfg_.top_k;
    const kp::MoeParams p{cfg_.hidden, cfg_.n_experts, cfg_.top_k, cfg_.moe_inter, cfg_.shared_inter,
                          cfg_.norm_topk_prob ? 1 : 0, S};
    cuda::rms_norm(st_, x_, L.post_norm, cfg_.rms_eps, S, H, h_);
    cuda::linear(st_, L.router, h_, H, S, logits_, cfg_.n_experts);
    cuda::moe_route(st_, p, logits_, top_idx_, top_w_);
    cuda::linear_silu_mul(st_, L.sh_gate, L.sh_up, h_, H, S, sact_, Is);
    cuda::linear(st_, L.sh_down, sact_, Is, S, shd_, H);
    cuda::linear(st_, L.sh_expert_gate, h_, H, S, sg_, 1);
    if (S == 1) {
      cuda::experts_gate_up(st_, L.gate, L.up, top_idx_, k, h_, act_);
      cuda::experts_down(st_, L.down, top_idx_, top_w_, k, act_, d_);
    } else {
      cuda::moe_sort(st_, p, top_idx_, top_w_, cuda::kGemmBM, pair_row_, pair_id_, pair_w_, n_tiles_, tile_expert_,
                     tile_row0_, tile_rows_);
      cuda::GroupMap g{n_tiles_, tile_expert_, tile_row0_, tile_rows_, pair_row_, pair_id_, pair_w_, max_tiles(S)};
      cuda::grouped_gate_up(st_, L.gate, L.up, g, h_, H, act_);
      cuda::grouped_down(st_, L.down, g, act_, d_);
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
      cuda::linear(st_, lm_head_, h_, H, m, lg, V);
      LILY_CUDA_CHECK(cudaMemcpyAsync(logits + r * V, lg, m * V * sizeof(float), cudaMemcpyDeviceToHost, st_));
      sync();
    }
  }

 private:
  int64_t max_tiles(int64_t S) const {
    return (S * cfg_.top_k + cuda::kGemmBM - 1) / cuda::kGemmBM + cfg_.n_experts;
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
      s_tile_rows_, s_act_, s_d_, s_sact_, s_shd_, s_sg_, part_, lg_;
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
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Config& cfg, const Weights& w, bool debug) {
  if (cuda::device_count() == 0)
    throw std::runtime_error("[lily] backend 'cuda': no CUDA device is visible (check the driver and "
                             "CUDA_VISIBLE_DEVICES), or use backend='cpu'");
  return std::make_unique<CudaBackend>(cfg, w, debug);
}

}  // namespace lily
