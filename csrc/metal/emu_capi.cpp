// Test driver of the Metal backend on the emulated device (Linux CI), as a C API for ctypes
// (tests/metal/test_metal_backend.py). It holds a Config, Weights views, a State and a MetalBackend, and
// runs the engine's layer loop (core/engine.cpp: chunked prefill, embed -> layers -> head) until the
// engine can construct the Metal backend itself (make_backend("metal"), see docs/metal.md).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/config.h"
#include "core/state.h"
#include "core/weights.h"
#include "metal/backend_metal.h"

using namespace lily;

namespace {

struct Handle {
  Config cfg;
  Weights w;
  std::unique_ptr<metal::MetalBackend> be;
  std::unique_ptr<State> st;
};

int fail(char* err, int len, const std::exception& ex) {
  std::snprintf(err, static_cast<size_t>(len), "%s", ex.what());
  return 1;
}

}  // namespace

extern "C" {

// cfg: n_cfg (key, value) numbers and n_layers layer type names (ModelConfig.to_dict()). Tensors: name,
// data pointer, dtype (0 f32, 1 u16/bf16, 2 u32, 3 i32), ndim and shape (shapes concatenated). quant:
// module name, bits, group. kernel_libs: ';'-separated emulator builds of metal/*.metal. tensor_ops: the
// device reports Metal 4 tensor ops (the backend then runs the tensor-op GEMMs).
void* lily_metal_emu_new(int n_cfg, const char* const* keys, const double* vals, int n_layers,
                         const char* const* layer_types, int n_tensors, const char* const* names,
                         const void* const* ptrs, const int* dtypes, const int* ndims, const int64_t* shapes,
                         int n_quant, const char* const* qnames, const int* qbits, const int* qgroups,
                         const char* kernel_libs, int schedule, int max_threads, int64_t max_context, int debug,
                         int kv_bf16, int tensor_ops, char* err, int len) {
  try {
    ConfigDict d;
    for (int i = 0; i < n_cfg; ++i) d.nums[keys[i]] = vals[i];
    for (int i = 0; i < n_layers; ++i) d.layer_types.push_back(layer_types[i]);
    auto h = std::make_unique<Handle>();
    h->cfg = Config::from_dict(d);
    TensorMap tm;
    const int64_t* sh = shapes;
    for (int i = 0; i < n_tensors; ++i) {
      TensorView v;
      v.ptr = ptrs[i];
      v.dtype = dtypes[i] == 0 ? DType::F32 : dtypes[i] == 1 ? DType::U16 : dtypes[i] == 2 ? DType::U32 : DType::I32;
      v.shape.assign(sh, sh + ndims[i]);
      sh += ndims[i];
      tm[names[i]] = v;
    }
    QuantMap qm;
    for (int i = 0; i < n_quant; ++i) qm[qnames[i]] = {qbits[i], qgroups[i]};
    h->w = load_weights(h->cfg, tm, qm);
    metal::EmuOptions opt;
    opt.kernel_libs = kernel_libs;
    opt.schedule = schedule;
    opt.max_threads = static_cast<uint32_t>(max_threads);
    opt.tensor_ops = tensor_ops != 0;
    h->be = metal::make_metal_backend(h->cfg, h->w, metal::make_emulated_device(opt), debug != 0, kv_bf16 != 0);
    h->st = std::make_unique<State>(h->cfg, max_context, h->be->memory(), h->be->kv_elem());
    return h.release();
  } catch (const std::exception& ex) {
    fail(err, len, ex);
    return nullptr;
  }
}

void lily_metal_emu_free(void* p) { delete static_cast<Handle*>(p); }

int64_t lily_metal_emu_position(void* p) { return static_cast<Handle*>(p)->st->position; }

// Prefill/teacher-forced run of S tokens in chunks: logits [S, V] (all_logits) or [1, V] (last row).
int lily_metal_emu_forward(void* p, const int32_t* tokens, int64_t S, int all_logits, int64_t chunk, float* logits,
                           char* err, int len) {
  auto* h = static_cast<Handle*>(p);
  try {
    State& st = *h->st;
    const int64_t V = h->cfg.vocab;
    chunk = chunk > 0 ? chunk : h->be->default_chunk();
    st.reserve(st.position + S);
    for (int64_t c0 = 0; c0 < S; c0 += chunk) {
      const int64_t n = std::min(chunk, S - c0);
      h->be->embed(tokens + c0, n);
      for (int L = 0; L < h->cfg.n_layers; ++L) {
        const int slot = st.layer_slot[L];
        if (h->cfg.layer_types[L] == LayerType::Attention) h->be->attention_block(L, st.kv[slot], st.position, n);
        else h->be->deltanet_block(L, st.dn[slot], n);
        h->be->moe_block(L, n);
      }
      if (all_logits) h->be->head(0, n, logits + c0 * V);
      else if (c0 + n == S) h->be->head(n - 1, 1, logits);
      st.position += n;
    }
    h->be->sync();
    return 0;
  } catch (const std::exception& ex) {
    return fail(err, len, ex);
  }
}

// The double-buffered greedy decode loop: n steps from `first`; tokens [n], logits [n, V] (may be null).
int lily_metal_emu_decode(void* p, int32_t first, int n, int32_t* tokens, float* logits, char* err, int len) {
  auto* h = static_cast<Handle*>(p);
  try {
    h->be->decode_greedy(*h->st, first, n, tokens, logits);
    return 0;
  } catch (const std::exception& ex) {
    return fail(err, len, ex);
  }
}

// Snapshot / restore of the State, whose arrays live in device buffers (the backend's Memory).
void* lily_metal_emu_snapshot(void* p) {
  auto* h = static_cast<Handle*>(p);
  h->be->sync();
  return new State(h->st->snapshot());
}
void lily_metal_emu_restore(void* p, void* snap) { static_cast<Handle*>(p)->st->restore(*static_cast<State*>(snap)); }
void lily_metal_emu_free_snapshot(void* snap) { delete static_cast<State*>(snap); }

}  // extern "C"
