// The Metal backend's device sampler (metal/sample.metal; the semantics of csrc/cuda/sample.cuh): the buffers
// of one engine's sampler (options, bias, seen, counts, the processed row and the kernels' scratch) and the
// draw that a decode step's head encodes after its logits. One per backend, sized by the vocab on first use.
#pragma once
#include <cstdint>

#include "core/backend.h"
#include "kernels/params.h"
#include "metal/device.h"
#include "metal/ops_metal.h"

namespace lily::metal {

class MetalSampler {
 public:
  MetalSampler(Device& dev, int32_t vocab);
  MetalSampler(const MetalSampler&) = delete;
  MetalSampler& operator=(const MetalSampler&) = delete;
  ~MetalSampler();

  // One generation's options; seen / counts as the host knows them (empty: all zero). Writes the buffers from
  // the host (shared storage): the caller has waited for every command buffer that may read them.
  void begin(const SampleOptions& opt);
  // Greedy without bias or penalties: the argmax kernel draws it (nothing to process, nothing to record).
  bool plain_greedy() const { return plain_greedy_; }
  // Encodes the draw from logits [V] with uniform [1] (device) into tokens[slot]; seen / counts updated on the
  // device. Two or three dispatches (Ops::sample).
  void draw(Ops& ops, Encoder& e, BufRef logits, BufRef uniform, BufRef tokens, int slot);

 private:
  DevBuffer* make(size_t bytes);
  Device& dev_;
  int32_t V_;
  kp::SampleArgs args_{};
  bool plain_greedy_ = true;
  DevBuffer *x_ = nullptr, *work_ = nullptr, *seen_ = nullptr, *counts_ = nullptr;
  DevBuffer *bias_ids_ = nullptr, *bias_vals_ = nullptr;
  size_t bias_cap_ = 0;  // entries the bias buffers hold
};

}  // namespace lily::metal
