// MetalPerformancePrimitives: the project's shim of the one Metal 4 tensor op lily uses (not Apple's
// header; written from the documentation comments of MPPTensorOpsMatMul2d.h).
//
//   mpp::tensor_ops::matmul2d<matmul2d_descriptor(m, n, k, transpose_left, transpose_right,
//                             relaxed_precision, mode), execution_simdgroups<N>>  op;
//   auto c = op.get_destination_cooperative_tensor<decltype(A), decltype(B), float>();
//   op.run(A, B, c);          // c (+)= A * B over the m x n tile, K = k
//
// Tensors index (column, row): A (m x k) has extents (k, m), or (m, k) with transpose_left; B (k x n)
// has extents (n, k), or (k, n) with transpose_right; the destination tile is rows m x columns n.
//
// What the shim checks: element-type combinations of Apple's table (half / bfloat / float inputs), the
// destination being the cooperative tensor of this very op and operand types (the layout depends on
// them), K of both operands equal (and equal to a static k), the dispatched simdgroups equal to the
// execution scope's (undefined behaviour otherwise), and that the whole simdgroup enters run() (a
// rendezvous, as for simdgroup_matrix ops: a lane that branched around it is reported).
// What it does not model: any synchronisation between simdgroups inside run() (Metal promises none, so
// the kernel's own threadgroup_barrier must order tile writes before run()), device/threadgroup
// destinations (only cooperative ones), int8 and 4-bit formats, the hardware's summation order and the
// reduced precision that relaxed_precision = true allows (the emulator accumulates in float, in k order).
//
// C++17 has no class-type template parameters, which Apple's compiler accepts for the descriptor: here the
// descriptor converts (constexpr) to a packed 64-bit integer, and matmul2d takes that integer, so
// `matmul2d<desc, scope>` is spelt as in MSL.
#pragma once
#include "../metal_tensor"

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = int(metal::dynamic_extent), bool tl = false, bool tr = false,
                                bool relaxed = false, mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed), matmul_mode(md) {}
  // packed form (the shim's template argument): m, n, k (0xFFFF = dynamic) in 16 bits each, then flags
  constexpr operator unsigned long long() const {
    return (unsigned long long)(unsigned)m | (unsigned long long)(unsigned)n << 16 |
           (unsigned long long)(k < 0 ? 0xFFFFu : unsigned(k)) << 32 | (unsigned long long)transpose_left << 48 |
           (unsigned long long)transpose_right << 49 | (unsigned long long)relaxed_precision << 50 |
           (unsigned long long)(matmul_mode == mode::multiply_accumulate) << 51;
  }
};

namespace detail {
template<unsigned long long D> struct desc {
  static constexpr int m = int(D & 0xFFFFu), n = int((D >> 16) & 0xFFFFu);
  static constexpr int k = ((D >> 32) & 0xFFFFu) == 0xFFFFu ? -1 : int((D >> 32) & 0xFFFFu);
  static constexpr bool tl = (D >> 48) & 1u, tr = (D >> 49) & 1u, relaxed = (D >> 50) & 1u, acc = (D >> 51) & 1u;
};
template<class T> struct fp { static constexpr int id = 0; };   // 1 half, 2 bfloat, 3 float
template<> struct fp<half> { static constexpr int id = 1; };
template<> struct fp<bfloat> { static constexpr int id = 2; };
template<> struct fp<float> { static constexpr int id = 3; };
// Apple's table for floating-point operands: any of half / bfloat / float -> float; half or bfloat inputs
// -> half (not bfloat x bfloat) or bfloat (not half x half).
template<class A, class B, class C> struct supported {
  static constexpr int a = fp<A>::id, b = fp<B>::id, c = fp<C>::id;
  static constexpr bool value = a && b && c &&
      (c == 3 || (c == 1 && a != 3 && b != 3 && !(a == 2 && b == 2)) || (c == 2 && a != 3 && b != 3 && !(a == 1 && b == 1)));
};
// The cooperative destination's layout: tile and execution scope (and the operands, which Metal's layout
// may depend on; the shim only uses them to reject a destination made for other operand types).
template<unsigned long long D, class Scope, class L, class R> struct dest_layout {
  static_assert(Scope::simdgroups >= 1, "MSL shim: matmul2d is modelled for execution_simdgroup(s) scopes");
  static constexpr int rows = desc<D>::m, cols = desc<D>::n, threads = 32 * Scope::simdgroups;
};
}  // namespace detail

template<unsigned long long D, class Scope>
class matmul2d {
  typedef detail::desc<D> d;
  static_assert(d::m > 0 && d::n > 0, "MSL: matmul2d_descriptor needs static m and n");

 public:
  static constexpr matmul2d_descriptor descriptor = matmul2d_descriptor(
      d::m, d::n, d::k, d::tl, d::tr, d::relaxed,
      d::acc ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
  typedef Scope scope;
  matmul2d() = default;

  template<class L, class R, class E>
  using destination_t = metal::cooperative_tensor<E, metal::dextents<int, 2>, detail::dest_layout<D, Scope, L, R>>;

  template<class L, class R, class E>
  destination_t<L, R, E> get_destination_cooperative_tensor() const {
    static_assert(metal::is_tensor<L>::value && metal::is_tensor<R>::value,
                  "MSL: get_destination_cooperative_tensor<Left, Right, Element> takes the operand tensor types");
    return destination_t<L, R, E>();
  }

  template<class L0, class R0, class C0>
  void run(const L0& left, const R0& right, C0& dst, unsigned line = __builtin_LINE()) const {
    typedef typename metal::tensor_detail::strip<L0>::type L;  // check-as mode deduces __private types
    typedef typename metal::tensor_detail::strip<R0>::type R;
    typedef typename metal::tensor_detail::strip<C0>::type C;
    static_assert(metal::is_tensor<L>::value && metal::is_tensor<R>::value, "MSL: matmul2d operands must be tensors");
    static_assert(metal::is_cooperative_tensor<C>::value,
                  "MSL shim: only cooperative-tensor destinations of matmul2d are modelled");
    typedef typename L::value_type TA;
    typedef typename R::value_type TB;
    typedef typename C::value_type TC;
    static_assert(msl::tt::same<C, destination_t<L, R, TC>>::value,
                  "MSL: the destination must be this op's get_destination_cooperative_tensor<Left, Right, T>()");
    static_assert(detail::supported<TA, TB, TC>::value, "MSL: matmul2d does not support this element-type combination");
#ifndef MSL_CL
    msl_rt_simd_sync(line);  // the whole simdgroup enters run() (execution-scope uniform)
    const msl_thread_ctx* c = msl_rt_ctx();
    if (Scope::simdgroups > 1 && int(c->simdgroups_per_threadgroup) != Scope::simdgroups)
      msl_rt_report("matmul2d: execution_simdgroups<N> differs from the simdgroups of the threadgroup (undefined)");
    // A(i, k), B(k, j) through extents (column, row) and strides; reads outside the extents are zero
    const int ka = d::tl ? left.get_extent(1) : left.get_extent(0);
    const int kb = d::tr ? right.get_extent(0) : right.get_extent(1);
    const int K = d::k >= 0 ? d::k : ka;
    if (ka != kb || (d::k >= 0 && ka != d::k))
      msl_rt_report("matmul2d: K of the left operand, the right operand and the descriptor differ");
    const int am = d::tl ? left.get_extent(0) : left.get_extent(1);
    const int bn = d::tr ? right.get_extent(1) : right.get_extent(0);
    for (int s = 0; s < C::CAP; s++) {
      if (!dst.get_mask(s)) continue;
      const int i = dst.element(s) / d::n, j = dst.element(s) % d::n;
      float acc = d::acc ? float(dst.v_[s]) : 0.0f;
      if (i < am && j < bn)
        for (int k = 0; k < K; k++) {
          const long ai = d::tl ? long(i) * left.get_stride(0) + long(k) * left.get_stride(1)
                                : long(k) * left.get_stride(0) + long(i) * left.get_stride(1);
          const long bi = d::tr ? long(k) * right.get_stride(0) + long(j) * right.get_stride(1)
                                : long(j) * right.get_stride(0) + long(k) * right.get_stride(1);
          acc += float(left.data_[ai]) * float(right.data_[bi]);
        }
      dst.v_[s] = TC(acc);
    }
#else
    (void)left; (void)right; (void)dst; (void)line;
#endif
  }
};

}  // namespace tensor_ops
}  // namespace mpp
