#include "metal/backend_metal.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>

namespace lily::metal {
namespace {

uint32_t cdiv(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }
BufRef at(BufRef r, size_t bytes) { return BufRef{r.buf, r.offset + bytes}; }

kp::DeltaNetParams deltanet_params(const Config& c, int64_t S) {
  return kp::DeltaNetParams{c.deltanet_k_heads, c.deltanet_v_heads, c.deltanet_k_dim, c.deltanet_v_dim, c.conv_kernel, c.conv_dim(),
                            c.rms_eps, 1e-6f, S};
}

}  // namespace

BufRef BufferTable::ref(const void* p) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = m_.upper_bound(a);
  if (it != m_.begin()) {
    --it;
    if (a < it->first + std::max<size_t>(it->second.bytes, 1)) return at(it->second.r, a - it->first);
  }
  throw std::logic_error("[lily] metal: memory at this address is not a device buffer");
}

// State arrays live in device buffers (shared storage): Memory::alloc returns their host-visible contents.
// Copies and releases come after the work queued before them, as CUDA's stream-ordered Memory does: the engine grows
// a State (copy, release the old arrays) while a device stream's step may still run, and copies State arrays right
// after encoding rows that write them (the speculative loop's rewind point). `settle` (the backend's, while it
// lives) commits what is encoded and waits for the device first.
class MetalBackend::DeviceMemory final : public Memory {
 public:
  explicit DeviceMemory(std::shared_ptr<Device> d) : dev(std::move(d)) {}
  std::function<void()> settle;
  void settled() {
    if (settle) settle();
  }
  void* alloc(size_t bytes) override {
    DevBuffer* b = dev->alloc(bytes);
    void* p = dev->contents(b);
    std::memset(p, 0, bytes);
    std::lock_guard<std::mutex> g(mu);
    table.add(p, bytes, BufRef{b, 0});
    return p;
  }
  void release(void* p) noexcept override {
    try {
      settled();
    } catch (...) {  // a device error: the command buffer's wait reported it; the buffer is released all the same
    }
    std::lock_guard<std::mutex> g(mu);
    try {
      BufRef r = table.ref(p);
      table.remove(p);
      dev->release(r.buf);
    } catch (...) {
    }
  }
  void copy(void* dst, const void* src, size_t n) override { settled(), std::memcpy(dst, src, n); }
  void to_host(void* dst, const void* src, size_t n) override { settled(), std::memcpy(dst, src, n); }
  void from_host(void* dst, const void* src, size_t n) override { settled(), std::memcpy(dst, src, n); }
  BufRef ref(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return table.ref(p);
  }
  void add(const void* p, size_t bytes, BufRef r) {
    std::lock_guard<std::mutex> g(mu);
    table.add(p, bytes, r);
  }

  std::shared_ptr<Device> dev;
  std::mutex mu;
  BufferTable table;
};

struct MetalBackend::LayerW {
  BufRef in_norm, post_norm;
  DevLinear qkv, z, b, a, out;              // DeltaNet
  BufRef conv_w, dt_bias, a_log, deltanet_norm;
  DevLinear q, k, v, o;                     // attention
  BufRef q_norm, k_norm;
  DevLinear router, gate, up, down, sh_gate, sh_up, sh_down, sh_expert_gate;  // MoE
  bool fused_decode = true;                 // its formats have the fused decode chains (moe_decode)
};

// Per-chunk temporaries, sized for `rows` rows; grown (after a sync) when a larger chunk arrives.
struct MetalBackend::Scratch {
  Device& dev;
  std::vector<std::pair<DevBuffer*, size_t>> owned;
  int64_t rows = 0, parts = 0, logit_rows = 0;
  BufRef ids[2], x, h;
  BufRef qkv, z, b, a, u, y;                // DeltaNet
  BufRef deltanet_chunk;                          // DeltaNet chunked form: Ops::deltanet_chunk_scratch_bytes
  BufRef qg, k, v, q, o, ml, po;            // attention
  BufRef logits, sg, act, yd, ash, ysh, act_dec;
  RouteBufs r;
  BufRef head_h, head_logits;
  BufRef hid, cat, mtp_ids[2];              // MTP: kept hidden [rows, H], [embedding | hidden] [rows, 2H], ids
  int max_tiles = 0, act_stride = 0;

  explicit Scratch(Device& d) : dev(d) {}
  ~Scratch() { for (auto& b : owned) dev.release(b.first); }
  BufRef make(size_t bytes) {
    bytes = std::max<size_t>(bytes, 4);
    DevBuffer* b = dev.alloc(bytes);
    owned.emplace_back(b, bytes);
    return BufRef{b, 0};
  }
  // debug: NaN (0xFF bytes) everywhere, so a kernel reading what no kernel wrote in this chunk shows.
  void poison() {
    for (auto& b : owned) std::memset(dev.contents(b.first), 0xFF, b.second);
  }
};

MetalBackend::MetalBackend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev, bool debug, bool kv_bf16)
    : cfg_(cfg), dev_(std::move(dev)), ops_(*dev_, kv_bf16), debug_(debug), kv_bf16_(kv_bf16),
      has_mtp_(w.has_mtp), mem_(std::make_shared<DeviceMemory>(dev_)) {
  const int64_t H = cfg.hidden;
  auto vec = [&](const float* p, int64_t n) { return wrap(p, static_cast<size_t>(n) * 4); };
  embed_ = wrap_linear(w.embed);
  lm_head_ = wrap_linear(w.lm_head);
  final_norm_ = vec(w.final_norm, H);
  // The main layers, then the MTP head's decoder layer (Weights::layers[n_layers], an attention layer) and its fc
  // and norms when the weights carry it.
  const int n_wrapped = cfg.n_layers + (has_mtp_ ? 1 : 0);
  bool fused_main = true;
  for (int L = 0; L < n_wrapped; ++L) {
    const LayerWeights& lw = w.layers[L];
    LayerW l;
    l.in_norm = vec(lw.in_norm, H);
    l.post_norm = vec(lw.post_norm, H);
    if (lw.type == LayerType::DeltaNet) {
      const DeltaNetWeights& d = lw.deltanet;
      l.qkv = wrap_linear(d.qkv), l.z = wrap_linear(d.z), l.b = wrap_linear(d.b), l.a = wrap_linear(d.a);
      l.out = wrap_linear(d.out);
      l.conv_w = vec(d.conv_w, static_cast<int64_t>(cfg.conv_dim()) * cfg.conv_kernel);
      l.dt_bias = vec(d.dt_bias, cfg.deltanet_v_heads);
      l.a_log = vec(d.a_log, cfg.deltanet_v_heads);
      l.deltanet_norm = vec(d.norm, cfg.deltanet_v_dim);
    } else {
      const AttentionWeights& a = lw.attn;
      l.q = wrap_linear(a.q), l.k = wrap_linear(a.k), l.v = wrap_linear(a.v), l.o = wrap_linear(a.o);
      l.q_norm = vec(a.q_norm, cfg.head_dim);
      l.k_norm = vec(a.k_norm, cfg.head_dim);
    }
    const MoeWeights& m = lw.moe;
    l.router = wrap_linear(m.router), l.gate = wrap_linear(m.gate), l.up = wrap_linear(m.up);
    l.down = wrap_linear(m.down), l.sh_gate = wrap_linear(m.sh_gate), l.sh_up = wrap_linear(m.sh_up);
    l.sh_down = wrap_linear(m.sh_down), l.sh_expert_gate = wrap_linear(m.sh_expert_gate);
    l.fused_decode = l.gate.fmt == l.sh_gate.fmt && l.up.fmt == l.gate.fmt && l.sh_up.fmt == l.gate.fmt &&
                     l.down.fmt == l.sh_down.fmt && (l.gate.fmt == "q4" || l.gate.fmt == "bf16") &&
                     (l.down.fmt == "q4" || l.down.fmt == "bf16");
    if (L < cfg.n_layers) fused_main &= l.fused_decode;
    layers_.push_back(l);
  }
  // The fused decode chains run for every main layer or none (as before the MTP layer); the head's layer on its own.
  for (int L = 0; L < cfg.n_layers; ++L) layers_[L].fused_decode = fused_main;
  if (has_mtp_) {
    mtp_norm_embed_ = vec(w.mtp.norm_embed, H);
    mtp_norm_hidden_ = vec(w.mtp.norm_hidden, H);
    mtp_norm_ = vec(w.mtp.norm, H);
    mtp_fc_ = wrap_linear(w.mtp.fc);
  }
  // RoPE frequencies theta^(-2i/rd) in double, split into (hi, lo) floats for the kernel's exact reduction.
  const int half = cfg.rotary_dim / 2;
  DevBuffer* rb = dev_->alloc(std::max(1, half) * 8);
  wrapped_.push_back(rb);
  auto* rp = static_cast<float*>(dev_->contents(rb));
  for (int i = 0; i < half; ++i) {
    const double f = std::pow(cfg.rope_theta, -2.0 * i / cfg.rotary_dim);
    rp[2 * i] = static_cast<float>(f);
    rp[2 * i + 1] = static_cast<float>(f - static_cast<double>(rp[2 * i]));
  }
  rope_ = BufRef{rb, 0};
  auto persistent = [&](size_t bytes) {
    DevBuffer* b = dev_->alloc(bytes);
    wrapped_.push_back(b);
    return BufRef{b, 0};
  };
  tok_ = persistent(2 * 4);
  host_tok_ = persistent(2 * 4);
  step_logits_ = persistent(2 * static_cast<size_t>(cfg.vocab) * 4);
  uniform_ = persistent(2 * 4);
  // State copies and releases wait for the queued work (DeviceMemory). Nothing queued (a state copied after
  // Engine::sync, maybe from another thread): nothing of the backend is touched. Inside a step (never done by the
  // engine) only for what is committed: committing would split the step's command buffer.
  mem_->settle = [this] {
    if (!queued_) return;
    if (in_step_) wait_inflight(0);
    else sync();
  };
  if (has_mtp_) {
    draft_h_ = persistent(static_cast<size_t>(H) * 4);
    mtp_tok_ = persistent(2 * 4);
    zero_ = persistent(4);
  }
}

MetalBackend::~MetalBackend() {
  mem_->settle = nullptr;  // States may outlive the backend
  try {
    sync();
  } catch (...) {
  }
  cb_.reset();
  sc_.reset();
  sampler_.reset();
  for (DevBuffer* b : wrapped_) dev_->release(b);
}

BufRef MetalBackend::ref(const void* p) const { return mem_->ref(p); }

std::shared_ptr<Memory> MetalBackend::memory() const { return mem_; }

BufRef MetalBackend::wrap(const void* p, size_t bytes) {
  // The kernels load weights as 16-byte vectors, but a safetensors file only aligns tensors to 8 bytes: such a
  // tensor is copied into an aligned device buffer (counted by flag "copied_weight_bytes"), not wrapped.
  // (The emulator faults on the misaligned load; on Apple GPUs it is undefined.)
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    DevBuffer* b = dev_->alloc(bytes);
    std::memcpy(dev_->contents(b), p, bytes);
    wrapped_.push_back(b);
    copied_weight_bytes_ += static_cast<int64_t>(bytes);
    mem_->add(p, bytes, BufRef{b, 0});
    return BufRef{b, 0};
  }
  BufRef r = dev_->wrap(p, bytes);
  wrapped_.push_back(r.buf);
  mem_->add(p, bytes, r);
  return r;
}

DevLinear MetalBackend::wrap_linear(const Linear& l) {
  DevLinear d;
  d.out = l.out, d.in = l.in, d.experts = l.experts;
  const int64_t E = std::max<int64_t>(1, l.experts);
  const std::string where = "[lily] metal: linear " + std::to_string(l.out) + "x" + std::to_string(l.in);
  if (l.kind == Linear::Kind::Quant) {
    if (l.bits != 4 && l.bits != 8) throw std::invalid_argument(where + ": only 4- and 8-bit codes have kernels");
    if (l.group % 32 || l.in % l.group) throw std::invalid_argument(where + ": group size must be a multiple of 32");
    d.fmt = l.bits == 4 ? "q4" : "q8";
    d.w = wrap(l.codes, static_cast<size_t>(E * l.out * l.in * l.bits / 8));
    d.s = wrap(l.scales, static_cast<size_t>(E * l.out * (l.in / l.group) * 2));
    d.b = wrap(l.biases, static_cast<size_t>(E * l.out * (l.in / l.group) * 2));
    d.args = linear_params(l);
    return d;
  }
  if (l.in % 8) throw std::invalid_argument(where + ": dense in-dim must be a multiple of 8");
  const bool bf = l.kind == Linear::Kind::DenseBF16;
  d.fmt = bf ? "bf16" : "f32";
  d.w = d.s = d.b = wrap(l.dense, static_cast<size_t>(E * l.out * l.in * (bf ? 2 : 4)));
  d.args = linear_params(l);
  return d;
}

Encoder& MetalBackend::enc() {
  if (!cb_) cb_ = dev_->command_buffer(), queued_ = true;
  return cb_->encoder();
}

void MetalBackend::submit(int64_t step) {
  if (!cb_) return;
  cb_->commit();
  inflight_.push_back(Inflight{std::move(cb_), step});
}

void MetalBackend::wait_inflight(size_t keep) {
  while (inflight_.size() > keep) {
    std::unique_ptr<CommandBuffer> c = std::move(inflight_.front().cb);
    inflight_.pop_front();
    c->wait();
  }
  if (inflight_.empty() && !cb_) queued_ = false;
}

// Command buffers complete in commit order, so waiting for a step's one means waiting for every older one.
void MetalBackend::wait_step(int64_t index) {
  for (size_t i = 0; i < inflight_.size(); ++i)
    if (inflight_[i].step == index) {
      wait_inflight(inflight_.size() - i - 1);
      return;
    }
}

void MetalBackend::sync() {
  submit();
  wait_inflight(0);
}

void MetalBackend::reserve(int64_t S) {
  if (sc_ && sc_->rows >= S) return;
  sync();
  const Config& c = cfg_;
  const int64_t n = std::max<int64_t>(S, sc_ ? 2 * sc_->rows : 16), H = c.hidden, k = c.top_k;
  auto s = std::make_unique<Scratch>(*dev_);
  s->rows = n;
  for (auto& i : s->ids) i = s->make(n * 4);
  s->x = s->make(n * H * 4), s->h = s->make(n * H * 4);
  if (c.n_deltanet_layers()) {
    s->qkv = s->make(n * c.conv_dim() * 4), s->u = s->make(n * c.conv_dim() * 4);
    s->z = s->make(n * c.value_dim() * 4), s->y = s->make(n * c.value_dim() * 4);
    s->b = s->make(n * c.deltanet_v_heads * 4), s->a = s->make(n * c.deltanet_v_heads * 4);
    s->deltanet_chunk = s->make(Ops::deltanet_chunk_scratch_bytes(deltanet_params(c, n)));
  }
  if (c.n_attention_layers() || has_mtp_) {
    const int64_t D = c.head_dim;
    s->qg = s->make(n * 2 * c.n_heads * D * 4);
    s->k = s->make(n * c.n_kv_heads * D * 4), s->v = s->make(n * c.n_kv_heads * D * 4);
    s->q = s->make(n * c.n_heads * D * 4), s->o = s->make(n * c.n_heads * D * 4);
  }
  const int64_t E = c.n_experts, nb = cdiv(n, 32), I = c.moe_inter, Is = c.shared_inter;
  s->max_tiles = static_cast<int>(cdiv(n * k, 16) + E);
  s->logits = s->make(n * E * 4), s->sg = s->make(n * 4);
  s->r.ids = s->make(n * k * 4), s->r.wts = s->make(n * k * 4);
  s->r.counts = s->make(nb * E * 4), s->r.base = s->make(nb * E * 4);
  s->r.tile_expert = s->make(s->max_tiles * 4), s->r.tile_row0 = s->make(s->max_tiles * 4);
  s->r.tile_rows = s->make(s->max_tiles * 4), s->r.n_tiles = s->make(4);
  s->r.sorted_row = s->make(n * k * 4), s->r.sorted_w = s->make(n * k * 4), s->r.inv = s->make(n * k * 4);
  s->act = s->make(n * k * I * 4), s->yd = s->make(n * k * H * 4);
  s->ash = s->make(n * Is * 4), s->ysh = s->make(n * H * 4);
  s->act_stride = static_cast<int>((std::max(I, Is) + 7) / 8 * 8);
  s->act_dec = s->make(Ops::kDecodeRows * (k + 1) * s->act_stride * 4);   // [kDecodeRows, k+1, act_stride]
  s->head_h = s->make(n * H * 4);
  if (has_mtp_) {
    s->hid = s->make(n * H * 4), s->cat = s->make(n * 2 * H * 4);
    for (auto& i : s->mtp_ids) i = s->make(n * 4);
  }
  s->parts = 0;  // the decode partials (ml, po) went with the old scratch: grow_attention_parts makes new ones
  sc_ = std::move(s);
}

void MetalBackend::embed(const int32_t* ids, int64_t S) {
  if (in_step_) {
    // The step's token: from the host (its own slot: the previous step, maybe still running, reads the other
    // one) or, for -1, the token slot the previous step's draw wrote.
    if (S != 1) throw std::logic_error("[lily] metal: embed of " + std::to_string(S) + " rows inside a decode step");
    const int slot = static_cast<int>(step_.index & 1);
    if (ids[0] >= 0) {
      static_cast<int32_t*>(dev_->contents(host_tok_.buf))[slot] = ids[0];
      embed_from(at(host_tok_, slot * 4), 1);
    } else {
      embed_from(at(tok_, slot * 4), 1);
    }
    return;
  }
  reserve(S);
  // Chunk c uses ids slot c % 2; the chunk that used this slot before (c - 2) must have finished.
  submit();
  wait_inflight(debug_ ? 0 : 1);
  if (debug_) sc_->poison();
  BufRef slot = sc_->ids[chunk_++ % 2];
  std::memcpy(static_cast<char*>(dev_->contents(slot.buf)) + slot.offset, ids, static_cast<size_t>(S) * 4);
  embed_from(slot, S);
}

void MetalBackend::embed_from(BufRef ids, int64_t S) {
  Encoder& e = enc();
  ops_.embed(e, embed_, ids, sc_->x, static_cast<int>(S));
  e.barrier();
}

void MetalBackend::deltanet_block(int layer, const RowSegments& segs) {
  const LayerW& L = layers_[layer];
  const Config& c = cfg_;
  Scratch& s = *sc_;
  const int n = static_cast<int>(segment_rows(segs));
  Encoder& e = enc();
  ops_.rms_norm(e, s.x, L.in_norm, s.h, n, c.hidden, c.rms_eps);
  e.barrier();
  ops_.linear(e, L.qkv, s.h, s.qkv, n, false);
  ops_.linear(e, L.z, s.h, s.z, n, false);
  ops_.linear(e, L.b, s.h, s.b, n, false);
  ops_.linear(e, L.a, s.h, s.a, n, false);
  e.barrier();
  const size_t C = static_cast<size_t>(c.conv_dim()) * 4, VD = static_cast<size_t>(c.value_dim()) * 4,
               Hv = static_cast<size_t>(c.deltanet_v_heads) * 4;
  for (const RowSegment& g : segs) {  // each stream's conv and recurrence on its own state
    const size_t r = static_cast<size_t>(g.row0);
    const kp::DeltaNetParams p = deltanet_params(c, g.n);
    ops_.deltanet_conv(e, p, at(s.qkv, r * C), L.conv_w, ref(g.deltanet->conv.data()), at(s.u, r * C));
    e.barrier();
    // By chunk length, as on CUDA (Ops::kScanChunkMinRows); auto keeps the sequential form where the device cannot
    // give the chunked kernels their 256 threads. Exact rows: the form a one-row step takes.
    const int form = Ops::scan_pick(ops_.exact_rows ? deltanet_params(c, 1) : p, deltanet_form_);
    const BufRef ssm = ref(g.deltanet->ssm.data());
    if (form == Ops::kScanChunked && (deltanet_form_ == Ops::kScanChunked || ops_.deltanet_chunked_fits(p)))
      ops_.deltanet_scan_chunked(e, p, at(s.u, r * C), at(s.b, r * Hv), at(s.a, r * Hv), L.a_log, L.dt_bias, ssm,
                                 at(s.z, r * VD), L.deltanet_norm, at(s.y, r * VD), s.deltanet_chunk);
    else
      ops_.deltanet_scan(e, p, at(s.u, r * C), at(s.b, r * Hv), at(s.a, r * Hv), L.a_log, L.dt_bias, ssm,
                         at(s.z, r * VD), L.deltanet_norm, at(s.y, r * VD));
    e.barrier();
  }
  ops_.linear(e, L.out, s.y, s.x, n, true);
  e.barrier();
}

// The split-K partials of decode attention over `keys` keys, grown geometrically (so rarely) after a sync.
void MetalBackend::grow_attention_parts(int64_t keys) {
  if ((!cfg_.n_attention_layers() && !has_mtp_) || Ops::attn_parts(keys) <= sc_->parts) return;
  if (in_step_) throw std::logic_error("[lily] metal: attention partials must grow before a decode step starts");
  sync();
  sc_->parts = std::max<int64_t>(Ops::attn_parts(keys), 2 * sc_->parts);
  sc_->ml = sc_->make(cfg_.n_heads * sc_->parts * 2 * 4);
  sc_->po = sc_->make(cfg_.n_heads * sc_->parts * static_cast<int64_t>(cfg_.head_dim) * 4);
}

void MetalBackend::attention_block(int layer, const RowSegments& segs) {
  const LayerW& L = layers_[layer];
  const Config& c = cfg_;
  const int n = static_cast<int>(segment_rows(segs));
  const bool rows = ops_.exact_rows;  // every row by the decode kernels, as a one-row step runs it
  int64_t keys = 0;
  for (const RowSegment& g : segs)
    if (g.n == 1 || rows) keys = std::max(keys, g.pos0 + g.n);
  if (keys) grow_attention_parts(keys);
  Scratch& s = *sc_;
  Encoder& e = enc();
  ops_.rms_norm(e, s.x, L.in_norm, s.h, n, c.hidden, c.rms_eps);
  e.barrier();
  ops_.linear(e, L.q, s.h, s.qg, n, false);
  ops_.linear(e, L.k, s.h, s.k, n, false);
  ops_.linear(e, L.v, s.h, s.v, n, false);
  e.barrier();
  const size_t D = static_cast<size_t>(c.head_dim), QG = 2 * c.n_heads * D * 4, Q = c.n_heads * D * 4,
               KV = c.n_kv_heads * D * 4;
  auto params = [&](int64_t pos0, int64_t S) {
    return kp::AttentionParams{c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, static_cast<float>(c.rope_theta),
                               c.rms_eps, 1.f / std::sqrt(static_cast<float>(c.head_dim)), 0, pos0, S};
  };
  for (const RowSegment& g : segs) {  // q/k norms, RoPE, the keys and values into each stream's cache
    const size_t r = static_cast<size_t>(g.row0);
    ops_.attn_prep(e, params(g.pos0, g.n), at(s.qg, r * QG), at(s.k, r * KV), at(s.v, r * KV), L.q_norm, L.k_norm,
                   rope_, at(s.q, r * Q), ref(g.kv->k.data()), ref(g.kv->v.data()));
    e.barrier();  // (the segments' rows of s.q are disjoint, but a barrier is per buffer)
  }
  for (const RowSegment& g : segs) {
    const BufRef kc = ref(g.kv->k.data()), vc = ref(g.kv->v.data());
    if (g.n > 1 && !rows) {
      const size_t r = static_cast<size_t>(g.row0);
      ops_.attn_prefill(e, params(g.pos0, g.n), at(s.q, r * Q), at(s.qg, r * QG), kc, vc, at(s.o, r * Q));
      e.barrier();
      continue;
    }
    for (int64_t t = 0; t < g.n; ++t) {  // (the split-K partials ml / po are shared: one row at a time)
      const size_t r = static_cast<size_t>(g.row0 + t);
      ops_.attn_decode(e, params(g.pos0 + t, 1), at(s.q, r * Q), at(s.qg, r * QG), kc, vc, s.ml, s.po,
                       at(s.o, r * Q));
      e.barrier();
    }
  }
  ops_.linear(e, L.o, s.o, s.x, n, true);
  e.barrier();
}

void MetalBackend::moe_block(int layer, int64_t S) {
  const LayerW& L = layers_[layer];
  Encoder& e = enc();
  ops_.rms_norm(e, sc_->x, L.post_norm, sc_->h, static_cast<int>(S), cfg_.hidden, cfg_.rms_eps);
  e.barrier();
  if (S == 1 || ops_.exact_rows) {  // a step, or rows as steps make them
    if (L.fused_decode) return moe_decode(L, S);
    for (int64_t r = 0; r < S; ++r) moe_prefill(L, r, 1);
    return;
  }
  moe_prefill(L, 0, S);
}

// Decode of S rows, each as a one-row step computes it: router + shared-expert gate GEMVs and top-k over the rows, then
// the two fused chains (residual add included) per group of up to Ops::kDecodeRows rows, which stream each expert the
// group's rows chose once for all of them.
void MetalBackend::moe_decode(const LayerW& L, int64_t S) {
  const Config& c = cfg_;
  Scratch& s = *sc_;
  Encoder& e = enc();
  const int n = static_cast<int>(S), k = c.top_k;
  ops_.linear(e, L.router, s.h, s.logits, n, false);
  ops_.linear(e, L.sh_expert_gate, s.h, s.sg, n, false);
  e.barrier();
  ops_.moe_topk(e, s.logits, s.r.ids, s.r.wts, n, c.n_experts, k, c.norm_topk_prob);
  e.barrier();
  for (int r0 = 0; r0 < n; r0 += Ops::kDecodeRows) {  // (one activation buffer: the groups run one after another)
    const int m = std::min(n - r0, Ops::kDecodeRows);
    const size_t hx = static_cast<size_t>(r0) * c.hidden * 4, ik = static_cast<size_t>(r0) * k * 4;
    const BufRef ids = at(s.r.ids, ik);
    ops_.moe_gate_up_decode(e, L.gate, L.up, L.sh_gate, L.sh_up, at(s.h, hx), ids, s.act_dec, k, s.act_stride, m);
    e.barrier();
    ops_.moe_down_decode(e, L.down, L.sh_down, s.act_dec, ids, at(s.r.wts, ik), at(s.sg, static_cast<size_t>(r0) * 4),
                         at(s.x, hx), k, s.act_stride, m);
    e.barrier();
  }
}

// Prefill: routing on the device, grouped expert GEMMs over the block map, shared expert, combine.
void MetalBackend::moe_prefill(const LayerW& L, int64_t row0, int64_t S) {
  const Config& c = cfg_;
  Scratch& s = *sc_;
  const size_t at_row = static_cast<size_t>(row0) * c.hidden * 4;
  const BufRef h = at(s.h, at_row), x = at(s.x, at_row);
  const int n = static_cast<int>(S), k = c.top_k, E = c.n_experts, pairs = n * k;
  // Tile rows from the expert load: small tiles when experts get few rows each (less padding).
  const bool small = pairs < 24 * E && (L.gate.fmt == "q4" || L.gate.fmt == "bf16") &&
                     (L.down.fmt == "q4" || L.down.fmt == "bf16");
  const int bm = small ? 16 : 32;
  const int max_tiles = static_cast<int>(cdiv(pairs, bm) + E);
  Encoder& e = enc();
  ops_.linear(e, L.router, h, s.logits, n, false);
  ops_.linear(e, L.sh_expert_gate, h, s.sg, n, false);
  ops_.linear_glu(e, L.sh_gate, L.sh_up, h, s.ash, n);
  e.barrier();
  ops_.route(e, s.logits, s.r, n, E, k, c.norm_topk_prob, bm, max_tiles);
  e.barrier();
  ops_.grouped(e, L.gate, &L.up, h, c.hidden, true, s.r, s.act, pairs, bm, max_tiles);
  ops_.linear(e, L.sh_down, s.ash, s.ysh, n, false);
  e.barrier();
  ops_.grouped(e, L.down, nullptr, s.act, c.moe_inter, false, s.r, s.yd, pairs, bm, max_tiles);
  e.barrier();
  ops_.moe_combine(e, x, s.yd, s.ysh, s.sg, s.r, n, c.hidden, k);
  e.barrier();
}

void MetalBackend::read_residual(int64_t S, float* out) {
  sync();
  std::memcpy(out, dev_->contents(sc_->x.buf), static_cast<size_t>(S) * cfg_.hidden * 4);
}

void MetalBackend::head_into(int64_t row0, int64_t n, BufRef logits) {
  Encoder& e = enc();
  ops_.rms_norm(e, at(sc_->x, row0 * cfg_.hidden * 4), final_norm_, sc_->head_h, static_cast<int>(n), cfg_.hidden,
                cfg_.rms_eps);
  e.barrier();
  ops_.linear(e, lm_head_, sc_->head_h, logits, static_cast<int>(n), false);
  e.barrier();
}

void MetalBackend::head(int64_t row0, int64_t n, float* logits) {
  if (sc_->logit_rows < n) {
    sync();
    sc_->logit_rows = std::max<int64_t>(n, 2 * sc_->logit_rows);
    sc_->head_logits = sc_->make(sc_->logit_rows * cfg_.vocab * 4);
  }
  head_into(row0, n, sc_->head_logits);
  sync();
  std::memcpy(logits, dev_->contents(sc_->head_logits.buf), static_cast<size_t>(n) * cfg_.vocab * 4);
}

// ---- the MTP head (core/backend.h): encoded like the layers, in the chunk's or the step's command buffer ------

void MetalBackend::keep_hidden(int64_t S) {
  if (!has_mtp_) return Backend::keep_hidden(S);
  if (!sc_ || S > sc_->rows) throw std::logic_error("[lily] metal: keep_hidden of rows no chunk ran");
  Encoder& e = enc();
  ops_.rms_norm(e, sc_->x, final_norm_, sc_->hid, static_cast<int>(S), cfg_.hidden, cfg_.rms_eps);
  e.barrier();
}

// A device copy, ordered after the rows that computed it: a decode step needs no host wait.
void MetalBackend::store_hidden(int64_t row, Buffer& dst) {
  if (!has_mtp_) return Backend::store_hidden(row, dst);
  const int64_t H = cfg_.hidden;
  if (!sc_ || row < 0 || row >= sc_->rows || dst.bytes() < static_cast<size_t>(H) * 4)
    throw std::logic_error("[lily] metal: store_hidden(" + std::to_string(row) + ") outside the kept rows, or a "
                           "destination smaller than the hidden size");
  Encoder& e = enc();
  ops_.copy_rows(e, at(sc_->hid, static_cast<size_t>(row * H) * 4), zero_, ref(dst.data()), 1, static_cast<int>(H));
  e.barrier();
}

// The ids of n head rows on the device. Inside a step: the step's own slot (host ids: mtp_tok_, as host_tok_ for
// embed; -1: the token slot the step's embed read). Outside: Scratch::mtp_ids of this chunk's parity (the chunk
// before may still run and read the other); a second write within one chunk first waits for the GPU, which may
// not have read the first yet (chained drafts: mtp_head has waited already, so that costs nothing).
BufRef MetalBackend::mtp_ids_slot(const int32_t* ids, int64_t n) {
  if (in_step_) {
    if (n != 1) throw std::logic_error("[lily] metal: mtp_embed of " + std::to_string(n) + " rows inside a decode step");
    const int slot = static_cast<int>(step_.index & 1);
    if (ids[0] < 0) return at(tok_, slot * 4);
    static_cast<int32_t*>(dev_->contents(mtp_tok_.buf))[slot] = ids[0];
    return at(mtp_tok_, slot * 4);
  }
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocab)
      throw std::logic_error("[lily] metal: mtp_embed: token id " + std::to_string(ids[i]) + " outside a decode step "
                             "is not a vocabulary id");
  if (mtp_ids_chunk_ == chunk_) sync();
  mtp_ids_chunk_ = chunk_;
  BufRef slot = sc_->mtp_ids[(chunk_ - 1) & 1];
  std::memcpy(static_cast<char*>(dev_->contents(slot.buf)) + slot.offset, ids, static_cast<size_t>(n) * 4);
  return slot;
}

void MetalBackend::mtp_embed(const int32_t* ids, int64_t n, const Buffer* prev, MtpHidden src) {
  if (!has_mtp_) return Backend::mtp_embed(ids, n, prev, src);
  const Config& c = cfg_;
  const int H = static_cast<int>(c.hidden);
  const bool draft = src == MtpHidden::Draft;
  if (n < 1 || (draft && (n != 1 || prev || !has_draft_)))
    throw std::logic_error("[lily] metal: mtp_embed needs n >= 1 rows; a chained (Draft) row needs n == 1, no prev, "
                           "and an earlier mtp_head");
  const int64_t kept = draft ? 0 : n - (prev ? 1 : 0);  // rows read from Scratch::hid
  if (!sc_ || sc_->rows < n) {
    if (kept > 0 || in_step_)
      throw std::logic_error("[lily] metal: mtp_embed of " + std::to_string(n) + " rows exceeds the rows kept");
    reserve(n);
  }
  const BufRef id = mtp_ids_slot(ids, n);
  Scratch& s = *sc_;
  const int rows = static_cast<int>(n);
  const size_t half = static_cast<size_t>(H) * 4;  // bytes to the hidden half of a cat row
  Encoder& e = enc();
  ops_.embed(e, embed_, id, s.h, rows);
  // cat [n, 2H] = [RMSNorm(E[ids]; norm_embed) | RMSNorm(h; norm_hidden)], three norms into one buffer: barriers
  // between them (the device checks writes per buffer, not per range)
  if (draft) {
    ops_.rms_norm(e, draft_h_, mtp_norm_hidden_, at(s.cat, half), 1, H, c.rms_eps, H, 2 * H);
  } else {
    if (prev) ops_.rms_norm(e, ref(prev->data()), mtp_norm_hidden_, at(s.cat, half), 1, H, c.rms_eps, H, 2 * H);
    if (kept > 0) {
      if (prev) e.barrier();
      ops_.rms_norm(e, s.hid, mtp_norm_hidden_, at(s.cat, half * (prev ? 3 : 1)), static_cast<int>(kept), H,
                    c.rms_eps, H, 2 * H);
    }
  }
  e.barrier();
  ops_.rms_norm(e, s.h, mtp_norm_embed_, s.cat, rows, H, c.rms_eps, H, 2 * H);
  e.barrier();
  ops_.linear(e, mtp_fc_, s.cat, s.x, rows, false);
  e.barrier();
}

void MetalBackend::mtp_head(int64_t row0, int64_t n, float* logits) {
  if (!has_mtp_) return Backend::mtp_head(row0, n, logits);
  const int64_t H = cfg_.hidden, V = cfg_.vocab;
  if (!sc_ || n < 1 || row0 < 0 || row0 + n > sc_->rows)
    throw std::logic_error("[lily] metal: mtp_head rows " + std::to_string(row0) + ".." + std::to_string(row0 + n) +
                           " outside the chunk");
  if (sc_->logit_rows < n) {  // (inside a step this commits the step's work so far, and waits for it)
    sync();
    sc_->logit_rows = std::max<int64_t>(n, 2 * sc_->logit_rows);
    sc_->head_logits = sc_->make(sc_->logit_rows * V * 4);
  }
  Scratch& s = *sc_;
  Encoder& e = enc();
  ops_.rms_norm(e, at(s.x, static_cast<size_t>(row0 * H) * 4), mtp_norm_, s.head_h, static_cast<int>(n),
                static_cast<int>(H), cfg_.rms_eps);
  e.barrier();
  ops_.linear(e, lm_head_, s.head_h, s.head_logits, static_cast<int>(n), false);
  ops_.copy_rows(e, at(s.head_h, static_cast<size_t>((n - 1) * H) * 4), zero_, draft_h_, 1, static_cast<int>(H));
  e.barrier();
  has_draft_ = true;
  if (!logits) return;
  sync();
  std::memcpy(logits, dev_->contents(s.head_logits.buf), static_cast<size_t>(n * V) * 4);
}

// ---- decode steps: one command buffer each -----------------------------------------------------------------

void MetalBackend::abandon() {
  cb_.reset();
  in_step_ = false;
  if (inflight_.empty()) queued_ = false;
}

bool MetalBackend::begin_step(State& st, const DecodeStep& d) {
  if (in_step_) {  // the previous step threw while it was encoded: drop its half-encoded command buffer
    cb_.reset();
    in_step_ = false;
  }
  reserve(1);
  grow_attention_parts(d.position + 1);
  submit();  // queued prefill work runs first (command buffers execute in commit order)
  // Step d.index - 2 used this step's slots and must have finished. In the engine's token loop the host has
  // already waited for it (it returned that step's token), so this never blocks there: at most two command
  // buffers in flight. debug: nothing in flight, so the scratch can be poisoned.
  const size_t keep = debug_ ? 0 : 1;
  step_waits_ += inflight_.size() > keep;
  wait_inflight(keep);
  if (debug_) sc_->poison();
  in_step_ = true;
  step_ = d;
  const int slot = static_cast<int>(d.index & 1);
  slot_step_[slot] = d.index;
  slot_drew_[slot] = d.draw;
  // the draw's uniform, from the host like the token slot (step d.index - 2, its last reader, has finished)
  static_cast<float*>(dev_->contents(uniform_.buf))[slot] = d.uniform;
  return true;
}

void MetalBackend::head_step(const DecodeStep& d) {
  const int64_t V = cfg_.vocab;
  const BufRef lg = at(step_logits_, static_cast<size_t>((d.index & 1) * V * 4));
  head_into(0, 1, lg);
  if (!d.draw) return;
  if (!sampler_) throw std::logic_error("[lily] metal: a decode step draws before sampler_begin");
  const int slot = static_cast<int>(d.index & 1);
  sampler_->draw(ops_, enc(), lg, at(uniform_, slot * 4), tok_, static_cast<int>((d.index + 1) & 1));
}

void MetalBackend::end_step(State& st, const DecodeStep& d, float* logits) {
  in_step_ = false;
  submit(d.index);
  max_inflight_ = std::max<int64_t>(max_inflight_, static_cast<int64_t>(inflight_.size()));
  if (logits && !step_logits(d.index, logits))
    throw std::logic_error("[lily] metal: end_step: step " + std::to_string(d.index) + " holds no logits");
}

bool MetalBackend::sampler_begin(const SampleOptions& opt) {
  if (!device_draw_) return false;
  // The buffers are written from the host: nothing in flight may still read them (a parked stream's step).
  sync();
  if (!sampler_) sampler_ = std::make_unique<MetalSampler>(*dev_, static_cast<int32_t>(cfg_.vocab));
  sampler_->begin(opt);
  ++sampler_begins_;
  return true;
}

void MetalBackend::set_flag(const std::string& flag_name, int64_t value) {
  if (flag_name == "deltanet_form") {
    if (value < Ops::kScanAuto || value > Ops::kScanChunked)
      throw std::invalid_argument("[lily] backend flag 'deltanet_form' must be 0 (auto), 1 (sequential) or 2 (chunked), "
                                  "got " + std::to_string(value));
    // Refused here, not mid-chunk: an exception inside a chunk leaves its command buffer half encoded.
    if (value == Ops::kScanChunked && cfg_.n_deltanet_layers() && !ops_.deltanet_chunked_fits(deltanet_params(cfg_, 1)))
      throw std::invalid_argument("[lily] backend flag 'deltanet_form' 2: the chunked DeltaNet kernels need 256 threads "
                                  "per threadgroup; this device allows fewer");
    deltanet_form_ = static_cast<int>(value);
    return;
  }
  if (flag_name != "device_draw") return Backend::set_flag(flag_name, value);
  if (value != 0 && value != 1)
    throw std::invalid_argument("[lily] backend flag 'device_draw' must be 0 or 1, got " + std::to_string(value));
  device_draw_ = value != 0;
}

int64_t MetalBackend::flag(const std::string& flag_name) const {
  if (flag_name == "deltanet_form") return deltanet_form_;
  return flag_name == "device_draw" ? int64_t{device_draw_} : Backend::flag(flag_name);
}

std::map<std::string, int64_t> MetalBackend::counters() const {
  // copied_weight_bytes: see wrap; sampler_begins: device generations begun; step_waits, max_inflight: see the header
  return {{"copied_weight_bytes", copied_weight_bytes_}, {"sampler_begins", sampler_begins_},
          {"step_waits", step_waits_}, {"max_inflight", max_inflight_}};
}

bool MetalBackend::holds_step(int64_t index) const { return index >= 0 && slot_step_[index & 1] == index; }

int32_t MetalBackend::drawn_token(int64_t index) {
  if (!holds_step(index) || !slot_drew_[index & 1])
    throw std::logic_error("[lily] metal: drawn_token(" + std::to_string(index) +
                           "): not one of the last two steps, or a step that did not draw");
  wait_step(index);
  return static_cast<const int32_t*>(dev_->contents(tok_.buf))[(index + 1) & 1];
}

bool MetalBackend::step_logits(int64_t index, float* logits) {
  if (!holds_step(index)) return false;
  wait_step(index);
  const size_t V = static_cast<size_t>(cfg_.vocab);
  std::memcpy(logits, static_cast<const float*>(dev_->contents(step_logits_.buf)) + (index & 1) * V, V * 4);
  return true;
}

std::unique_ptr<MetalBackend> make_metal_backend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev,
                                                 bool debug, bool kv_bf16) {
  return std::make_unique<MetalBackend>(cfg, w, std::move(dev), debug, kv_bf16);
}

}  // namespace lily::metal
