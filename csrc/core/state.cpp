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

State::State(const Config& cfg, int64_t max_ctx, std::shared_ptr<Memory> m, Elem e, bool mtp)
    : max_context(max_ctx), kv_elem(e), mem(std::move(m)), has_mtp(mtp), hidden(cfg.hidden) {
  if (has_mtp) last_hidden = Buffer(mem, hidden * 4);
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
  std::vector<KVCache*> caches;
  for (auto& c : kv) caches.push_back(&c);
  if (has_mtp) caches.push_back(&mtp_kv);
  for (KVCache* cp : caches) {
    KVCache& c = *cp;
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

namespace {
// A KV cache holding exactly `rows` tokens copied from src (rows * row_bytes bytes of K and of V).
KVCache copy_kv(const std::shared_ptr<Memory>& mem, const KVCache& src, int64_t rows, size_t row_bytes) {
  KVCache c;
  const size_t used = rows * row_bytes;
  c.capacity = rows, c.k = Buffer(mem, used), c.v = Buffer(mem, used);
  if (used) mem->copy(c.k.data(), src.k.data(), used), mem->copy(c.v.data(), src.v.data(), used);
  return c;
}
}  // namespace

State State::snapshot() const {
  State s;
  s.position = position, s.max_context = max_context, s.kv_row = kv_row, s.ssm_size = ssm_size;
  s.conv_size = conv_size, s.kv_elem = kv_elem, s.mem = mem, s.layer_slot = layer_slot;
  const size_t row_bytes = kv_row * elem_size(kv_elem);
  for (const KVCache& c : kv) s.kv.push_back(copy_kv(mem, c, position, row_bytes));
  s.deltanet.resize(deltanet.size());
  for (size_t i = 0; i < deltanet.size(); ++i) {
    s.deltanet[i].ssm = Buffer(mem, ssm_size * 4);
    s.deltanet[i].conv = Buffer(mem, conv_size * 4);
    mem->copy(s.deltanet[i].ssm.data(), deltanet[i].ssm.data(), ssm_size * 4);
    if (conv_size) mem->copy(s.deltanet[i].conv.data(), deltanet[i].conv.data(), conv_size * 4);
  }
  s.has_mtp = has_mtp, s.hidden = hidden;
  if (has_mtp) {
    s.mtp_rows = mtp_rows;
    s.mtp_kv = copy_kv(mem, mtp_kv, mtp_rows, row_bytes);
    s.last_hidden = Buffer(mem, hidden * 4);
    mem->copy(s.last_hidden.data(), last_hidden.data(), hidden * 4);
  }
  return s;
}

void State::restore(const State& snap) {
  const bool same = snap.kv_row == kv_row && snap.layer_slot == layer_slot && snap.kv.size() == kv.size() &&
                    snap.deltanet.size() == deltanet.size() && snap.ssm_size == ssm_size && snap.conv_size == conv_size &&
                    snap.kv_elem == kv_elem && snap.mem == mem && snap.has_mtp == has_mtp;
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
  if (has_mtp) {
    const size_t mtp_used = snap.mtp_rows * kv_row * elem_size(kv_elem);
    if (mtp_used) {
      mem->copy(mtp_kv.k.data(), snap.mtp_kv.k.data(), mtp_used);
      mem->copy(mtp_kv.v.data(), snap.mtp_kv.v.data(), mtp_used);
    }
    mem->copy(last_hidden.data(), snap.last_hidden.data(), hidden * 4);
    mtp_rows = snap.mtp_rows;
  }
  position = snap.position;
}

int64_t State::nbytes() const {
  const int64_t kv_rows = static_cast<int64_t>(kv.size()) * position + (has_mtp ? mtp_rows : 0);
  return kv_rows * 2 * kv_row * static_cast<int64_t>(elem_size(kv_elem)) +
         static_cast<int64_t>(deltanet.size()) * (ssm_size + conv_size) * 4 + (has_mtp ? hidden * 4 : 0);
}

void State::read_kv(size_t slot, bool value, float* out) const {
  const bool head = has_mtp && slot == kv.size();
  const int64_t n = (head ? mtp_rows : position) * kv_row;
  if (!n) return;
  const KVCache& c = head ? mtp_kv : kv.at(slot);
  const Buffer& b = value ? c.v : c.k;
  if (kv_elem == Elem::F32) return mem->to_host(out, b.data(), n * 4);
  std::vector<uint16_t> tmp(n);
  mem->to_host(tmp.data(), b.data(), n * 2);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(tmp[i]);
}

void State::write_kv(size_t slot, bool value, const float* in, int64_t rows) {
  const int64_t n = rows * kv_row;
  if (!n) return;
  KVCache& c = has_mtp && slot == kv.size() ? mtp_kv : kv.at(slot);
  if (rows > c.capacity) throw std::logic_error("[lily] State.write_kv: reserve first");
  Buffer& b = value ? c.v : c.k;
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
