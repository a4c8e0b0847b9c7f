#include "core/config.h"

#include <stdexcept>

namespace lily {

int Config::n_attention_layers() const {
  int n = 0;
  for (auto t : layer_types) n += t == LayerType::Attention;
  return n;
}

int Config::n_deltanet_layers() const { return n_layers - n_attention_layers(); }

Config Config::from_dict(const ConfigDict& d) {
  auto num = [&](const char* key) -> double {
    auto it = d.nums.find(key);
    if (it == d.nums.end()) throw std::invalid_argument(std::string("[lily] config is missing field '") + key + "'");
    return it->second;
  };
  auto pos_int = [&](const char* key) -> int {
    double v = num(key);
    if (v < 1 || v != static_cast<double>(static_cast<int64_t>(v)) || v > 1e9)
      throw std::invalid_argument(std::string("[lily] config field '") + key + "' must be a positive integer, got " +
                                  std::to_string(v));
    return static_cast<int>(v);
  };
  auto opt = [&](const char* key, double dflt) {
    auto it = d.nums.find(key);
    return it == d.nums.end() ? dflt : it->second;
  };
  Config c;
  c.hidden = pos_int("hidden_size");
  c.n_layers = pos_int("num_hidden_layers");
  c.vocab = pos_int("vocab_size");
  c.n_heads = pos_int("num_attention_heads");
  c.n_kv_heads = pos_int("num_key_value_heads");
  c.head_dim = pos_int("head_dim");
  c.rope_theta = num("rope_theta");
  auto rd = d.nums.find("rotary_dim");
  c.rotary_dim = rd != d.nums.end() ? static_cast<int>(rd->second)
                                    : static_cast<int>(c.head_dim * num("partial_rotary_factor"));
  c.deltanet_k_heads = pos_int("linear_num_key_heads");
  c.deltanet_v_heads = pos_int("linear_num_value_heads");
  c.deltanet_k_dim = pos_int("linear_key_head_dim");
  c.deltanet_v_dim = pos_int("linear_value_head_dim");
  c.conv_kernel = pos_int("linear_conv_kernel_dim");
  c.n_experts = pos_int("num_experts");
  c.top_k = pos_int("num_experts_per_tok");
  c.moe_inter = pos_int("moe_intermediate_size");
  c.shared_inter = pos_int("shared_expert_intermediate_size");
  c.norm_topk_prob = opt("norm_topk_prob", 1.0) != 0.0;
  c.rms_eps = static_cast<float>(opt("rms_norm_eps", 1e-6));

  auto fail = [](const std::string& m) { throw std::invalid_argument("[lily] config: " + m); };
  if (static_cast<int>(d.layer_types.size()) != c.n_layers)
    fail("layer_types has " + std::to_string(d.layer_types.size()) + " entries, expected num_hidden_layers = " +
         std::to_string(c.n_layers));
  for (const auto& t : d.layer_types) {
    if (t == "full_attention") c.layer_types.push_back(LayerType::Attention);
    else if (t == "linear_attention") c.layer_types.push_back(LayerType::DeltaNet);
    else fail("layer type '" + t + "' is not 'full_attention' or 'linear_attention'");
  }
  if (c.n_heads % c.n_kv_heads) fail("num_attention_heads must be a multiple of num_key_value_heads");
  if (c.deltanet_v_heads % c.deltanet_k_heads) fail("linear_num_value_heads must be a multiple of linear_num_key_heads");
  if (c.rotary_dim < 0 || c.rotary_dim % 2 || c.rotary_dim > c.head_dim)
    fail("rotary_dim " + std::to_string(c.rotary_dim) + " must be even and <= head_dim");
  if (c.top_k > c.n_experts) fail("num_experts_per_tok must be <= num_experts");
  return c;
}

}  // namespace lily
