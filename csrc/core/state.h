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
  // The MTP head's cache (docs/model.md §7), when the engine runs the head: its layer's KV for the rows
  // (h_p, x_{p+1}) at positions p < mtp_rows, and last_hidden [H] fp32, the main model's final-normed hidden state
  // at position - 1 (the input of the head's next row). In step with the main state: mtp_rows == position - 1
  // (0 at position 0); a state whose head cache fell behind (restored from arrays without it) has mtp_rows <
  // position - 1 and drafts nothing (mtp_current()).
  bool has_mtp = false;
  KVCache mtp_kv;
  Buffer last_hidden;
  int64_t mtp_rows = 0;
  int64_t hidden = 0;                  // H: floats of last_hidden

  State(const Config& cfg, int64_t max_context, std::shared_ptr<Memory> mem, Elem kv_elem, bool mtp = false);
  State(State&&) = default;
  State& operator=(State&&) = default;

  // Makes room for `tokens` cached tokens (<= max_context), growing geometrically.
  void reserve(int64_t tokens);
  // The head's cache holds every row up to position (speculative decoding can draft from this state).
  bool mtp_current() const { return has_mtp && mtp_rows == (position > 0 ? position - 1 : 0); }
  // Deep copy holding KV only up to position.
  State snapshot() const;
  // Make this equal to `snap` (same model shape required; throws std::invalid_argument otherwise).
  void restore(const State& snap);
  int64_t nbytes() const;

  // Host float32 copies in the layouts of docs/engine_contract.md (export_arrays / import_arrays).
  // KV: out/in [rows, kv_row]; read_kv copies `position` rows, write_kv `rows` rows (reserve first). Slot
  // kv.size() is the MTP head's cache (has_mtp), of mtp_rows rows.
  void read_kv(size_t slot, bool value, float* out) const;
  void write_kv(size_t slot, bool value, const float* in, int64_t rows);
  // The MTP head's last_hidden [hidden] (has_mtp).
  void read_hidden(float* out) const { mem->to_host(out, last_hidden.data(), hidden * 4); }
  void write_hidden(const float* in) { mem->from_host(last_hidden.data(), in, hidden * 4); }
  // DeltaNet: conv=false -> ssm [ssm_size], conv=true -> conv [conv_size].
  void read_deltanet(size_t slot, bool conv, float* out) const;
  void write_deltanet(size_t slot, bool conv, const float* in);

 private:
  State() = default;
};

}  // namespace lily
