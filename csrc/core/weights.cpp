#include "core/weights.h"

#include <sstream>
#include <stdexcept>

namespace lily {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  if (s.size() == 1) o << ",";
  o << ")";
  return o.str();
}

struct Loader {
  const Config& cfg;
  const TensorMap& tensors;
  const QuantMap& quant;
  Weights& w;

  const TensorView& get(const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::invalid_argument("[lily] missing tensor " + name);
    return it->second;
  }

  void check_shape(const std::string& name, const TensorView& t, const std::vector<int64_t>& want) const {
    if (t.shape != want)
      throw std::invalid_argument("[lily] tensor " + name + " has shape " + shape_str(t.shape) + ", expected " +
                                  shape_str(want));
  }

  void check_dtype(const std::string& name, const TensorView& t, DType want) const {
    if (t.dtype != want)
      throw std::invalid_argument("[lily] tensor " + name + " has dtype " + dtype_name(t.dtype) + ", expected " +
                                  dtype_name(want));
  }

  // Small float vector [n] (norms, dt_bias, A_log, conv taps): f32 view, or bf16 upcast to an owned copy.
  const float* vec(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& t = get(name);
    check_shape(name, t, shape);
    if (t.dtype == DType::F32) return static_cast<const float*>(t.ptr);
    if (t.dtype == DType::U16) {
      auto& v = w.owned.emplace_back(t.numel());
      auto* src = static_cast<const uint16_t*>(t.ptr);
      for (int64_t i = 0; i < t.numel(); ++i) v[i] = bf16_to_f32(src[i]);
      return v.data();
    }
    throw std::invalid_argument("[lily] tensor " + name + " has dtype " + dtype_name(t.dtype) +
                                ", expected float32 or bf16");
  }

  // Linear module `mod` of logical shape [experts?, out, in]; quantized when listed in `quant`.
  Linear linear(const std::string& mod, int64_t out, int64_t in, int64_t experts = 0) {
    Linear l;
    l.out = out;
    l.in = in;
    l.experts = experts;
    auto lead = [&](std::vector<int64_t> s) {
      if (experts) s.insert(s.begin(), experts);
      return s;
    };
    auto q = quant.find(mod);
    if (q != quant.end()) {
      auto [bits, group] = q->second;
      if ((bits != 4 && bits != 8) || group <= 0 || group % 32)
        throw std::invalid_argument("[lily] module " + mod + ": quantization bits=" + std::to_string(bits) +
                                    " group_size=" + std::to_string(group) + " is not supported");
      if (in % group)
        throw std::invalid_argument("[lily] module " + mod + ": input dim " + std::to_string(in) +
                                    " is not a multiple of group_size " + std::to_string(group));
      l.kind = Linear::Kind::Quant;
      l.bits = bits;
      l.group = group;
      const auto& c = get(mod + ".weight");
      const auto& s = get(mod + ".scales");
      const auto& b = get(mod + ".biases");
      check_shape(mod + ".weight", c, lead({out, in * bits / 32}));
      check_shape(mod + ".scales", s, lead({out, in / group}));
      check_shape(mod + ".biases", b, lead({out, in / group}));
      check_dtype(mod + ".weight", c, DType::U32);
      check_dtype(mod + ".scales", s, DType::U16);
      check_dtype(mod + ".biases", b, DType::U16);
      l.codes = static_cast<const uint32_t*>(c.ptr);
      l.scales = static_cast<const uint16_t*>(s.ptr);
      l.biases = static_cast<const uint16_t*>(b.ptr);
    } else {
      const auto& t = get(mod + ".weight");
      check_shape(mod + ".weight", t, lead({out, in}));
      if (t.dtype == DType::U16) l.kind = Linear::Kind::DenseBF16;
      else if (t.dtype == DType::F32) l.kind = Linear::Kind::DenseF32;
      else
        throw std::invalid_argument("[lily] tensor " + mod + ".weight has dtype " + dtype_name(t.dtype) +
                                    ", expected bf16 or float32 (module " + mod +
                                    " is not listed as quantized)");
      l.dense = t.ptr;
    }
    return l;
  }

  void load() {
    const int64_t H = cfg.hidden, V = cfg.vocab;
    w.embed = linear("model.embed_tokens", V, H);
    w.final_norm = vec("model.norm.weight", {H});
    w.lm_head = linear("lm_head", V, H);
    for (int L = 0; L < cfg.n_layers; ++L)
      w.layers.push_back(layer("model.layers." + std::to_string(L) + ".", cfg.layer_types[L]));
    // The MTP head (docs/model.md §7), when the tensors carry it (lily.mtp_source names it mtp.*).
    if (tensors.count("mtp.fc.weight")) {
      w.has_mtp = true;
      w.mtp.norm_embed = vec("mtp.pre_fc_norm_embedding.weight", {H});
      w.mtp.norm_hidden = vec("mtp.pre_fc_norm_hidden.weight", {H});
      w.mtp.fc = linear("mtp.fc", H, 2 * H);
      w.mtp.norm = vec("mtp.norm.weight", {H});
      w.layers.push_back(layer("mtp.layers.0.", LayerType::Attention));
    }
  }

  LayerWeights layer(const std::string& p, LayerType type) {
    const int64_t H = cfg.hidden;
    LayerWeights lw;
    lw.type = type;
    lw.in_norm = vec(p + "input_layernorm.weight", {H});
    lw.post_norm = vec(p + "post_attention_layernorm.weight", {H});
    if (lw.type == LayerType::DeltaNet) {
      const std::string q = p + "linear_attn.";
      const int64_t C = cfg.conv_dim(), Hv = cfg.deltanet_v_heads, VD = cfg.value_dim();
      lw.deltanet.qkv = linear(q + "in_proj_qkv", C, H);
      lw.deltanet.z = linear(q + "in_proj_z", VD, H);
      lw.deltanet.b = linear(q + "in_proj_b", Hv, H);
      lw.deltanet.a = linear(q + "in_proj_a", Hv, H);
      lw.deltanet.out = linear(q + "out_proj", H, VD);
      lw.deltanet.conv_w = vec(q + "conv1d.weight", {C, cfg.conv_kernel, 1});
      lw.deltanet.dt_bias = vec(q + "dt_bias", {Hv});
      lw.deltanet.a_log = vec(q + "A_log", {Hv});
      lw.deltanet.norm = vec(q + "norm.weight", {cfg.deltanet_v_dim});
    } else {
      const std::string q = p + "self_attn.";
      const int64_t D = cfg.head_dim;
      lw.attn.q = linear(q + "q_proj", 2 * cfg.n_heads * D, H);
      lw.attn.k = linear(q + "k_proj", cfg.n_kv_heads * D, H);
      lw.attn.v = linear(q + "v_proj", cfg.n_kv_heads * D, H);
      lw.attn.o = linear(q + "o_proj", H, cfg.n_heads * D);
      lw.attn.q_norm = vec(q + "q_norm.weight", {D});
      lw.attn.k_norm = vec(q + "k_norm.weight", {D});
    }
    const std::string m = p + "mlp.";
    const int64_t E = cfg.n_experts, I = cfg.moe_inter, Is = cfg.shared_inter;
    lw.moe.router = linear(m + "gate", E, H);
    lw.moe.gate = linear(m + "switch_mlp.gate_proj", I, H, E);
    lw.moe.up = linear(m + "switch_mlp.up_proj", I, H, E);
    lw.moe.down = linear(m + "switch_mlp.down_proj", H, I, E);
    lw.moe.sh_gate = linear(m + "shared_expert.gate_proj", Is, H);
    lw.moe.sh_up = linear(m + "shared_expert.up_proj", Is, H);
    lw.moe.sh_down = linear(m + "shared_expert.down_proj", H, Is);
    lw.moe.sh_expert_gate = linear(m + "shared_expert_gate", 1, H);
    return lw;
  }
};

}  // namespace

Weights load_weights(const Config& cfg, const TensorMap& tensors, const QuantMap& quant) {
  Weights w;
  Loader{cfg, tensors, quant, w}.load();
  return w;
}

kp::LinearParams linear_params(const Linear& l) {
  kp::LinearParams p{};
  p.kind = l.kind == Linear::Kind::Quant ? 0 : l.kind == Linear::Kind::DenseBF16 ? 1 : 2;
  p.bits = l.bits;
  p.group = l.group;
  p.out = l.out;
  p.in = l.in;
  p.expert_words = l.out * (l.kind == Linear::Kind::Quant ? l.words_per_row() : 0);
  p.expert_groups = l.out * l.groups_per_row();
  p.expert_elems = l.out * l.in;
  return p;
}

}  // namespace lily
