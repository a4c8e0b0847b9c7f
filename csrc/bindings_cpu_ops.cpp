// lily._lily.ops: the CPU backend's kernels one by one, numpy in / numpy out (tests/kernels). A binding file like
// bindings.cpp and the bindings_cuda_* files (the only files that include nanobind).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "cpu/attention.h"
#include "cpu/deltanet.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "core/sampling.h"
#include "cpu/thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

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

// ---- lily._lily.ops: the CPU backend's kernels one by one, numpy in / numpy out (tests/kernels) ----
// Every output is allocated NaN-filled before the kernel writes it, so an element a kernel skips shows up.
// Legend: S rows, C conv channels, E experts, H hidden, K conv taps, cap KV cache capacity (rows).
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

void register_cpu_ops(nb::module_& m) { cpu_ops::register_cpu_ops(m); }
