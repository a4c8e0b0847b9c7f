// Runtime model configuration. Every dimension is a runtime value so that tiny test configs
// (Dk != Dv, odd head counts, few experts, odd vocab) run through the same code as the real model.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lily {

enum class LayerType { DeltaNet, Attention };

// Flat view of ModelConfig.to_dict(): numbers (bools as 0/1) plus the layer type list.
struct ConfigDict {
  std::map<std::string, double> nums;
  std::vector<std::string> layer_types;
};

struct Config {
  int hidden = 0;          // H
  int n_layers = 0;
  std::vector<LayerType> layer_types;
  int vocab = 0;           // V
  // gated full attention
  int n_heads = 0;         // Hq
  int n_kv_heads = 0;      // Hkv
  int head_dim = 0;        // D
  int rotary_dim = 0;      // first rotary_dim dims of each head rotate (half-split)
  double rope_theta = 1e7;
  // gated DeltaNet
  int deltanet_k_heads = 0;     // Hk
  int deltanet_v_heads = 0;     // Hv
  int deltanet_k_dim = 0;       // Dk
  int deltanet_v_dim = 0;       // Dv
  int conv_kernel = 4;     // K
  // sparse MoE
  int n_experts = 0;       // E
  int top_k = 0;
  int moe_inter = 0;       // I
  int shared_inter = 0;    // Is
  bool norm_topk_prob = true;
  float rms_eps = 1e-6f;

  int key_dim() const { return deltanet_k_heads * deltanet_k_dim; }
  int value_dim() const { return deltanet_v_heads * deltanet_v_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }  // C = [q | k | v] channels
  int n_attention_layers() const;
  int n_deltanet_layers() const;

  // Throws std::invalid_argument naming the missing or inconsistent field.
  static Config from_dict(const ConfigDict& d);
};

}  // namespace lily
