// Upload of the model's weights to the device (weights_cuda.h).
#include "cuda/weights_cuda.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>

#include "cuda/gemv.cuh"

namespace lily::cuda {
namespace {

struct Uploader {
  std::vector<Buffer>& owned;  // the device copies' owner
  const std::shared_ptr<Memory>& mem;

  const void* put(const void* src, size_t bytes) {
    owned.emplace_back(mem, bytes);
    mem->from_host(owned.back().data(), src, bytes);
    return owned.back().data();
  }
  const float* put_vec(const float* src, int64_t n) { return static_cast<const float*>(put(src, n * sizeof(float))); }

  DLinear put_linear(const Linear& l) {
    DLinear d;
    const int64_t ne = std::max<int64_t>(1, l.experts);
    d.p = linear_params(l);
    if (l.kind == Linear::Kind::Quant) {
      d.codes = static_cast<const uint32_t*>(put(l.codes, ne * d.p.expert_words * 4));
      d.scales = static_cast<const uint16_t*>(put(l.scales, ne * d.p.expert_groups * 2));
      d.biases = static_cast<const uint16_t*>(put(l.biases, ne * d.p.expert_groups * 2));
    } else {
      d.dense = put(l.dense, ne * d.p.expert_elems * (l.kind == Linear::Kind::DenseBF16 ? 2 : 4));
    }
    return d;
  }

  // parts[i] -> views[i] as consecutive rows of one device matrix (returned) when every part is a single quantized
  // matrix of one format and input width; otherwise each on its own and an empty concatenation.
  DLinear put_concat(std::initializer_list<const Linear*> parts, std::initializer_list<DLinear*> views) {
    const Linear& l0 = **parts.begin();
    bool one_format = true;
    int64_t rows = 0;
    for (const Linear* l : parts) {
      // every part's codes, scales and biases keep a 16-byte aligned start, as their own allocations would
      one_format = one_format && l->kind == Linear::Kind::Quant && l->experts <= 1 && l->bits == l0.bits &&
                   l->group == l0.group && l->in == l0.in && rows * l0.words_per_row() * 4 % 16 == 0 &&
                   rows * l0.groups_per_row() * 2 % 16 == 0;
      rows += l->out;
    }
    if (!one_format) {
      auto v = views.begin();
      for (const Linear* l : parts) **v++ = put_linear(*l);
      return DLinear{};
    }
    DLinear s;
    s.p = linear_params(l0);
    s.p.out = rows;
    s.p.expert_words = rows * l0.words_per_row();
    s.p.expert_groups = rows * l0.groups_per_row();
    s.p.expert_elems = rows * l0.in;
    owned.emplace_back(mem, s.p.expert_words * 4);
    s.codes = static_cast<const uint32_t*>(owned.back().data());
    owned.emplace_back(mem, s.p.expert_groups * 2);
    s.scales = static_cast<const uint16_t*>(owned.back().data());
    owned.emplace_back(mem, s.p.expert_groups * 2);
    s.biases = static_cast<const uint16_t*>(owned.back().data());
    int64_t row0 = 0;
    auto v = views.begin();
    for (const Linear* l : parts) {
      DLinear& d = **v++;
      d.p = linear_params(*l);
      d.codes = s.codes + row0 * l0.words_per_row();
      d.scales = s.scales + row0 * l0.groups_per_row();
      d.biases = s.biases + row0 * l0.groups_per_row();
      mem->from_host(const_cast<uint32_t*>(d.codes), l->codes, d.p.expert_words * 4);
      mem->from_host(const_cast<uint16_t*>(d.scales), l->scales, d.p.expert_groups * 2);
      mem->from_host(const_cast<uint16_t*>(d.biases), l->biases, d.p.expert_groups * 2);
      row0 += l->out;
    }
    return s;
  }
};

// One decoder layer's tensors.
DeviceLayer upload_layer(Uploader& u, const Config& cfg, const LayerWeights& lw) {
  const int64_t H = cfg.hidden;
  DeviceLayer L;
  L.in_norm = u.put_vec(lw.in_norm, H);
  L.post_norm = u.put_vec(lw.post_norm, H);
  if (lw.type == LayerType::DeltaNet) {
    const DeltaNetWeights& d = lw.deltanet;
    L.deltanet_in = u.put_concat({&d.qkv, &d.z, &d.b, &d.a}, {&L.qkv, &L.z, &L.b, &L.a});
    L.out = u.put_linear(lw.deltanet.out);
    L.conv_w = u.put_vec(lw.deltanet.conv_w, static_cast<int64_t>(cfg.conv_dim()) * cfg.conv_kernel);
    L.dt_bias = u.put_vec(lw.deltanet.dt_bias, cfg.deltanet_v_heads);
    L.a_log = u.put_vec(lw.deltanet.a_log, cfg.deltanet_v_heads);
    L.deltanet_norm = u.put_vec(lw.deltanet.norm, cfg.deltanet_v_dim);
  } else {
    L.attn_in = u.put_concat({&lw.attn.q, &lw.attn.k, &lw.attn.v}, {&L.q, &L.k, &L.v});
    L.o = u.put_linear(lw.attn.o);
    L.q_norm = u.put_vec(lw.attn.q_norm, cfg.head_dim);
    L.k_norm = u.put_vec(lw.attn.k_norm, cfg.head_dim);
  }
  L.router = u.put_linear(lw.moe.router);
  L.sh_expert_gate = u.put_linear(lw.moe.sh_expert_gate);
  L.gate = u.put_linear(lw.moe.gate);
  L.up = u.put_linear(lw.moe.up);
  L.down = u.put_linear(lw.moe.down);
  L.sh_gate = u.put_linear(lw.moe.sh_gate);
  L.sh_up = u.put_linear(lw.moe.sh_up);
  L.sh_down = u.put_linear(lw.moe.sh_down);
  return L;
}

}  // namespace

DeviceWeights upload_weights(const Config& cfg, const Weights& w, const std::shared_ptr<Memory>& mem) {
  DeviceWeights dw;
  Uploader u{dw.owned, mem};
  dw.embed = u.put_linear(w.embed);
  dw.lm_head = u.put_linear(w.lm_head);
  dw.final_norm = u.put_vec(w.final_norm, cfg.hidden);
  for (int i = 0; i < cfg.n_layers; ++i) dw.layers.push_back(upload_layer(u, cfg, w.layers[i]));
  return dw;
}

DeviceMtpWeights upload_mtp_weights(const Config& cfg, const Weights& w, const std::shared_ptr<Memory>& mem) {
  if (!w.has_mtp || static_cast<int>(w.layers.size()) <= cfg.n_layers)
    throw std::logic_error("[lily] backend 'cuda': the weights hold no MTP head");
  DeviceMtpWeights m;
  Uploader u{m.owned, mem};
  m.norm_embed = u.put_vec(w.mtp.norm_embed, cfg.hidden);
  m.norm_hidden = u.put_vec(w.mtp.norm_hidden, cfg.hidden);
  m.norm = u.put_vec(w.mtp.norm, cfg.hidden);
  m.fc = u.put_linear(w.mtp.fc);
  m.layer = upload_layer(u, cfg, w.layers[cfg.n_layers]);
  return m;
}

namespace {
bool same_format(const DLinear& a, const DLinear& b) {
  return a.p.kind == b.p.kind && a.p.bits == b.p.bits && a.p.group == b.p.group && a.p.out == b.p.out &&
         a.p.in == b.p.in && a.p.expert_words == b.p.expert_words && a.p.expert_groups == b.p.expert_groups &&
         a.p.expert_elems == b.p.expert_elems;
}
}  // namespace

bool fused_decode_fits(const Config& cfg, const DeviceWeights& w) {
  if (cfg.top_k > gemv::kMaxTopK || cfg.n_experts > 256 || cfg.hidden > gemv::kMaxNormIn) return false;
  if (!gemv::fits(w.lm_head)) return false;
  for (const DeviceLayer& L : w.layers) {
    if (!same_format(L.gate, L.up) || !same_format(L.sh_gate, L.sh_up)) return false;
    if (!gemv::down_fits(L.down, L.sh_down)) return false;
    for (const DLinear* m : {&L.qkv, &L.z, &L.b, &L.a, &L.out, &L.q, &L.k, &L.v, &L.o, &L.router, &L.gate,
                             &L.sh_gate, &L.sh_expert_gate})
      if ((m->codes || m->dense) && !gemv::fits(*m)) return false;  // null: absent in this layer type
  }
  return true;
}

}  // namespace lily::cuda
