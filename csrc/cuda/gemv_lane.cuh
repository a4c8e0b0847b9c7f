// The decode GEMV's lane arithmetic (gemv.cu; dev/exp_persistent_gemv.cu runs the same): one row's 32-element unit
// of 4-bit, 8-bit, bf16 or fp32 weights against a lane's 32 fp32 inputs, the codes turned into floats without
// int -> float instructions (see gemv.cu's header), the 4-row transpose reduction over a warp, and the streaming
// 16-byte load.
#pragma once
#include <cstdint>

namespace lily::cuda::gemv {

constexpr uint32_t kOne = 0x3F800000u;

enum Fmt : int32_t { kQ4 = 0, kQ8 = 1, kBF16 = 2, kF32 = 3 };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {  // read once: do not allocate in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// (v & MASK) | 1.0f as ONE lop3 (written in C, the compiler emits two instructions) and rot16 as one PRMT.
template <uint32_t MASK>
__device__ __forceinline__ float mask_one(uint32_t v) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "n"(MASK), "r"(kOne));
  return __uint_as_float(d);
}
__device__ __forceinline__ uint32_t rot16(uint32_t v) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %1, 0x1032;" : "=r"(d) : "r"(v));
  return d;
}
__device__ __forceinline__ float u16f(uint32_t h) { return __uint_as_float(h << 16); }

template <int FMT>
struct FmtTraits {
  static constexpr int kVec = FMT == kQ4 ? 1 : FMT == kQ8 ? 2 : FMT == kBF16 ? 4 : 8;  // 16-byte vectors per unit
  static constexpr bool kQuant = FMT <= kQ8;
  // the register double buffer: 4-bit only (8-bit holds twice the registers per tile and is the small router and
  // shared-expert gate, where dev/gemv_lab's double buffer gained nothing; dense: test models only)
  static constexpr bool kPrefetch = kVec == 1;
};

// One row's 32-element unit against the lane's x (32 floats); xe / xo / xa: sums of x over even / odd / all.
template <int FMT>
__device__ __forceinline__ float unit_dot(const uint4 (&q)[FmtTraits<FMT>::kVec], uint32_t s, uint32_t b, const float* x,
                                          float xe, float xo, float xa) {
  if constexpr (FMT == kQ4) {
    float ae = 0.f, ao = 0.f;
    const uint32_t w4[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t v = w4[w], l8 = v << 8, r8 = v >> 8, rt = rot16(v);
      const float* xp = x + 8 * w;
      ae = fmaf(mask_one<0x000F0000u>(rt), xp[0], ae);  // nibble 0: bits 0-3 -> 16-19
      ao = fmaf(mask_one<0x0000F000u>(l8), xp[1], ao);  // 1: 4-7 -> 12-15
      ae = fmaf(mask_one<0x000F0000u>(l8), xp[2], ae);  // 2: 8-11 -> 16-19
      ao = fmaf(mask_one<0x0000F000u>(v), xp[3], ao);   // 3: in place
      ae = fmaf(mask_one<0x000F0000u>(v), xp[4], ae);   // 4: in place
      ao = fmaf(mask_one<0x0000F000u>(r8), xp[5], ao);  // 5: 20-23 -> 12-15
      ae = fmaf(mask_one<0x000F0000u>(r8), xp[6], ae);  // 6: 24-27 -> 16-19
      ao = fmaf(mask_one<0x0000F000u>(rt), xp[7], ao);  // 7: 28-31 -> 12-15
    }
    return fmaf(u16f(s), fmaf(128.f, ae - xe, 2048.f * (ao - xo)), u16f(b) * xa);
  } else if constexpr (FMT == kQ8) {
    // byte j -> bits 15-22 (1 + q/256): a shift and one LOP3 (a PRMT to bits 8-15 is one instruction but leaves
    // 1 + q/32768, 8 bits of the accumulator's mantissa lost to the constant part; this is the small router)
    float a = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t w4[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t v = w4[w];
        const float* xp = x + 16 * h + 4 * w;
        a = fmaf(mask_one<0x007F8000u>(v << 15), xp[0], a);
        a = fmaf(mask_one<0x007F8000u>(v << 7), xp[1], a);
        a = fmaf(mask_one<0x007F8000u>(v >> 1), xp[2], a);
        a = fmaf(mask_one<0x007F8000u>(v >> 9), xp[3], a);
      }
    }
    return fmaf(u16f(s), 256.f * (a - xa), u16f(b) * xa);
  } else if constexpr (FMT == kBF16) {
    float a = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint32_t w4[4] = {q[v].x, q[v].y, q[v].z, q[v].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        a = fmaf(__uint_as_float(w4[w] << 16), x[8 * v + 2 * w], a);
        a = fmaf(__uint_as_float(w4[w] & 0xFFFF0000u), x[8 * v + 2 * w + 1], a);
      }
    }
    return a;
  } else {
    float a = 0.f;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      a = fmaf(__uint_as_float(q[v].x), x[4 * v], a);
      a = fmaf(__uint_as_float(q[v].y), x[4 * v + 1], a);
      a = fmaf(__uint_as_float(q[v].z), x[4 * v + 2], a);
      a = fmaf(__uint_as_float(q[v].w), x[4 * v + 3], a);
    }
    return a;
  }
}

// The 4 row sums of a tile over the 32 lanes in 6 shuffles (a transpose reduction); the lanes L with L & 7 == 0
// return row reduced_row(L) = 2 (L >> 4 & 1) + (L >> 3 & 1).
__device__ __forceinline__ float reduce_rows4(const float (&t)[4], int lane) {
  const bool u16 = lane & 16, u8 = lane & 8;
  const float a0 = (u16 ? t[2] : t[0]) + __shfl_xor_sync(0xFFFFFFFFu, u16 ? t[0] : t[2], 16);
  const float a1 = (u16 ? t[3] : t[1]) + __shfl_xor_sync(0xFFFFFFFFu, u16 ? t[1] : t[3], 16);
  float r = (u8 ? a1 : a0) + __shfl_xor_sync(0xFFFFFFFFu, u8 ? a0 : a1, 8);
  r += __shfl_xor_sync(0xFFFFFFFFu, r, 4);
  r += __shfl_xor_sync(0xFFFFFFFFu, r, 2);
  r += __shfl_xor_sync(0xFFFFFFFFu, r, 1);
  return r;
}
__device__ __forceinline__ int reduced_row(int lane) { return ((lane & 16) ? 2 : 0) + ((lane & 8) ? 1 : 0); }

}  // namespace lily::cuda::gemv
