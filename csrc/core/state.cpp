#include "core/state.h"

#include <algorithm>
#include <stdexcept>

namespace lily {

State::State(const Config& cfg, int64_t max_ctx) : max_context(max_ctx) {
  kv_row = static_cast<int64_t>(cfg.n_kv_heads) * cfg.head_dim;
  for (auto t : cfg.layer_types) {
    if (t == LayerType::Attention) {
      layer_slot.push_back(static_cast<int>(kv.size()));
      kv.emplace_back();
    } else {
      layer_slot.push_back(static_cast<int>(dn.size()));
      DeltaNetState s;
      s.ssm.assign(static_cast<size_t>(cfg.lin_v_heads) * cfg.lin_v_dim * cfg.lin_k_dim, 0.f);
      s.conv.assign(static_cast<size_t>(cfg.conv_kernel - 1) * cfg.conv_dim(), 0.f);
      dn.push_back(std::move(s));
    }
  }
}

void State::reserve(int64_t tokens) {
  for (auto& c : kv) {
    if (c.capacity >= tokens) continue;
    int64_t cap = std::min<int64_t>(max_context, std::max<int64_t>({tokens, 2 * c.capacity, 256}));
    c.k.resize(static_cast<size_t>(cap * kv_row));
    c.v.resize(static_cast<size_t>(cap * kv_row));
    c.capacity = cap;
  }
}

State State::snapshot() const {
  State s;
  s.position = position;
  s.max_context = max_context;
  s.kv_row = kv_row;
  s.layer_slot = layer_slot;
  s.dn = dn;
  s.kv.resize(kv.size());
  const size_t used = static_cast<size_t>(position * kv_row);
  for (size_t i = 0; i < kv.size(); ++i) {
    s.kv[i].capacity = position;
    s.kv[i].k.assign(kv[i].k.begin(), kv[i].k.begin() + used);
    s.kv[i].v.assign(kv[i].v.begin(), kv[i].v.begin() + used);
  }
  return s;
}

void State::restore(const State& snap) {
  bool same = snap.kv_row == kv_row && snap.layer_slot == layer_slot && snap.kv.size() == kv.size() &&
              snap.dn.size() == dn.size();
  for (size_t i = 0; same && i < dn.size(); ++i)
    same = dn[i].ssm.size() == snap.dn[i].ssm.size() && dn[i].conv.size() == snap.dn[i].conv.size();
  if (!same) throw std::invalid_argument("[lily] State.restore: snapshot comes from a model with a different shape");
  if (snap.position > max_context)
    throw std::invalid_argument("[lily] State.restore: snapshot holds " + std::to_string(snap.position) +
                                " tokens, more than this state's max_context " + std::to_string(max_context));
  reserve(snap.position);
  const size_t used = static_cast<size_t>(snap.position * kv_row);
  for (size_t i = 0; i < kv.size(); ++i) {
    std::copy(snap.kv[i].k.begin(), snap.kv[i].k.begin() + used, kv[i].k.begin());
    std::copy(snap.kv[i].v.begin(), snap.kv[i].v.begin() + used, kv[i].v.begin());
  }
  for (size_t i = 0; i < dn.size(); ++i) {
    std::copy(snap.dn[i].ssm.begin(), snap.dn[i].ssm.end(), dn[i].ssm.begin());
    std::copy(snap.dn[i].conv.begin(), snap.dn[i].conv.end(), dn[i].conv.begin());
  }
  position = snap.position;
}

int64_t State::nbytes() const {
  int64_t n = static_cast<int64_t>(kv.size()) * 2 * position * kv_row * 4;
  for (const auto& s : dn) n += static_cast<int64_t>(s.ssm.size() + s.conv.size()) * 4;
  return n;
}

}  // namespace lily

