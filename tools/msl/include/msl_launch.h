// Helpers for the launchers that mslc.py appends to a kernel translation unit: bind [[buffer(n)]]
// pointers/references and builtin attributes to a kernel's parameters by their declared types.
#pragma once
namespace msl { namespace launch {
template<int I, class... A> struct nth;
template<class H, class... T> struct nth<0, H, T...> { typedef H type; };
template<int I, class H, class... T> struct nth<I, H, T...> { typedef typename nth<I - 1, T...>::type type; };
template<class F, int I> struct param;
template<class R, class... A, int I> struct param<R(A...), I> { typedef typename nth<I, A...>::type type; };

template<class P> struct buf { static P get(void* p) { return *(P*)p; } };               // by value
template<class U> struct buf<U*> { static U* get(void* p) { return (U*)p; } };           // device T* / constant T*
template<class U> struct buf<U&> { static U& get(void* p) { return *(U*)p; } };          // constant T& / device T&

template<class P> struct bi {                                                            // builtin: scalar
  static P get(const unsigned* v) {
    static_assert(msl::tt::is_scalar<P>::value && !msl::tt::is_floating<P>::value,
                  "MSL: this builtin attribute needs an integer (uint/ushort) or integer-vector parameter");
    return P(v[0]); }
};
template<class U> struct bi<::vec<U, 2>> { static ::vec<U, 2> get(const unsigned* v) { return ::vec<U, 2>(U(v[0]), U(v[1])); } };
template<class U> struct bi<::vec<U, 3>> { static ::vec<U, 3> get(const unsigned* v) { return ::vec<U, 3>(U(v[0]), U(v[1]), U(v[2])); } };
template<class P> struct bi<const P> : bi<P> {};
}}  // namespace msl::launch
