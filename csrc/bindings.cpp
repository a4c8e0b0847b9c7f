// The only file that includes nanobind: lily._lily.Engine / State per docs/engine_contract.md.
// Weight arrays are borrowed zero-copy; the Engine wrapper keeps a reference to each of them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
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
#include "core/sampling.h"
#include "cuda/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

// The lily dtype of a dlpack dtype (bindings_cpu_ops.cpp).
lily::DType to_dtype(const nb::dlpack::dtype& t);

namespace {

using Array = nb::ndarray<nb::ro, nb::device::cpu>;

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
    if (st->has_mtp) {  // the MTP head's cache: "mtp.rows" (int64), "mtp.k"/"mtp.v" [rows, Hkv*D], "mtp.hidden" [H]
      const size_t slot = st->kv.size();
      d["mtp.rows"] = np.attr("int64")(st->mtp_rows);
      for (bool value : {false, true})
        d[value ? "mtp.v" : "mtp.k"] = arr(st->mtp_rows * st->kv_row, [&](float* p) {
                                          st->read_kv(slot, value, p);
                                        }).attr("reshape")(st->mtp_rows, st->kv_row);
      d["mtp.hidden"] = arr(st->hidden, [&](float* p) { st->read_hidden(p); });
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
    // The MTP head's cache, when this state has one and the arrays carry it (else it stays behind: plain decoding).
    const bool head = st->has_mtp && d.contains("mtp.rows");
    int64_t head_rows = 0;
    std::vector<nb::ndarray<const float, nb::c_contig, nb::device::cpu>> heads;
    if (head) {
      head_rows = nb::cast<int64_t>(nb::int_(np.attr("asarray")(d["mtp.rows"]).attr("item")()));  // any 1-element
      if (head_rows < 0 || head_rows > std::max<int64_t>(pos - 1, 0))
        throw std::invalid_argument("[lily] State.import_arrays: mtp.rows " + std::to_string(head_rows) +
                                    " is outside 0..position - 1 = " + std::to_string(pos - 1));
      heads.push_back(get("mtp.k", head_rows * st->kv_row));
      heads.push_back(get("mtp.v", head_rows * st->kv_row));
      heads.push_back(get("mtp.hidden", st->hidden));
    }
    st->reserve(pos);
    if (st->has_mtp) {
      st->mtp_rows = head_rows;
      if (head) {
        st->write_kv(st->kv.size(), false, heads[0].data(), head_rows);
        st->write_kv(st->kv.size(), true, heads[1].data(), head_rows);
        st->write_hidden(heads[2].data());
      }
    }
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

  // Greedy drafts of the MTP head (Engine::draft): (drafts int32 [k], logits float32 [k, V]).
  nb::tuple draft(PyState& state, int64_t token, int64_t k) {
    const int64_t V = eng->config().vocab;
    if (token < 0 || token >= V || k < 1 || k > 64)
      throw std::invalid_argument("[lily] draft: token must be in 0.." + std::to_string(V - 1) + " and k in 1..64");
    int32_t* ids = new int32_t[static_cast<size_t>(k)];
    nb::capsule ids_owner(ids, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
    float* lg = new float[static_cast<size_t>(k * V)];
    nb::capsule lg_owner(lg, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    {
      nb::gil_scoped_release rel;
      eng->draft(*state.st, static_cast<int32_t>(token), k, lg, ids);
    }
    return nb::make_tuple(nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(ids, {static_cast<size_t>(k)}, ids_owner),
                          nb::ndarray<nb::numpy, float, nb::ndim<2>>(lg, {static_cast<size_t>(k),
                                                                          static_cast<size_t>(V)}, lg_owner));
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

// The engine's options (core/sampling.h's one mapping) with the host's seen / counts.
lily::SampleOptions sample_options(double temperature, int64_t top_k, double top_p, double min_p,
                                   double repetition_penalty, double presence_penalty, double frequency_penalty,
                                   const std::vector<int32_t>& bias_ids, const std::vector<float>& bias_vals,
                                   const std::optional<U8Array>& seen, const std::optional<I32Array>& counts) {
  lily::SampleOptions o = lily::sample_options(temperature, top_k, top_p, min_p, repetition_penalty,
                                               presence_penalty, frequency_penalty, bias_ids, bias_vals);
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

void register_cpu_ops(nb::module_& m);   // lily._lily.ops (bindings_cpu_ops.cpp)
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
      .def_prop_ro("speculative", [](PyTokenStream& t) { return t.s && t.s->speculative(); },
                   "True: drafts with the MTP head (next() returns tokens)")
      .def_prop_ro("draws", [](PyTokenStream& t) { return t.s && t.s->draws(); },
                   "True: next() returns tokens, drawn on the device or in the extension (False: lock-step)")
      .def_prop_ro("spec_stats", [](PyTokenStream& t) {
             const lily::TokenStream::SpecStats st = t.s ? t.s->spec_stats() : lily::TokenStream::SpecStats{};
             nb::dict d;
             d["drafted"] = st.drafted, d["accepted"] = st.accepted, d["verifies"] = st.verifies;
             d["plain_steps"] = st.plain_steps, d["status"] = st.status;
             return d;
           }, "speculative streams: drafted / accepted tokens, verify forwards, plain steps, status")
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
      .def("draft", &PyEngine::draft, "state"_a, "token"_a, "k"_a,
           "The MTP head's k chained greedy drafts after `token` (the token at state.position): (drafts int32 [k], "
           "their logits float32 [k, vocab]); the state is unchanged. Needs has_mtp and a state whose head cache "
           "is current.")
      .def("decode_greedy", &PyEngine::decode_greedy, "state"_a, "token"_a, "n_steps"_a,
           "Greedy decoding: feeds token, then each argmax; returns the n_steps argmax tokens (int32) and "
           "advances the state by n_steps. On the GPU the loop runs on the device (no logits copies).")
      .def("open_stream",
           [](PyEngine& e, PyState& state, int64_t first, int64_t max_tokens, std::vector<int32_t> stop_ids,
              bool device, double temperature, int64_t top_k, double top_p, double min_p, double repetition_penalty,
              double presence_penalty, double frequency_penalty, std::vector<int32_t> bias_ids,
              std::vector<float> bias_vals, std::optional<U8Array> seen, std::optional<I32Array> counts,
              uint64_t seed, int32_t speculative, bool adaptive, bool batch) {
             const int64_t V = e.eng->config().vocab;
             if (first < 0 || first >= V)
               throw std::invalid_argument("[lily] open_stream: token id " + std::to_string(first) +
                                           " is out of range for vocab_size " + std::to_string(V));
             lily::StreamOptions o;
             o.max_tokens = max_tokens;
             o.stop_ids = std::move(stop_ids);
             o.device = device;
             o.seed = seed;
             o.speculative = speculative;
             o.adaptive = adaptive;
             o.batch = batch;
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
           "speculative"_a = 0, "adaptive"_a = true, "batch"_a = false, nb::rv_policy::take_ownership,
           "A token stream from `first` (the last sampled token, at state.position): the token loop in the "
           "extension. device=True draws on the device where the backend can (TokenStream.device says; next() "
           "returns tokens, running one step ahead), else lock-step (step(token) returns the logits). seen: uint8 "
           "[vocab] or empty (tokens in the context), counts: int32 [vocab] or empty (generated so far). "
           "speculative=k (1..8): draft k tokens per step with the MTP head and verify them in one forward "
           "(next() returns tokens; greedy output token for token as plain, sampling the same distribution); "
           "adaptive: fall back to plain steps when drafting does not pay. batch=True: the stream will be stepped "
           "with others (step_streams): with device=True it draws in the extension even where the backend could "
           "draw on the device.")
      .def("step_streams", [](PyEngine& e, nb::list streams) {
             std::vector<lily::TokenStream*> open;
             for (nb::handle h : streams) {
               PyTokenStream& t = nb::cast<PyTokenStream&>(h);
               if (t.s) open.push_back(t.s.get());
             }
             nb::gil_scoped_release rel;
             return e.eng->step_streams(open);
           }, "streams"_a,
           "The next step of several open TokenStreams in one forward (concurrent generations decoded together): "
           "each stream whose next token is one step away joins with one row, or, drafting with an explicit "
           "speculative k, with its verify's 1 + k rows (drafted first; accepted and rolled back as alone); the "
           "tokens drawn are queued for each stream's next(), computed and drawn as they would be alone. Returns "
           "the rows run together (0: fewer than 2 streams could join, or the backend runs one stream per forward; "
           "next() steps them). Closed streams are skipped.")
      .def("set_backend_flag", [](PyEngine& e, const std::string& name, int64_t value) {
             nb::gil_scoped_release rel;
             e.eng->set_backend_flag(name, value);
           }, "name"_a, "value"_a, "backend switch for ablations, e.g. cuda: 'cuda_graph' 0 | 1")
      .def("backend_flag", [](PyEngine& e, const std::string& name) {
             nb::gil_scoped_release rel;
             return e.eng->backend_flag(name);
           }, "name"_a, "a backend switch's value, e.g. cuda: 'cuda_graph'")
      .def("backend_counters", [](PyEngine& e) {
             nb::gil_scoped_release rel;
             return e.eng->backend_counters();
           }, "the backend's counters (read only), e.g. cuda: {'graph_kernels': ..., 'sampler_begins': ...}")
      .def_prop_ro("max_context", [](const PyEngine& e) { return e.eng->max_context(); })
      .def_prop_ro("backend", [](const PyEngine& e) { return std::string(e.eng->backend_name()); })
      .def_prop_ro("threads", [](const PyEngine& e) { return e.eng->threads(); })
      .def_prop_ro("vocab_size", [](const PyEngine& e) { return e.eng->config().vocab; })
      .def_prop_ro("has_mtp", [](const PyEngine& e) { return e.eng->has_mtp(); },
                   "the engine runs the MTP head (speculative decoding can draft)")
      .def_prop_ro("batches_streams", [](const PyEngine& e) { return e.eng->batches_streams(); },
                   "step_streams decodes several streams in one forward on this backend")
      .def_prop_ro("debug", [](const PyEngine& e) { return e.eng->debug(); })
      .def_prop_ro("default_chunk", [](const PyEngine& e) { return e.eng->default_chunk(); });

  m.attr("MAX_DRAFTS") = lily::Engine::kMaxDrafts;  // StreamOptions::speculative at most (lily.sampling reads it)
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
          return lily::sample_draw(logits.data(), V, o, o.seen, o.counts, static_cast<float>(uniform));
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
  register_cpu_ops(m);
  register_cuda_ops(m);
}
