// Named weight lookup + validation. Every tensor the engine needs is found once here, its shape and
// dtype checked against the config, and kept as a view; small float vectors given in bf16 are upcast.
#pragma once
#include <deque>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "kernels/params.h"

namespace lily {

struct DeltaNetWeights {
  Linear qkv;                     // [C, H]
  Linear z;                       // [Hv*Dv, H]
  Linear b, a;                    // [Hv, H]
  Linear out;                     // [H, Hv*Dv]
  const float* conv_w = nullptr;  // [C, K] (stored [C, K, 1])
  const float* dt_bias = nullptr; // [Hv]
  const float* a_log = nullptr;   // [Hv]
  const float* norm = nullptr;    // [Dv], used as stored (no +1)
};

struct AttentionWeights {
  Linear q;                       // [2*Hq*D, H], per head [query(D) | gate(D)]
  Linear k, v;                    // [Hkv*D, H]
  Linear o;                       // [H, Hq*D]
  const float* q_norm = nullptr;  // [D]
  const float* k_norm = nullptr;  // [D]
};

struct MoeWeights {
  Linear router;                  // [E, H]
  Linear gate, up;                // experts [E, I, H]
  Linear down;                    // experts [E, H, I]
  Linear sh_gate, sh_up;          // [Is, H]
  Linear sh_down;                 // [H, Is]
  Linear sh_expert_gate;          // [1, H]
};

struct LayerWeights {
  LayerType type;
  const float* in_norm = nullptr;    // [H]
  const float* post_norm = nullptr;  // [H]
  DeltaNetWeights deltanet;
  AttentionWeights attn;
  MoeWeights moe;
};

// The MTP head's own tensors (docs/model.md §7); its decoder layer is Weights::layers[cfg.n_layers].
struct MtpHeadWeights {
  const float* norm_embed = nullptr;   // [H] pre_fc_norm_embedding (1 + γ, as every MLX norm)
  const float* norm_hidden = nullptr;  // [H] pre_fc_norm_hidden
  Linear fc;                           // [H, 2H]: input [embedding | hidden]
  const float* norm = nullptr;         // [H] mtp.norm, before the shared lm_head
};

struct Weights {
  Linear embed;                       // [V, H]
  const float* final_norm = nullptr;  // [H]
  Linear lm_head;                     // [V, H]
  std::vector<LayerWeights> layers;   // cfg.n_layers, then the MTP layer when has_mtp
  bool has_mtp = false;               // the tensors hold mtp.* (the head of Qwen3.5/3.6 checkpoints)
  MtpHeadWeights mtp;
  std::deque<std::vector<float>> owned;  // upcast copies of small bf16 vectors
};

// Throws std::invalid_argument with "[lily] tensor NAME ..." on a missing or mis-shaped tensor.
Weights load_weights(const Config& cfg, const TensorMap& tensors, const QuantMap& quant);

// The kernel-argument form of a linear layer (csrc/kernels/params.h), the same for every GPU backend.
kp::LinearParams linear_params(const Linear& l);

}  // namespace lily
