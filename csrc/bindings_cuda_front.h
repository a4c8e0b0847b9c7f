// The front door of lily._lily.cuda_ops (bindings_cuda_ops.cpp, bindings_cuda_gemv.cpp): numpy array types, shape
// checks with "[cuda_ops.OP] ..." errors, new output arrays, and the weight tuples as lily::Linear. Included only by
// those binding files (built with LILY_HAVE_CUDA).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/ops_table.h"

namespace lily::cuda_ops_front {

namespace nb = nanobind;
using namespace nb::literals;


template <class T>
using Arr = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
using F32 = Arr<float>;
using U16 = Arr<uint16_t>;
using I32 = Arr<int32_t>;
using U8 = Arr<uint8_t>;
using Any = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

inline void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string("[cuda_ops.") + op + "] " + what);
}

template <class A>
std::vector<int64_t> shape_of(const A& a) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < a.ndim(); ++i) s.push_back(static_cast<int64_t>(a.shape(i)));
  return s;
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + (s[i] < 0 ? std::string("*") : std::to_string(s[i]));
  return t + "]";
}

// Throws "[cuda_ops.OP] NAME must be [d0, ...], got [...]" unless a has these extents (-1: any).
template <class A>
std::vector<int64_t> check(const char* op, const char* name, const A& a, const std::vector<int64_t>& dims) {
  const std::vector<int64_t> s = shape_of(a);
  bool ok = s.size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] < 0 || dims[i] == s[i];
  require(ok, op, std::string(name) + " must be " + shape_str(dims) + ", got " + shape_str(s));
  return s;
}

// A new numpy array of `shape` and dtype T (written whole by the op's copy back).
template <class T>
std::pair<nb::object, T*> out(const std::vector<int64_t>& shape) {
  nb::module_ np = nb::module_::import_("numpy");
  nb::list dims;
  for (int64_t d : shape) dims.append(d);
  const char* dt = std::is_same_v<T, float>      ? "float32"
                   : std::is_same_v<T, uint16_t> ? "uint16"
                   : std::is_same_v<T, int32_t>  ? "int32"
                   : std::is_same_v<T, uint8_t>  ? "uint8"
                                                 : "uint64";
  nb::object a = np.attr("empty")(nb::tuple(dims), "dtype"_a = dt);
  return {a, static_cast<T*>(nb::cast<nb::ndarray<nb::c_contig, nb::device::cpu>>(a).data())};
}

// A copy of a (the ops write in place into the copy: in / out arrays come back as new arrays).
template <class T>
std::pair<nb::object, T*> copy_of(const Arr<T>& a) {
  auto [o, p] = out<T>(shape_of(a));
  std::copy(a.data(), a.data() + a.size(), p);
  return {o, p};
}

// A weight tuple (weight, scales, biases, bits, group) as a lily::Linear over its arrays (kept alive in `keep`).
// stacked: [E, out, cols] (experts) instead of [out, cols].
inline lily::Linear weight(const char* op, const char* name, nb::handle t, bool stacked, std::vector<Any>& keep) {
  require(nb::isinstance<nb::tuple>(t) && nb::len(t) == 5, op,
          std::string(name) + " must be a tuple (weight, scales, biases, bits, group)");
  nb::tuple w = nb::borrow<nb::tuple>(t);
  const Any codes = nb::cast<Any>(w[0]);
  keep.push_back(codes);
  const int bits = nb::cast<int>(w[3]), group = nb::cast<int>(w[4]);
  const std::vector<int64_t> s = shape_of(codes);
  require(s.size() == (stacked ? 3u : 2u), op,
          std::string(name) + " must be " + (stacked ? "[E, out, cols]" : "[out, cols]") + ", got " + shape_str(s));
  const auto dtype = codes.dtype();
  lily::Linear l;
  l.experts = stacked ? s[0] : 0;
  l.out = s[s.size() - 2];
  if (bits) {
    require((bits == 4 || bits == 8) && group > 0 && group % 32 == 0, op,
            std::string(name) + ": bits 4 or 8 and a group that is a positive multiple of 32");
    require(dtype == nb::dtype<uint32_t>(), op, std::string(name) + ": quantized codes must be uint32");
    require(!w[1].is_none() && !w[2].is_none(), op, std::string(name) + ": a quantized weight needs scales and biases");
    l.kind = lily::Linear::Kind::Quant;
    l.bits = bits, l.group = group, l.in = s.back() * 32 / bits;
    require(l.in % group == 0, op, std::string(name) + ": in is not a multiple of group");
    std::vector<int64_t> sb = {l.out, l.in / group};
    if (stacked) sb.insert(sb.begin(), l.experts);
    for (int i : {1, 2}) {
      const Any a = nb::cast<Any>(w[i]);
      keep.push_back(a);
      require(shape_of(a) == sb && a.dtype() == nb::dtype<uint16_t>(), op,
              std::string(name) + ": scales and biases must be bf16 (uint16) " + shape_str(sb));
    }
    l.codes = static_cast<const uint32_t*>(codes.data());
    l.scales = static_cast<const uint16_t*>(keep[keep.size() - 2].data());
    l.biases = static_cast<const uint16_t*>(keep.back().data());
  } else {
    require(dtype == nb::dtype<uint16_t>() || dtype == nb::dtype<float>(), op,
            std::string(name) + ": a dense weight must be bf16 (uint16) or float32");
    l.kind = dtype == nb::dtype<uint16_t>() ? lily::Linear::Kind::DenseBF16 : lily::Linear::Kind::DenseF32;
    l.in = s.back();
    l.dense = codes.data();
  }
  return l;
}

// Registers the decode GEMV family (bindings_cuda_gemv.cpp) on the cuda_ops module.
void register_gemv_ops(nb::module_& m);

}  // namespace lily::cuda_ops_front
