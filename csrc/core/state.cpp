#include "core/state.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

#include "core/tensor.h"

namespace lily {
namespace {

class HostMemory final : public Memory {
 public:
  void* alloc(size_t bytes) override {
    void* p = std::calloc(bytes, 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void copy(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void to_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void from_host(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
};

// Round-to-nearest-even, as the GPU's __float2bfloat16 does.
uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

std::shared_ptr<Memory> host_memory() {
  static std::shared_ptr<Memory> m = std::make_shared<HostMemory>();
  return m;
}

State::State(const Config& cfg, int64_t max_ctx, std::shared_ptr<Memory> m, Elem e)
    : max_context(max_ctx), kv_elem(e), mem(std::move(m)) {
  kv_row = static_cast<int64_t>(cfg.n_kv_heads) * cfg.head_dim;
  ssm_size = static_cast<int64_t>(cfg.deltanet_v_heads) * cfg.deltanet_v_dim * cfg.deltanet_k_dim;
  conv_size = static_cast<int64_t>(cfg.conv_kernel - 1) * cfg.conv_dim();
  for (auto t : cfg.layer_types) {
    if (t == LayerType::Attention) {
      layer_slot.push_back(static_cast<int>(kv.size()));
      kv.emplace_back();
    } else {
      layer_slot.push_back(static_cast<int>(deltanet.size()));
      DeltaNetState s;
      s.ssm = Buffer(mem, ssm_size * 4);
      s.conv = Buffer(mem, conv_size * 4);
      deltanet.push_back(std::move(s));
    }
  }
}

void State::reserve(int64_t tokens) {
  const size_t row_bytes = kv_row * elem_size(kv_elem);
  for (auto& c : kv) {
    if (c.capacity >= tokens) continue;
    int64_t cap = std::min<int64_t>(max_context, std::max<int64_t>({tokens, 2 * c.capacity, 256}));
    for (Buffer* b : {&c.k, &c.v}) {
      Buffer nb(mem, cap * row_bytes);
      if (c.capacity) mem->copy(nb.data(), b->data(), c.capacity * row_bytes);
      *b = std::move(nb);
    }
    c.capacity = cap;
  }
}

State State::snapshot() const {
  State s;
  s.position = position;
  s.max_context = max_context;
  s.kv_row = kv_row;
  s.ssm_size = ssm_size;
  s.conv_size = conv_size;
  s.kv_elem = kv_elem;
  s.mem = mem;
  s.layer_slot = layer_slot;
  const size_t used = position * kv_row * elem_size(kv_elem);
  s.kv.resize(kv.size());
  for (size_t i = 0; i < kv.size(); ++i) {
    s.kv[i].capacity = position;
    s.kv[i].k = Buffer(mem, used);
    s.kv[i].v = Buffer(mem, used);
    if (used) {
      mem->copy(s.kv[i].k.data(), kv[i].k.data(), used);
      mem->copy(s.kv[i].v.data(), kv[i].v.data(), used);
    }
  }
  s.deltanet.resize(deltanet.size());
  for (size_t i = 0; i < deltanet.size(); ++i) {
    s.deltanet[i].ssm = Buffer(mem, ssm_size * 4);
    s.deltanet[i].conv = Buffer(mem, conv_size * 4);
    mem->copy(s.deltanet[i].ssm.data(), deltanet[i].ssm.data(), ssm_size * 4);
    if (conv_size) mem->copy(s.deltanet[i].conv.data(), deltanet[i].conv.data(), conv_size * 4);
  }
  return s;
}

void State::restore(const State& snap) {
  const bool same = snap.kv_row == kv_row && snap.layer_slot == layer_slot && snap.kv.size() == kv.size() &&
                    snap.deltanet.size() == deltanet.size() && snap.ssm_size == ssm_size && snap.conv_size == conv_size &&
                    snap.kv_elem == kv_elem && snap.mem == mem;
  if (!same) throw std::invalid_argument("[lily] State.restore: snapshot comes from a model with a different shape");
  if (snap.position > max_context)
    throw std::invalid_argument("[lily] State.restore: snapshot holds " + std::to_string(snap.position) +
                                " tokens, more than this state's max_context " + std::to_string(max_context));
  reserve(snap.position);
  const size_t used = snap.position * kv_row * elem_size(kv_elem);
  for (size_t i = 0; i < kv.size() && used; ++i) {
    mem->copy(kv[i].k.data(), snap.kv[i].k.data(), used);
    mem->copy(kv[i].v.data(), snap.kv[i].v.data(), used);
  }
  for (size_t i = 0; i < deltanet.size(); ++i) {
    mem->copy(deltanet[i].ssm.data(), snap.deltanet[i].ssm.data(), ssm_size * 4);
    if (conv_size) mem->copy(deltanet[i].conv.data(), snap.deltanet[i].conv.data(), conv_size * 4);
  }
  position = snap.position;
}

int64_t State::nbytes() const {
  return static_cast<int64_t>(kv.size()) * 2 * position * kv_row * static_cast<int64_t>(elem_size(kv_elem)) +
         static_cast<int64_t>(deltanet.size()) * (ssm_size + conv_size) * 4;
}

void State::read_kv(size_t slot, bool value, float* out) const {
  const int64_t n = position * kv_row;
  if (!n) return;
  const Buffer& b = value ? kv.at(slot).v : kv.at(slot).k;
  if (kv_elem == Elem::F32) return mem->to_host(out, b.data(), n * 4);
  std::vector<uint16_t> tmp(n);
  mem->to_host(tmp.data(), b.data(), n * 2);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(tmp[i]);
}

void State::write_kv(size_t slot, bool value, const float* in, int64_t rows) {
  const int64_t n = rows * kv_row;
  if (!n) return;
  if (rows > kv.at(slot).capacity) throw std::logic_error("[lily] State.write_kv: reserve first");
  Buffer& b = value ? kv[slot].v : kv[slot].k;
  if (kv_elem == Elem::F32) return mem->from_host(b.data(), in, n * 4);
  std::vector<uint16_t> tmp(n);
  for (int64_t i = 0; i < n; ++i) tmp[i] = f32_to_bf16(in[i]);
  mem->from_host(b.data(), tmp.data(), n * 2);
}

void State::read_deltanet(size_t slot, bool conv, float* out) const {
  const Buffer& b = conv ? deltanet.at(slot).conv : deltanet.at(slot).ssm;
  if (b.bytes()) mem->to_host(out, b.data(), b.bytes());
}

void State::write_deltanet(size_t slot, bool conv, const float* in) {
  Buffer& b = conv ? deltanet.at(slot).conv : deltanet.at(slot).ssm;
  if (b.bytes()) mem->from_host(b.data(), in, b.bytes());
}

}  // namespace lily
