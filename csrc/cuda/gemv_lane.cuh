// The decode GEMV's lane arithmetic (gemv.cu): one row's 32-element unit of 8-bit, bf16 or fp32 weights against a
// lane's 32 fp32 inputs (codes turned into floats without int -> float instructions, see gemv.cu's header), the
// 4-row transpose reduction over a warp, the streaming loads, and the pieces of the 4-bit tensor-core tile.
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
// (v & MASK) | 1.0f as ONE lop3 (written in C, the compiler emits two instructions).
template <uint32_t MASK>
__device__ __forceinline__ float mask_one(uint32_t v) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "n"(MASK), "r"(kOne));
  return __uint_as_float(d);
}
__device__ __forceinline__ float u16f(uint32_t h) { return __uint_as_float(h << 16); }

template <int FMT>
struct FmtTraits {
  static constexpr int kVec = FMT == kQ4 ? 1 : FMT == kQ8 ? 2 : FMT == kBF16 ? 4 : 8;  // 16-byte vectors per unit
  static constexpr bool kQuant = FMT <= kQ8;
};

// One row's 32-element unit of 8-bit or dense weights against the lane's x (32 floats); xa: the sum of x (the
// 4-bit weights take the tensor-core tile below).
template <int FMT>
__device__ __forceinline__ float unit_dot(const uint4 (&q)[FmtTraits<FMT>::kVec], uint32_t s, uint32_t b, const float* x,
                                          float xa) {
  if constexpr (FMT == kQ8) {
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

// ---- 4-bit weights on the tensor cores ----
// A warp's tile of 4 rows x 1024 elements (one slice) is 16 mma.sync m16n8k16 (bf16 in, fp32 accumulation). Lane
// (gid = lane / 4, tig = lane % 4) owns the 64-element groups 2 gid + h (h = 0, 1) of the slice and, in each, the
// 16 elements 16 tig .. 16 tig + 15: 8 bytes of codes per row and group (one 8-byte load). The 4 lanes of one gid
// thus hold one whole group, the k extent an mma sums over, so one scale applies to each sum. A = codes (tile rows
// 0/1 or 2/3 as fragment rows gid and gid + 8, the lane's own elements in its k slots), B = the lane's own x
// (fragment column gid), so D[gid][gid] and D[gid + 8][gid] are the two rows' dot products over the group, held by
// the diagonal lane (gid, gid / 2) in c[gid % 2] and c[2 + gid % 2]; the other 7 columns pair one lane's weights with
// another lane's x and are discarded (1/8 of the tensor pipe's work is used: it has the room, ~26 weights per SM
// cycle at the bandwidth floor). A code enters as the bf16 128 + q (one LOP3 on the shifted word, exact), so
// D = 128 X + sum q x with X the group's sum of x, and the group's term is s (D - 128 X) + b X in fp32, folded by
// lane (gid, r) for tile row r: it loads that row's scales and biases, and the diagonal lane's four values are
// shuffled to the four lanes of its gid. Per tile and lane: 8 loads of codes, 4 of scales, 112 LOP3/SHF, 16 MMA,
// the fold and the row sums (3 shuffles): ~2x fewer instructions than the FFMA form it replaced (unit_dot's 4-bit
// branch, 3.3 per weight; git show c48133a:csrc/cuda/gemv_lane.cuh).
__device__ __forceinline__ uint2 ld_stream8(const uint8_t* p) {  // read once: do not allocate in L1
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
// Nibbles j and j + 4 of v as bf16x2 (128 + q): the low half holds nibble j.
__device__ __forceinline__ uint32_t q4_pair(uint32_t v, int j) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v >> (4 * j)), "n"(0x000F000Fu), "r"(0x43004300u));
  return d;
}
// mma k slot i (0..3) of a group takes word i / 2 of the lane's 8 bytes and the nibble pairs (j0, j0 + 4),
// (j0 + 1, j0 + 5), j0 = 2 (i % 2); B carries x at the same element positions.
__device__ __forceinline__ int q4_word(int i) { return i >> 1; }
__device__ __forceinline__ int q4_j0(int i) { return 2 * (i & 1); }

// One lane's loads of a tile: rows x groups h (8 bytes of codes each), and row tig's scales and biases per h.
struct Q4Tile {
  uint2 q[4][2];
  uint32_t s[2], b[2];
};

}  // namespace lily::cuda::gemv
