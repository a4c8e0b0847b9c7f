// Per-session state: KV cache per attention layer (grows up to max_context), DeltaNet recurrent state
// and conv state per linear layer (fixed size), and the position. The arrays live in the backend's
// Memory (host for CPU, device for CUDA); the KV element type is the backend's (fp32 CPU, bf16 CUDA).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/memory.h"

namespace lily {

enum class Elem { F32, BF16 };
inline size_t elem_size(Elem e) { return e == Elem::F32 ? 4 : 2; }

struct KVCache {
  int64_t capacity = 0;  // tokens allocated
  Buffer k;              // [capacity, Hkv, D] post-RoPE, State::kv_elem
  Buffer v;              // [capacity, Hkv, D]
};

struct DeltaNetState {
  Buffer ssm;   // [Hv, Dv, Dk] fp32 (MLX layout)
  Buffer conv;  // [K-1, C] fp32, previous pre-conv qkv rows, oldest first
};

struct State {
  int64_t position = 0;
  int64_t max_context = 0;
  int64_t kv_row = 0;                  // Hkv * D elements per token per K or V
  int64_t ssm_size = 0, conv_size = 0; // floats per DeltaNet layer
  Elem kv_elem = Elem::F32;
  std::shared_ptr<Memory> mem;
  std::vector<int> layer_slot;         // layer -> index into kv or deltanet
  std::vector<KVCache> kv;             // one per attention layer
  std::vector<DeltaNetState> deltanet;       // one per DeltaNet layer

  State(const Config& cfg, int64_t max_context, std::shared_ptr<Memory> mem, Elem kv_elem);
  State(State&&) = default;
  State& operator=(State&&) = default;

  // Makes room for `tokens` cached tokens (<= max_context), growing geometrically.
  void reserve(int64_t tokens);
  // Deep copy holding KV only up to position.
  State snapshot() const;
  // Make this equal to `snap` (same model shape required; throws std::invalid_argument otherwise).
  void restore(const State& snap);
  int64_t nbytes() const;

  // Host float32 copies in the layouts of docs/engine_contract.md (export_arrays / import_arrays).
  // KV: out/in [rows, kv_row]; read_kv copies `position` rows, write_kv `rows` rows (reserve first).
  void read_kv(size_t slot, bool value, float* out) const;
  void write_kv(size_t slot, bool value, const float* in, int64_t rows);
  // DeltaNet: conv=false -> ssm [ssm_size], conv=true -> conv [conv_size].
  void read_deltanet(size_t slot, bool conv, float* out) const;
  void write_deltanet(size_t slot, bool conv, const float* in);

 private:
  State() = default;
};

}  // namespace lily
