// Per-session state: KV cache per attention layer (fp32 on CPU, grows up to max_context),
// DeltaNet recurrent state and conv state per linear layer (fixed size), and the position.
#pragma once
#include <cstdint>
#include <vector>

#include "core/config.h"

namespace lily {

struct KVCache {
  int64_t capacity = 0;  // tokens allocated
  std::vector<float> k;  // [capacity, Hkv, D] post-RoPE
  std::vector<float> v;  // [capacity, Hkv, D]
};

struct DeltaNetState {
  std::vector<float> ssm;   // [Hv, Dv, Dk] fp32 (MLX layout)
  std::vector<float> conv;  // [K-1, C] previous pre-conv qkv rows, oldest first
};

struct State {
  int64_t position = 0;
  int64_t max_context = 0;
  int64_t kv_row = 0;                  // Hkv * D floats per token per K or V
  std::vector<int> layer_slot;         // layer -> index into kv or dn
  std::vector<KVCache> kv;             // one per attention layer
  std::vector<DeltaNetState> dn;       // one per DeltaNet layer

  State(const Config& cfg, int64_t max_context);

  // Makes room for `tokens` cached tokens (<= max_context), growing geometrically.
  void reserve(int64_t tokens);
  // Deep copy holding KV only up to position.
  State snapshot() const;
  // Make this equal to `snap` (same model shape required; throws std::invalid_argument otherwise).
  void restore(const State& snap);
  int64_t nbytes() const;

 private:
  State() = default;
};

}  // namespace lily
