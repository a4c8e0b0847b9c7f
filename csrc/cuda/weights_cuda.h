// The weights on the device: one upload at backend construction, device views (DLinear) per matrix.
#pragma once
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/memory.h"
#include "core/weights.h"
#include "cuda/common.cuh"

namespace lily::cuda {

struct DeviceLayer {
  const float* in_norm = nullptr;
  const float* post_norm = nullptr;
  // Concatenations (gemm.cuh linear_concat): weights that read one input stored as consecutive rows of one matrix, so a
  // prefill runs one GEMM for them; the parts are views into it. codes == nullptr: the parts' formats differ and
  // each was uploaded on its own.
  DLinear deltanet_in;        // qkv, z, b, a
  DLinear attn_in;            // q, k, v
  DLinear qkv, z, b, a, out;  // DeltaNet
  const float *conv_w = nullptr, *dt_bias = nullptr, *a_log = nullptr, *deltanet_norm = nullptr;  // [C, K], [Hv], [Hv], [Dv]
  DLinear q, k, v, o;  // attention
  const float *q_norm = nullptr, *k_norm = nullptr;  // [D]
  DLinear router, gate, up, down, sh_gate, sh_up, sh_down, sh_expert_gate;  // MoE
};

struct DeviceWeights {
  std::vector<Buffer> owned;  // the device copies
  DLinear embed, lm_head;
  const float* final_norm = nullptr;  // [H]
  std::vector<DeviceLayer> layers;
};

// The MTP head (docs/model.md §7): its own tensors and its decoder layer (Weights::layers[cfg.n_layers], attention).
struct DeviceMtpWeights {
  std::vector<Buffer> owned;
  const float *norm_embed = nullptr, *norm_hidden = nullptr, *norm = nullptr;  // [H]
  DLinear fc;                                                                  // [H, 2H]: [embedding | hidden]
  DeviceLayer layer;
};

// Copies every tensor of w to device memory of mem (synchronously); the MTP head's apart (upload_mtp_weights).
DeviceWeights upload_weights(const Config& cfg, const Weights& w, const std::shared_ptr<Memory>& mem);
// The MTP head's tensors (w.has_mtp), copied on first use: a checkpoint's head is one more MoE layer on the device.
DeviceMtpWeights upload_mtp_weights(const Config& cfg, const Weights& w, const std::shared_ptr<Memory>& mem);

// Whether the fused decode kernels (gemv.cuh) take this model: top_k <= gemv::kMaxTopK, <= 256 experts, every
// decode projection in a format the decode GEMV takes (gemv::fits, gemv::down_fits), and the gate/up pairs (routed
// and shared) in one format (a dual segment reads both with one layout). Otherwise decode runs the unfused ops.
bool fused_decode_fits(const Config& cfg, const DeviceWeights& w);

}  // namespace lily::cuda
