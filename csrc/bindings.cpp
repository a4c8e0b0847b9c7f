// The only file that includes nanobind: lily._lily.Engine / State per docs/engine_contract.md.
// Weight arrays are borrowed zero-copy; the Engine wrapper keeps a reference to each of them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/engine.h"
#include "cpu/attention.h"
#include "cpu/deltanet.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "cpu/sample.h"
#include "cpu/thread_pool.h"
#include "cuda/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Array = nb::ndarray<nb::ro, nb::device::cpu>;

lily::DType to_dtype(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes != 1) return lily::DType::Other;
  if (t.code == static_cast<uint8_t>(C::Float) && t.bits == 32) return lily::DType::F32;
  if (t.code == static_cast<uint8_t>(C::UInt) && t.bits == 16) return lily::DType::U16;
  if (t.code == static_cast<uint8_t>(C::Bfloat) && t.bits == 16) return lily::DType::U16;
  if (t.code == static_cast<uint8_t>(C::UInt) && t.bits == 32) return lily::DType::U32;
  if (t.code == static_cast<uint8_t>(C::Int) && t.bits == 32) return lily::DType::I32;
  return lily::DType::Other;
}

lily::ConfigDict to_config_dict(const nb::dict& d) {
  lily::ConfigDict c;
  for (auto [k, v] : d) {
    std::string key = nb::cast<std::string>(nb::str(k));
    if (key == "layer_types") {
      for (auto t : nb::cast<nb::list>(v)) c.layer_types.push_back(nb::cast<std::string>(t));
    } else if (nb::isinstance<nb::bool_>(v) || nb::isinstance<nb::int_>(v) || nb::isinstance<nb::float_>(v)) {
      c.nums[key] = nb::cast<double>(v);
    }
  }
  return c;
}

struct PyState {
  std::shared_ptr<lily::State> st;
  std::weak_ptr<lily::Engine> engine;  // the state's engine: its launched steps finish before a copy of st

  void settle() const {
    if (auto e = engine.lock()) {
      nb::gil_scoped_release rel;  // a device step may take milliseconds: other Python threads run meanwhile
      e->sync();
    }
  }

  // Host copies of the whole state, by name: "position" (int64 scalar), "kv.i.k"/"kv.i.v" [position, Hkv*D],
  // "dn.i.ssm" [Hv*Dv*Dk], "dn.i.conv" [(K-1)*C] (i = slot among layers of that kind). For Session.save.
  nb::dict export_arrays() const {
    settle();
    nb::module_ np = nb::module_::import_("numpy");
    auto arr = [&](int64_t n, auto&& fill) {
      nb::object a = np.attr("empty")(n, "dtype"_a = np.attr("float32"));
      auto view = nb::cast<nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(a);
      fill(view.data());
      return a;
    };
    nb::dict d;
    d["position"] = np.attr("int64")(st->position);
    const int64_t used = st->position * st->kv_row;
    for (size_t i = 0; i < st->kv.size(); ++i)
      for (bool value : {false, true})
        d[("kv." + std::to_string(i) + (value ? ".v" : ".k")).c_str()] =
            arr(used, [&](float* p) { st->read_kv(i, value, p); }).attr("reshape")(st->position, st->kv_row);
    for (size_t i = 0; i < st->deltanet.size(); ++i) {
      const std::string key = "dn." + std::to_string(i);  // the saved-session format's names (SESSION_VERSION)
      d[(key + ".ssm").c_str()] = arr(st->ssm_size, [&](float* p) { st->read_deltanet(i, false, p); });
      d[(key + ".conv").c_str()] = arr(st->conv_size, [&](float* p) { st->read_deltanet(i, true, p); });
    }
    return d;
  }

  // Inverse of export_arrays; every array must be present with the size this model's state has.
  void import_arrays(nb::dict d) {
    settle();
    nb::module_ np = nb::module_::import_("numpy");
    auto get = [&](const std::string& name, int64_t n) {
      if (!d.contains(name.c_str())) throw std::invalid_argument("[lily] State.import_arrays: missing array '" + name + "'");
      auto a = nb::cast<nb::ndarray<const float, nb::c_contig, nb::device::cpu>>(
          np.attr("ascontiguousarray")(d[name.c_str()], "dtype"_a = np.attr("float32")));
      if (static_cast<int64_t>(a.size()) != n)
        throw std::invalid_argument("[lily] State.import_arrays: array '" + name + "' has " + std::to_string(a.size()) +
                                    " values, expected " + std::to_string(n));
      return a;
    };
    if (!d.contains("position")) throw std::invalid_argument("[lily] State.import_arrays: missing 'position'");
    const int64_t pos = nb::cast<int64_t>(nb::int_(d["position"]));
    if (pos < 0 || pos > st->max_context)
      throw std::invalid_argument("[lily] State.import_arrays: position " + std::to_string(pos) +
                                  " is outside 0..max_context " + std::to_string(st->max_context));
    // Validate every array before writing any, so a bad dict leaves the state untouched.
    std::vector<nb::ndarray<const float, nb::c_contig, nb::device::cpu>> kvs, dns;
    for (size_t i = 0; i < st->kv.size(); ++i) {
      kvs.push_back(get("kv." + std::to_string(i) + ".k", pos * st->kv_row));
      kvs.push_back(get("kv." + std::to_string(i) + ".v", pos * st->kv_row));
    }
    for (size_t i = 0; i < st->deltanet.size(); ++i) {
      dns.push_back(get("dn." + std::to_string(i) + ".ssm", st->ssm_size));
      dns.push_back(get("dn." + std::to_string(i) + ".conv", st->conv_size));
    }
    st->reserve(pos);
    for (size_t i = 0; i < st->kv.size(); ++i) {
      st->write_kv(i, false, kvs[2 * i].data(), pos);
      st->write_kv(i, true, kvs[2 * i + 1].data(), pos);
    }
    for (size_t i = 0; i < st->deltanet.size(); ++i) {
      st->write_deltanet(i, false, dns[2 * i].data());
      st->write_deltanet(i, true, dns[2 * i + 1].data());
    }
    st->position = pos;
  }
};

struct PyEngine {
  std::vector<Array> keep;  // borrowed weight arrays, alive as long as the engine
  std::shared_ptr<lily::Engine> eng;  // shared: states hold a weak reference (PyState::settle)

  PyEngine(nb::dict config, nb::dict tensors, nb::dict quant, int threads, int64_t max_context,
           const std::string& backend, nb::dict options) {
    lily::Config cfg = lily::Config::from_dict(to_config_dict(config));
    lily::TensorMap tmap;
    keep.reserve(nb::len(tensors));
    for (auto [k, v] : tensors) {
      std::string name = nb::cast<std::string>(nb::str(k));
      Array a;
      if (!nb::try_cast(v, a, /*convert=*/false))
        throw std::invalid_argument("[lily] tensor " + name + " is not a CPU array (got " +
                                    nb::cast<std::string>(nb::str(v.type())) + ")");
      // Only contiguous arrays are borrowed; a silent copy would duplicate the weights.
      int64_t expect = 1;
      for (int i = static_cast<int>(a.ndim()) - 1; i >= 0; --i) {
        if (a.shape(i) != 1 && a.stride(i) != expect)
          throw std::invalid_argument("[lily] tensor " + name + " is not C-contiguous");
        expect *= static_cast<int64_t>(a.shape(i));
      }
      lily::TensorView tv;
      tv.ptr = a.data();
      tv.dtype = to_dtype(a.dtype());
      for (size_t i = 0; i < a.ndim(); ++i) tv.shape.push_back(static_cast<int64_t>(a.shape(i)));
      tmap[name] = tv;
      keep.push_back(a);
    }
    lily::QuantMap qmap;
    for (auto [k, v] : quant) {
      auto t = nb::cast<nb::tuple>(v);
      if (nb::len(t) != 2) throw std::invalid_argument("[lily] quant entries must be (bits, group_size)");
      qmap[nb::cast<std::string>(nb::str(k))] = {nb::cast<int>(t[0]), nb::cast<int>(t[1])};
    }
    const char* dbg = std::getenv("LILY_DEBUG");
    const bool debug = dbg && *dbg && std::string(dbg) != "0";
    if (max_context < 1) throw std::invalid_argument("[lily] max_context must be >= 1");
    lily::BackendOptions opts;
    for (auto [k, v] : options) opts[nb::cast<std::string>(nb::str(k))] = nb::cast<std::string>(nb::str(v));
    nb::gil_scoped_release rel;
    eng = std::make_shared<lily::Engine>(cfg, tmap, qmap, threads, max_context, debug, backend, opts);
  }

  PyState new_state() const { return PyState{std::shared_ptr<lily::State>(eng->new_state()), eng}; }

  // tokens (any 1-D integer array-like) -> int32 ids, range-checked against the vocabulary.
  std::vector<int32_t> parse_tokens(nb::handle tokens) const {
    nb::module_ np = nb::module_::import_("numpy");
    nb::object arr = np.attr("asarray")(tokens);
    if (nb::cast<int>(arr.attr("ndim")) != 1)
      throw std::invalid_argument("[lily] forward: tokens must be a 1-D array of token ids");
    const std::string kind = nb::cast<std::string>(arr.attr("dtype").attr("kind"));
    if (kind != "i" && kind != "u" && !(kind == "f" && nb::cast<int64_t>(arr.attr("size")) == 0))
      throw std::invalid_argument("[lily] forward: tokens must be integers, got dtype " +
                                  nb::cast<std::string>(nb::str(arr.attr("dtype"))));
    auto ids64 = nb::cast<nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(
        np.attr("ascontiguousarray")(arr, "dtype"_a = np.attr("int64")));
    const int64_t S = static_cast<int64_t>(ids64.shape(0));
    const int64_t V = eng->config().vocab;
    std::vector<int32_t> ids(S);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t t = ids64.data()[i];
      if (t < 0 || t >= V)
        throw std::invalid_argument("[lily] forward: token id " + std::to_string(t) + " at index " +
                                    std::to_string(i) + " is out of range for vocab_size " + std::to_string(V));
      ids[i] = static_cast<int32_t>(t);
    }
    return ids;
  }

  // Teacher-forced run that also returns the residual stream after every sub-block:
  // {"embed", "mixer.L", "moe.L": float32 [S, H], "logits": float32 [S, V]}.
  nb::dict forward_trace(PyState& state, nb::handle tokens, int64_t chunk_size) {
    std::vector<int32_t> ids = parse_tokens(tokens);
    const int64_t S = static_cast<int64_t>(ids.size());
    const int64_t V = eng->config().vocab, H = eng->config().hidden;
    std::vector<float> logits(static_cast<size_t>(std::max<int64_t>(S * V, 1)));
    lily::Trace trace;
    {
      nb::gil_scoped_release rel;
      eng->forward(*state.st, ids.data(), S, lily::LogitsMode::All, chunk_size, logits.data(), &trace);
    }
    nb::module_ np = nb::module_::import_("numpy");
    auto to_np = [&](const std::vector<float>& v, int64_t rows, int64_t cols) {
      nb::object a = np.attr("empty")(nb::make_tuple(rows, cols), "dtype"_a = np.attr("float32"));
      auto view = nb::cast<nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>>(a);
      std::copy(v.begin(), v.begin() + rows * cols, view.data());
      return a;
    };
    nb::dict d;
    for (auto& [name, v] : trace) d[name.c_str()] = to_np(v, S, H);
    d["logits"] = to_np(logits, S, V);
    return d;
  }

  nb::ndarray<nb::numpy, float, nb::ndim<2>> forward(PyState& state, nb::handle tokens, const std::string& logits,
                                                     int64_t chunk_size) {
    const lily::LogitsMode mode = lily::parse_logits_mode(logits);
    std::vector<int32_t> ids = parse_tokens(tokens);
    const int64_t S = static_cast<int64_t>(ids.size());
    const int64_t V = eng->config().vocab;
    const int64_t rows = lily::Engine::logits_rows(mode, S);
    float* out = new float[static_cast<size_t>(std::max<int64_t>(rows * V, 1))];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    {
      nb::gil_scoped_release rel;
      eng->forward(*state.st, ids.data(), S, mode, chunk_size, out);
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {static_cast<size_t>(rows), static_cast<size_t>(V)},
                                                      owner);
  }

  nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> decode_greedy(PyState& state, int64_t token, int64_t n_steps) {
    const int64_t V = eng->config().vocab;
    if (token < 0 || token >= V)
      throw std::invalid_argument("[lily] decode_greedy: token id " + std::to_string(token) +
                                  " is out of range for vocab_size " + std::to_string(V));
    if (n_steps < 0) throw std::invalid_argument("[lily] decode_greedy: n_steps must be >= 0");
    int32_t* out = new int32_t[static_cast<size_t>(std::max<int64_t>(n_steps, 1))];
    nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
    {
      nb::gil_scoped_release rel;
      eng->decode_greedy(*state.st, static_cast<int32_t>(token), n_steps, out);
    }
    return nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(out, {static_cast<size_t>(n_steps)}, owner);
  }
};


using F32Vec = nb::ndarray<nb::numpy, float, nb::ndim<1>>;
using U8Array = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32Array = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

F32Vec new_row(int64_t V, float** data) {
  float* out = new float[static_cast<size_t>(V)];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  *data = out;
  return F32Vec(out, {static_cast<size_t>(V)}, owner);
}

// A token stream (lily::TokenStream); holds its engine and state alive.
struct PyTokenStream {
  nb::object engine;  // the PyEngine
  PyState state;
  std::unique_ptr<lily::TokenStream> s;
  int64_t vocab = 0;

  lily::TokenStream& get() {
    if (!s) throw std::logic_error("[lily] TokenStream: closed");
    return *s;
  }
  int32_t next() {
    lily::TokenStream& t = get();
    nb::gil_scoped_release rel;
    return t.next();
  }
  F32Vec step(int64_t token) {
    if (token < 0 || token >= vocab)
      throw std::invalid_argument("[lily] TokenStream.step: token id " + std::to_string(token) +
                                  " is out of range for vocab_size " + std::to_string(vocab));
    lily::TokenStream& t = get();
    float* out = nullptr;
    F32Vec row = new_row(vocab, &out);
    {
      nb::gil_scoped_release rel;
      t.step(static_cast<int32_t>(token), out);
    }
    return row;
  }
  nb::object close(bool logits) {
    if (!s) return nb::none();
    float* out = nullptr;
    F32Vec row = new_row(vocab, &out);
    bool have;
    {
      nb::gil_scoped_release rel;
      have = s->close(logits ? out : nullptr);
    }
    if (!have) return nb::none();
    return nb::cast(row);
  }
};

lily::SampleOptions sample_options(double temperature, int64_t top_k, double top_p, double min_p,
                                   double repetition_penalty, double presence_penalty, double frequency_penalty,
                                   const std::vector<int32_t>& bias_ids, const std::vector<float>& bias_vals,
                                   const std::optional<U8Array>& seen, const std::optional<I32Array>& counts) {
  lily::SampleOptions o;
  o.temperature = static_cast<float>(temperature);
  o.top_k = static_cast<int32_t>(std::clamp<int64_t>(top_k, -1, INT32_MAX));
  o.top_p = static_cast<float>(top_p);
  o.min_p = static_cast<float>(min_p);
  o.repetition_penalty = static_cast<float>(repetition_penalty);
  o.presence_penalty = static_cast<float>(presence_penalty);
  o.frequency_penalty = static_cast<float>(frequency_penalty);
  o.bias_ids = bias_ids;
  o.bias_vals = bias_vals;
  if (seen) o.seen.assign(seen->data(), seen->data() + seen->shape(0));
  if (counts) o.counts.assign(counts->data(), counts->data() + counts->shape(0));
  return o;
}

nb::dict build_info() {
  nb::dict d;
  nb::list backends;
  std::string all = LILY_BACKENDS;
  size_t p = 0;
  while (p <= all.size()) {
    size_t q = all.find(',', p);
    if (q == std::string::npos) q = all.size();
    if (q > p) backends.append(all.substr(p, q - p));
    p = q + 1;
  }
#ifdef LILY_HAVE_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  d["backends"] = backends;
  d["simd"] = lily::cpu_simd_features();
  d["simd_flags"] = std::string(LILY_SIMD_FLAGS);
  d["compiler"] = std::string(LILY_COMPILER);
  d["default_chunk_cpu"] = lily::Engine::kDefaultChunkCpu;
  return d;
}

int cuda_device_count() {
#ifdef LILY_HAVE_CUDA
  return lily::cuda::device_count();
#else
  return 0;
#endif
}

}  // namespace

// ---- lily._lily.ops: the CPU backend's kernels one by one, numpy in / numpy out (tests/kernels) ----
// Every output is allocated NaN-filled before the kernel writes it, so an element a kernel skips shows up.
// Legend: S rows, C conv channels, E experts, H hidden, K conv taps, cap KV cache capacity (rows).
namespace {
namespace cpu_ops {

namespace kp = lily::kp;

using F32 = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using I32 = nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu>;
using CArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;  // weights in any dtype, made contiguous
using OptArray = std::optional<CArray>;

// Two threads, so the kernels' work split (row ranges per thread) is exercised as in the engine.
lily::ThreadPool& pool() { static lily::ThreadPool p(2); return p; }

template <class A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < a.ndim(); ++i) s.push_back(static_cast<int64_t>(a.shape(i)));
  return s;
}

void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string("[ops.") + op + "] " + what);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + (s[i] < 0 ? std::string("*") : std::to_string(s[i]));
  return t + "]";
}

// Throws "[ops.OP] NAME must be [d0, ...], got [...]" unless a has these extents (-1: any).
template <class A>
std::vector<int64_t> check_shape(const char* op, const char* name, const A& a, std::vector<int64_t> dims) {
  std::vector<int64_t> s = shape_of(a);
  bool ok = s.size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] < 0 || dims[i] == s[i];
  require(ok, op, std::string(name) + " must be " + shape_str(dims) + ", got " + shape_str(s));
  return s;
}

// A float32 numpy array of `shape` filled with NaN (or a copy of `from`, whose shape it then has).
std::pair<nb::object, float*> new_array(const std::vector<int64_t>& shape, const F32* from = nullptr) {
  nb::module_ np = nb::module_::import_("numpy");
  nb::list dims;
  for (int64_t d : shape) dims.append(d);
  nb::object a = np.attr("full")(nb::tuple(dims), NAN, "dtype"_a = np.attr("float32"));
  float* p = nb::cast<nb::ndarray<float, nb::c_contig, nb::device::cpu>>(a).data();
  if (from) std::copy(from->data(), from->data() + from->size(), p);
  return {a, p};
}

// A Linear over checkpoint-format arrays (lily.quant): bits 4/8 -> weight u32 [E?, out, in*bits/32] with
// scales/biases bf16 [E?, out, in/group]; bits 0 -> weight bf16 (uint16) or float32 [E?, out, in].
lily::Linear make_linear(const char* op, const std::string& name, const CArray& weight, const OptArray& scales,
                         const OptArray& biases, int bits, int group, bool stacked) {
  const std::string what = "weight '" + name + "'";
  std::vector<int64_t> s = shape_of(weight);
  require(s.size() == (stacked ? 3u : 2u), op,
          what + " must be " + (stacked ? "[E, out, cols]" : "[out, cols]") + ", got " + shape_str(s));
  lily::Linear l;
  l.experts = stacked ? s[0] : 0;
  l.out = s[s.size() - 2];
  const int64_t cols = s.back();
  if (bits) {
    require((bits == 4 || bits == 8) && group > 0 && group % 32 == 0, op,
            what + ": bits must be 4 or 8 and group a positive multiple of 32, got bits=" + std::to_string(bits) +
                " group=" + std::to_string(group));
    require(scales && biases, op, what + ": a quantized weight needs scales and biases");
    require(to_dtype(weight.dtype()) == lily::DType::U32, op, what + ": quantized codes must be uint32");
    l.kind = lily::Linear::Kind::Quant;
    l.bits = bits;
    l.group = group;
    l.in = cols * 32 / bits;
    require(l.in % group == 0, op, what + ": in " + std::to_string(l.in) + " is not a multiple of group");
    std::vector<int64_t> want = {l.out, l.in / group};
    if (stacked) want.insert(want.begin(), l.experts);
    for (const CArray* a : {&*scales, &*biases})
      require(shape_of(*a) == want && to_dtype(a->dtype()) == lily::DType::U16, op,
              what + ": scales and biases must be bf16 (uint16) " + shape_str(want) + ", got " +
                  shape_str(shape_of(*a)));
    l.codes = static_cast<const uint32_t*>(weight.data());
    l.scales = static_cast<const uint16_t*>(scales->data());
    l.biases = static_cast<const uint16_t*>(biases->data());
  } else {
    const lily::DType t = to_dtype(weight.dtype());
    require(t == lily::DType::U16 || t == lily::DType::F32, op,
            what + ": a dense weight must be bf16 (uint16) or float32, got " + lily::dtype_name(t));
    l.kind = t == lily::DType::U16 ? lily::Linear::Kind::DenseBF16 : lily::Linear::Kind::DenseF32;
    l.in = cols;
    l.dense = weight.data();
  }
  return l;
}

// Module `prefix + m` of a tensors/quant dict pair in the engine contract (lily.testing.random_weights).
lily::Linear dict_linear(const char* op, nb::dict tensors, nb::dict quant, const std::string& mod, bool stacked) {
  auto get = [&](const std::string& key) {
    require(tensors.contains(key.c_str()), op, "missing tensor '" + key + "'");
    return nb::cast<CArray>(tensors[key.c_str()]);
  };
  if (!quant.contains(mod.c_str())) return make_linear(op, mod, get(mod + ".weight"), {}, {}, 0, 0, stacked);
  auto q = nb::cast<nb::tuple>(quant[mod.c_str()]);
  return make_linear(op, mod, get(mod + ".weight"), get(mod + ".scales"), get(mod + ".biases"),
                     nb::cast<int>(q[0]), nb::cast<int>(q[1]), stacked);
}

nb::object rms_norm(const F32& x, const F32& w, double eps) {
  const int64_t n = check_shape("rms_norm", "w", w, {-1})[0];
  const int64_t rows = check_shape("rms_norm", "x", x, {-1, n})[0];
  auto [y, py] = new_array({rows, n});
  nb::gil_scoped_release rel;
  lily::cpu::rms_norm(pool(), x.data(), w.data(), static_cast<float>(eps), rows, n, py);
  return y;
}

nb::object gated_rms_norm(const F32& o, const F32& z, const F32& w, double eps) {
  const int64_t n = check_shape("gated_rms_norm", "w", w, {-1})[0];
  std::vector<int64_t> s = check_shape("gated_rms_norm", "o", o, {-1, -1});
  check_shape("gated_rms_norm", "z", z, s);
  require(n > 0 && s[1] % n == 0, "gated_rms_norm", "o's row length must be a multiple of w's length");
  auto [y, py] = new_array(s);
  nb::gil_scoped_release rel;
  lily::cpu::gated_rms_norm(pool(), o.data(), z.data(), w.data(), static_cast<float>(eps), s[0], s[1] / n, n, py);
  return y;
}

nb::object linear(const F32& x, const CArray& weight, const OptArray& scales, const OptArray& biases, int bits,
                  int group) {
  const lily::Linear W = make_linear("linear", "weight", weight, scales, biases, bits, group, false);
  const int64_t S = check_shape("linear", "x", x, {-1, W.in})[0];
  auto [y, py] = new_array({S, W.out});
  nb::gil_scoped_release rel;
  lily::cpu::linear(pool(), W, x.data(), S, py);
  return y;
}

nb::object embed(const I32& ids, const CArray& weight, const OptArray& scales, const OptArray& biases, int bits,
                 int group) {
  const lily::Linear W = make_linear("embed", "weight", weight, scales, biases, bits, group, false);
  const int64_t S = check_shape("embed", "ids", ids, {-1})[0];
  for (int64_t s = 0; s < S; ++s)
    require(ids.data()[s] >= 0 && ids.data()[s] < W.out, "embed", "id out of range at index " + std::to_string(s));
  auto [x, px] = new_array({S, W.in});
  nb::gil_scoped_release rel;
  lily::cpu::embed(pool(), W, ids.data(), S, px);
  return x;
}

nb::tuple attention(const F32& qg, const F32& k, const F32& v, const F32& q_norm, const F32& k_norm,
                    const F32& k_cache, const F32& v_cache, int64_t pos0, int n_heads, int n_kv_heads, int head_dim,
                    int rotary_dim, double rope_theta, double eps) {
  const char* op = "attention";
  require(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, op, "n_heads must be a multiple of n_kv_heads");
  require(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, op, "rotary_dim must be even, <= head_dim");
  const int64_t D = head_dim, row = n_kv_heads * D;
  const int64_t S = check_shape(op, "qg", qg, {-1, 2 * n_heads * D})[0];
  check_shape(op, "k", k, {S, row});
  check_shape(op, "v", v, {S, row});
  check_shape(op, "q_norm", q_norm, {D});
  check_shape(op, "k_norm", k_norm, {D});
  const int64_t cap = check_shape(op, "k_cache", k_cache, {-1, row})[0];
  check_shape(op, "v_cache", v_cache, {cap, row});
  require(pos0 >= 0 && pos0 + S <= cap, op, "the cache must hold rows 0 .. pos0+S-1 (cap " + std::to_string(cap) + ")");
  // qg and k are normed and rotated in place: work on copies; cache rows pos0.. are poisoned, then written.
  auto [qg_w, pqg] = new_array(shape_of(qg), &qg);
  auto [k_w, pk] = new_array(shape_of(k), &k);
  auto [kc, pkc] = new_array({cap, row}, &k_cache);
  auto [vc, pvc] = new_array({cap, row}, &v_cache);
  std::fill(pkc + pos0 * row, pkc + (pos0 + S) * row, NAN);
  std::fill(pvc + pos0 * row, pvc + (pos0 + S) * row, NAN);
  auto [o, po] = new_array({S, n_heads * D});
  kp::AttentionParams p{n_heads, n_kv_heads, head_dim, rotary_dim, static_cast<float>(rope_theta),
                        static_cast<float>(eps), 1.f / std::sqrt(static_cast<float>(head_dim)), 0, pos0, S};
  {
    nb::gil_scoped_release rel;
    lily::cpu::attention_forward(pool(), p, pqg, pk, v.data(), q_norm.data(), k_norm.data(), pkc, pvc, po);
  }
  return nb::make_tuple(o, kc, vc);
}

nb::tuple deltanet(const F32& qkv, const F32& z, const F32& b, const F32& a, const F32& conv_w, const F32& dt_bias,
                   const F32& a_log, const F32& norm_w, const F32& conv_state, const F32& ssm, int k_heads,
                   double norm_eps, double qk_eps) {
  const char* op = "deltanet";
  std::vector<int64_t> st = check_shape(op, "ssm", ssm, {-1, -1, -1});
  const int64_t Hv = st[0], Dv = st[1], Dk = st[2];
  require(k_heads > 0 && Hv % k_heads == 0, op, "v heads (ssm.shape[0]) must be a multiple of k_heads");
  const int64_t C = 2 * k_heads * Dk + Hv * Dv;
  const int64_t S = check_shape(op, "qkv", qkv, {-1, C})[0];
  const int64_t K = check_shape(op, "conv_w", conv_w, {C, -1})[1];
  require(K >= 1, op, "conv_w needs at least one tap");
  check_shape(op, "z", z, {S, Hv * Dv});
  check_shape(op, "b", b, {S, Hv});
  check_shape(op, "a", a, {S, Hv});
  check_shape(op, "dt_bias", dt_bias, {Hv});
  check_shape(op, "a_log", a_log, {Hv});
  check_shape(op, "norm_w", norm_w, {Dv});
  check_shape(op, "conv_state", conv_state, {K - 1, C});
  auto [conv, pconv] = new_array({K - 1, C}, &conv_state);  // in/out: read before it is written
  auto [rec, prec] = new_array({Hv, Dv, Dk}, &ssm);
  auto [u, pu] = new_array({S, C});
  auto [y, py] = new_array({S, Hv * Dv});
  kp::DeltaNetParams p{k_heads, static_cast<int32_t>(Hv), static_cast<int32_t>(Dk), static_cast<int32_t>(Dv),
                       static_cast<int32_t>(K), static_cast<int32_t>(C), static_cast<float>(norm_eps),
                       static_cast<float>(qk_eps), S};
  {
    nb::gil_scoped_release rel;
    lily::cpu::deltanet_forward(pool(), p, qkv.data(), z.data(), b.data(), a.data(), conv_w.data(), dt_bias.data(),
                                a_log.data(), norm_w.data(), pconv, prec, pu, py);
  }
  return nb::make_tuple(y, conv, rec);
}

nb::tuple moe_route(const F32& logits, int top_k, bool norm_topk_prob) {
  std::vector<int64_t> s = check_shape("moe_route", "logits", logits, {-1, -1});
  require(top_k >= 1 && top_k <= s[1], "moe_route", "top_k must be in 1 .. E");
  nb::module_ np = nb::module_::import_("numpy");
  nb::object ids = np.attr("full")(nb::make_tuple(s[0], top_k), -1, "dtype"_a = np.attr("int32"));
  auto [wts, pw] = new_array({s[0], top_k});
  int32_t* pid = nb::cast<nb::ndarray<int32_t, nb::c_contig, nb::device::cpu>>(ids).data();
  kp::MoeParams p{0, static_cast<int32_t>(s[1]), top_k, 0, 0, norm_topk_prob ? 1 : 0, s[0]};
  lily::cpu::moe_route(p, logits.data(), pid, pw);
  return nb::make_tuple(ids, wts);
}

// The MoE FFN of one layer: modules prefix + {gate, switch_mlp.{gate,up,down}_proj, shared_expert.{gate,up,down}_proj,
// shared_expert_gate} of the engine contract's tensors / quant dicts.
nb::object moe(const F32& h, nb::dict tensors, nb::dict quant, const std::string& prefix, int top_k,
               bool norm_topk_prob) {
  const char* op = "moe";
  lily::MoeWeights w;
  w.router = dict_linear(op, tensors, quant, prefix + "gate", false);
  w.gate = dict_linear(op, tensors, quant, prefix + "switch_mlp.gate_proj", true);
  w.up = dict_linear(op, tensors, quant, prefix + "switch_mlp.up_proj", true);
  w.down = dict_linear(op, tensors, quant, prefix + "switch_mlp.down_proj", true);
  w.sh_gate = dict_linear(op, tensors, quant, prefix + "shared_expert.gate_proj", false);
  w.sh_up = dict_linear(op, tensors, quant, prefix + "shared_expert.up_proj", false);
  w.sh_down = dict_linear(op, tensors, quant, prefix + "shared_expert.down_proj", false);
  w.sh_expert_gate = dict_linear(op, tensors, quant, prefix + "shared_expert_gate", false);
  const int64_t H = w.router.in, E = w.router.out, I = w.gate.out, Is = w.sh_gate.out;
  auto is = [](const lily::Linear& l, int64_t e, int64_t o, int64_t i) {
    return l.experts == e && l.out == o && l.in == i; };
  require(is(w.gate, E, I, H) && is(w.up, E, I, H) && is(w.down, E, H, I) && is(w.sh_up, 0, Is, H) &&
              is(w.sh_down, 0, H, Is) && is(w.sh_expert_gate, 0, 1, H),
          op, "module shapes disagree: router [E, H], experts gate/up [E, I, H], down [E, H, I], shared gate/up "
              "[Is, H], down [H, Is], shared_expert_gate [1, H]");
  require(top_k >= 1 && top_k <= E, op, "top_k must be in 1 .. E");
  const int64_t S = check_shape(op, "h", h, {-1, H})[0];
  auto [out, pout] = new_array({S, H});
  kp::MoeParams p{static_cast<int32_t>(H), static_cast<int32_t>(E), top_k, static_cast<int32_t>(I),
                  static_cast<int32_t>(Is), norm_topk_prob ? 1 : 0, S};
  nb::gil_scoped_release rel;
  lily::cpu::MoeScratch scratch;
  lily::cpu::moe_forward(pool(), p, w, h.data(), pout, scratch);
  return out;
}

void register_cpu_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "The CPU backend's kernels one by one, numpy in / numpy out, for the "
                                           "kernel tests (tests/kernels); outputs start NaN-filled.");
  ops.def("rms_norm", &rms_norm, "x"_a, "w"_a, "eps"_a, "x float32 [rows, n], w [n] -> y [rows, n]");
  ops.def("gated_rms_norm", &gated_rms_norm, "o"_a, "z"_a, "w"_a, "eps"_a,
          "o, z float32 [rows, heads*n], w [n] -> rms_norm(o per head; w) * silu(z) [rows, heads*n]");
  ops.def("linear", &linear, "x"_a, "weight"_a, "scales"_a = nb::none(), "biases"_a = nb::none(), "bits"_a = 0,
          "group"_a = 0, "x float32 [S, in] -> x W^T [S, out]; W in a checkpoint format (lily.quant): bits 4/8 with "
          "codes uint32 [out, in*bits/32] and bf16 scales/biases [out, in/group], or bits 0 dense bf16/float32 "
          "[out, in]");
  ops.def("embed", &embed, "ids"_a, "weight"_a, "scales"_a = nb::none(), "biases"_a = nb::none(), "bits"_a = 0,
          "group"_a = 0, "ids int32 [S] -> rows of W [S, in] (formats as linear)");
  ops.def("attention", &attention, "qg"_a, "k"_a, "v"_a, "q_norm"_a, "k_norm"_a, "k_cache"_a, "v_cache"_a, "pos0"_a,
          "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rotary_dim"_a, "rope_theta"_a, "eps"_a,
          "Gated attention of S rows at positions pos0.. (S = 1: a decode step): qg [S, Hq*2D] per head "
          "[query | gate], k, v [S, Hkv*D], q_norm, k_norm [D], k_cache, v_cache [cap, Hkv*D] -> (o [S, Hq*D], "
          "k_cache', v_cache' with rows pos0..pos0+S-1 written)");
  ops.def("deltanet", &deltanet, "qkv"_a, "z"_a, "b"_a, "a"_a, "conv_w"_a, "dt_bias"_a, "a_log"_a, "norm_w"_a,
          "conv_state"_a, "ssm"_a, "k_heads"_a, "norm_eps"_a, "qk_eps"_a = 1e-6,
          "Gated DeltaNet core of S rows (conv + SiLU, q/k l2 norm, gates, recurrence, gated norm): qkv [S, C], "
          "z [S, Hv*Dv], b, a [S, Hv], conv_w [C, K], dt_bias, a_log [Hv], norm_w [Dv], conv_state [K-1, C], "
          "ssm [Hv, Dv, Dk] -> (y [S, Hv*Dv], conv_state', ssm')");
  ops.def("moe_route", &moe_route, "logits"_a, "top_k"_a, "norm_topk_prob"_a,
          "router logits [S, E] -> (expert ids int32 [S, k], weights [S, k])");
  ops.def("moe", &moe, "h"_a, "tensors"_a, "quant"_a, "prefix"_a, "top_k"_a, "norm_topk_prob"_a,
          "MoE FFN of h [S, H] (routing, experts, shared expert, combine) -> [S, H]; weights by module name "
          "under prefix (e.g. 'model.layers.0.mlp.') in the engine contract's tensors / quant dicts");
  ops.attr("sample_draw") = m.attr("sample_draw");
}

}  // namespace cpu_ops
}  // namespace
void register_cuda_ops(nb::module_& parent);  // lily._lily.cuda_ops (bindings_cuda_ops.cpp; CUDA builds only)

NB_MODULE(_lily, m) {
  m.doc() = "lily C++ engine (see docs/engine_contract.md)";

  nb::class_<PyState>(m, "State")
      .def_prop_ro("position", [](const PyState& s) { return s.st->position; }, "tokens seen")
      .def_prop_ro("nbytes", [](const PyState& s) { return s.st->nbytes(); },
                   "bytes held: KV in use + fixed recurrent/conv state")
      .def("snapshot", [](const PyState& s) {
             s.settle();
             return PyState{std::make_shared<lily::State>(s.st->snapshot()), s.engine};
           },
           "deep, independent copy (KV up to position, DeltaNet + conv state)")
      .def("restore", [](PyState& s, const PyState& snap) {
             s.settle();
             s.st->restore(*snap.st);
           }, "snap"_a,
           "make this state equal to snap (snap stays usable)")
      .def("export_arrays", &PyState::export_arrays, "host copies of the state by name (for saving)")
      .def("import_arrays", &PyState::import_arrays, "arrays"_a, "inverse of export_arrays")
      .def("__repr__", [](const PyState& s) {
        return "<lily._lily.State position=" + std::to_string(s.st->position) +
               " nbytes=" + std::to_string(s.st->nbytes()) + ">";
      });

  nb::class_<PyTokenStream>(m, "TokenStream")
      .def_prop_ro("device", [](PyTokenStream& t) { return t.get().device(); },
                   "True: the device draws (next()); False: lock-step (step(token))")
      .def("next", &PyTokenStream::next, "the next token drawn on the device, or -1 when the stream has ended")
      .def("step", &PyTokenStream::step, "token"_a, "lock-step: run token one step; its logits float32 [vocab]")
      .def("close", &PyTokenStream::close, "logits"_a = false,
           "wait for the launched steps and end the stream; logits=True: the logits [vocab] after the last fed "
           "token, or None when the device no longer holds them")
      .def_prop_ro("fed", [](PyTokenStream& t) { return t.s ? t.s->fed() : 0; },
                   "tokens run through the model by this stream (first included)")
      .def_prop_ro("returned", [](PyTokenStream& t) { return t.s ? t.s->returned() : 0; }, "tokens next() returned")
      .def_prop_ro("ended", [](PyTokenStream& t) { return !t.s || t.s->ended(); });

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<nb::dict, nb::dict, nb::dict, int, int64_t, const std::string&, nb::dict>(), "config"_a,
           "tensors"_a,
           "quant"_a, "threads"_a = 0, "max_context"_a = 4096, "backend"_a = "cpu",
           "options"_a = nb::dict(),
           "backend: 'cpu' | 'cuda' | 'metal' (RuntimeError when not built or no device is visible); options: "
           "backend-specific construction options by name (str -> str)")
      .def("new_state", &PyEngine::new_state, "empty context at position 0")
      .def("forward_trace", &PyEngine::forward_trace, "state"_a, "tokens"_a, "chunk_size"_a = 0)
      .def("forward", &PyEngine::forward, "state"_a, "tokens"_a, "logits"_a = "last", "chunk_size"_a = 0,
           "Run tokens (int [S]) through the model; returns float32 logits [0|1|S, vocab].")
      .def("decode_greedy", &PyEngine::decode_greedy, "state"_a, "token"_a, "n_steps"_a,
           "Greedy decoding: feeds token, then each argmax; returns the n_steps argmax tokens (int32) and "
           "advances the state by n_steps. On the GPU the loop runs on the device (no logits copies).")
      .def("open_stream",
           [](PyEngine& e, PyState& state, int64_t first, int64_t max_tokens, std::vector<int32_t> stop_ids,
              bool device, double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
              double presence_penalty, double frequency_penalty, std::vector<int32_t> bias_ids,
              std::vector<float> bias_vals, std::optional<U8Array> seen, std::optional<I32Array> counts,
              uint64_t seed) {
             const int64_t V = e.eng->config().vocab;
             if (first < 0 || first >= V)
               throw std::invalid_argument("[lily] open_stream: token id " + std::to_string(first) +
                                           " is out of range for vocab_size " + std::to_string(V));
             lily::StreamOptions o;
             o.max_tokens = max_tokens;
             o.stop_ids = std::move(stop_ids);
             o.device = device;
             o.seed = seed;
             o.sample = sample_options(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                       frequency_penalty, bias_ids, bias_vals, seen, counts);
             auto py = std::make_unique<PyTokenStream>();
             py->engine = nb::find(&e);
             py->state = state;
             py->vocab = V;
             {
               nb::gil_scoped_release rel;
               py->s = e.eng->open_stream(*state.st, static_cast<int32_t>(first), o);
             }
             return py.release();
           },
           "state"_a, "first"_a, "max_tokens"_a, "stop_ids"_a = std::vector<int32_t>{}, "device"_a = true,
           "temperature"_a = 0.0, "top_k"_a = 0, "top_p"_a = 1.0, "min_p"_a = 0.0, "repetition_penalty"_a = 1.0,
           "presence_penalty"_a = 0.0, "frequency_penalty"_a = 0.0, "bias_ids"_a = std::vector<int32_t>{},
           "bias_vals"_a = std::vector<float>{}, "seen"_a = nb::none(), "counts"_a = nb::none(), "seed"_a = 0,
           nb::rv_policy::take_ownership,
           "A token stream from `first` (the last sampled token, at state.position): the token loop in the "
           "extension. device=True draws on the device where the backend can (TokenStream.device says; next() "
           "returns tokens, running one step ahead), else lock-step (step(token) returns the logits). seen: uint8 "
           "[vocab] or empty (tokens in the context), counts: int32 [vocab] or empty (generated so far).")
      .def("set_backend_flag", [](PyEngine& e, const std::string& name, int64_t value) {
             nb::gil_scoped_release rel;
             e.eng->set_backend_flag(name, value);
           }, "name"_a, "value"_a, "backend switch for ablations, e.g. cuda: 'cuda_graph' 0 | 1")
      .def("backend_flag", [](PyEngine& e, const std::string& name) {
             nb::gil_scoped_release rel;
             return e.eng->backend_flag(name);
           }, "name"_a, "backend switch or counter, e.g. cuda: 'cuda_graph', 'graph_kernels'")
      .def_prop_ro("max_context", [](const PyEngine& e) { return e.eng->max_context(); })
      .def_prop_ro("backend", [](const PyEngine& e) { return std::string(e.eng->backend_name()); })
      .def_prop_ro("threads", [](const PyEngine& e) { return e.eng->threads(); })
      .def_prop_ro("vocab_size", [](const PyEngine& e) { return e.eng->config().vocab; })
      .def_prop_ro("debug", [](const PyEngine& e) { return e.eng->debug(); })
      .def_prop_ro("default_chunk", [](const PyEngine& e) { return e.eng->default_chunk(); });

  m.def("sample_draw",
        [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> logits, double uniform,
           double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
           double presence_penalty, double frequency_penalty, std::vector<int32_t> bias_ids,
           std::vector<float> bias_vals, std::optional<U8Array> seen, std::optional<I32Array> counts) {
          const int64_t V = static_cast<int64_t>(logits.shape(0));
          lily::SampleOptions o = sample_options(temperature, top_k, top_p, min_p, repetition_penalty,
                                                 presence_penalty, frequency_penalty, bias_ids, bias_vals, seen,
                                                 counts);
          if (V < 1) throw std::invalid_argument("[lily] sample_draw: logits is empty");
          if ((!o.seen.empty() && static_cast<int64_t>(o.seen.size()) != V) ||
              (!o.counts.empty() && static_cast<int64_t>(o.counts.size()) != V))
            throw std::invalid_argument("[lily] sample_draw: seen / counts must have the logits' length or be None");
          for (int32_t id : o.bias_ids)
            if (id < 0 || id >= V) throw std::invalid_argument("[lily] sample_draw: bias id out of range");
          if (o.bias_ids.size() != o.bias_vals.size())
            throw std::invalid_argument("[lily] sample_draw: bias_ids and bias_vals differ in length");
          return lily::cpu::sample_draw(logits.data(), V, o, o.seen, o.counts, static_cast<float>(uniform));
        },
        "logits"_a, "uniform"_a, "temperature"_a = 1.0, "top_k"_a = 0, "top_p"_a = 1.0, "min_p"_a = 0.0,
        "repetition_penalty"_a = 1.0, "presence_penalty"_a = 0.0, "frequency_penalty"_a = 0.0,
        "bias_ids"_a = std::vector<int32_t>{}, "bias_vals"_a = std::vector<float>{}, "seen"_a = nb::none(),
        "counts"_a = nb::none(),
        "The device sampler's draw on the host (the CPU backend's 'device_draw' twin; lily.sampling.draw_token, "
        "one step of the host Sampler, has the same semantics): the token drawn from logits [V] with uniform in "
        "[0, 1).");
  m.def("build_info", &build_info, "backends compiled, cuda flag, SIMD features, compiler");
  m.def("cuda_device_count", &cuda_device_count, "visible CUDA devices; 0 when there is no driver");
  cpu_ops::register_cpu_ops(m);
  register_cuda_ops(m);
}
