// The Metal backend: lily's Backend interface over the narrow device layer (metal/device.h), so the same
// code runs on Apple GPUs and, in CI, on the emulated device. fp32 activations and state, bf16 (or fp32)
// KV cache;
// weights stay in their checkpoint format in wrapped (not copied) host memory.
//
// A prefill chunk is encoded into one command buffer (routing included: no host round trip inside a
// chunk) and submitted when the next chunk starts or the host needs data. decode_greedy() is the
// double-buffered decode loop: two token slots and two command buffers alternate, the GPU writes each
// sampled token into the next step's slot, and the host encodes step n+1 while step n runs.
#pragma once
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "metal/device.h"
#include "metal/ops_metal.h"

namespace lily::metal {

// Host address -> device buffer, for memory the backend allocated or wrapped (State arrays, weights).
class BufferTable {
 public:
  void add(const void* p, size_t bytes, BufRef r) { m_[reinterpret_cast<uintptr_t>(p)] = Entry{bytes, r}; }
  void remove(const void* p) { m_.erase(reinterpret_cast<uintptr_t>(p)); }
  // Throws std::logic_error for memory the device does not know.
  BufRef ref(const void* p) const;

 private:
  struct Entry {
    size_t bytes;
    BufRef r;
  };
  std::map<uintptr_t, Entry> m_;
};

class MetalBackend final : public Backend {
 public:
  // kv_bf16: bf16 KV cache (20,480 B per token on the real model, design.md §3), else fp32.
  MetalBackend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev, bool debug, bool kv_bf16);
  ~MetalBackend() override;

  const char* name() const override { return "metal"; }
  int threads() const override { return 1; }
  std::shared_ptr<Memory> memory() const override;
  Elem kv_elem() const override { return kv_bf16_ ? Elem::BF16 : Elem::F32; }
  int64_t default_chunk() const override { return 512; }
  void sync() override;

  void embed(const int32_t* ids, int64_t S) override;
  void deltanet_block(int layer, DeltaNetState& st, int64_t S) override;
  void attention_block(int layer, KVCache& kv, int64_t pos0, int64_t S) override;
  void moe_block(int layer, int64_t S) override;
  void read_residual(int64_t S, float* out) override;
  void head(int64_t row0, int64_t n, float* logits) override;

  // Greedy decode of n tokens after `first` (the token at position st.position). tokens[i] is sampled by
  // step i on the device; logits (optional, [n, V]) are each step's output. Advances st.position by n.
  void decode_greedy(State& st, int32_t first, int n, int32_t* tokens, float* logits);

  Device& device() { return *dev_; }
  BufRef ref(const void* p) const;

 private:
  struct LayerW;
  struct Scratch;
  class DeviceMemory;

  Encoder& enc();
  void submit();                       // commit the command buffer being encoded, if any
  void wait_inflight(size_t keep);     // wait until at most `keep` command buffers are in flight
  void reserve(int64_t S);
  BufRef wrap(const void* p, size_t bytes);
  DevLinear wrap_linear(const Linear& l);
  void embed_from(BufRef ids, int64_t S);
  void head_into(int64_t row0, int64_t n, BufRef logits);
  void moe_prefill(const LayerW& L, int64_t S);
  void moe_decode(const LayerW& L);

  const Config& cfg_;
  std::shared_ptr<Device> dev_;
  Ops ops_;
  bool debug_, kv_bf16_;
  std::shared_ptr<DeviceMemory> mem_;  // also the address table of wrapped weights
  std::vector<DevBuffer*> wrapped_;
  DevLinear embed_, lm_head_;
  BufRef final_norm_, rope_;
  std::vector<LayerW> layers_;
  std::unique_ptr<Scratch> sc_;
  bool fused_moe_decode_ = true;
  std::unique_ptr<CommandBuffer> cb_;                  // being encoded
  std::deque<std::unique_ptr<CommandBuffer>> inflight_;  // committed, oldest first
  int64_t chunk_ = 0;                                  // chunks started (ids ring slot)
};

std::unique_ptr<MetalBackend> make_metal_backend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev,
                                                 bool debug, bool kv_bf16 = true);

}  // namespace lily::metal
