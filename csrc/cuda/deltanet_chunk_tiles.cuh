// Tile loads and TF32 mma.sync / ldmatrix fragment helpers of the chunked Gated DeltaNet prefill (deltanet_chunk.cu;
// kept apart so that file stays readable). Internal: included by deltanet_chunk.cu only.
#pragma once
#include "cuda/deltanet_scan.cuh"

namespace lily::cuda::dn_chunk {

using namespace dn_scan;
constexpr int kChunk = 64;  // C: tokens per chunk of the chunked form

// dst[c * dst_ld + d] = src[c * src_ld + d] for c < kChunk, d < COLS; zero where c >= rows or d >= cols.
// vec4: float4 copies (src, src_ld and cols multiples of 4 floats; dst_ld a multiple of 4).
template <int COLS>
__device__ __forceinline__ void load_tile(float* dst, int dst_ld, const float* src, int64_t src_ld, int rows, int cols,
                                          bool vec4) {
  if (vec4) {
    constexpr int kQuads = COLS / 4;
    for (int i = threadIdx.x; i < kChunk * kQuads; i += kThreads) {
      const int c = i / kQuads, d = 4 * (i % kQuads);
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (c < rows && d < cols) v = *reinterpret_cast<const float4*>(src + c * src_ld + d);
      *reinterpret_cast<float4*>(dst + c * dst_ld + d) = v;
    }
  } else {
    for (int i = threadIdx.x; i < kChunk * COLS; i += kThreads) {
      const int c = i / COLS, d = i % COLS;
      dst[c * dst_ld + d] = c < rows && d < cols ? src[c * src_ld + d] : 0.f;
    }
  }
}

using mma::cp_async16;  // mma_bf16.cuh

// load_tile through 16-byte cp.async when vec4, so all of a thread's copies are in flight at once instead of one
// load round trip each (generic pointers: the compiler cannot batch a load past the previous smem store). The
// caller commits, waits and syncs before reading dst; zero fill by direct stores. !vec4: load_tile's copy.
// When the block's threads tile the [C][COLS] quads exactly (COLS 32, 64, 128), each thread's quads sit in one
// column at rows r0, r0 + R, ...: offsets advance by a constant and the column test is made once.
template <int COLS>
__device__ __forceinline__ void load_tile_async(float* dst, int dst_ld, const float* src, int64_t src_ld, int rows,
                                                int cols, bool vec4) {
  if (!vec4) {
    load_tile<COLS>(dst, dst_ld, src, src_ld, rows, cols, false);
    return;
  }
  constexpr int kQuads = COLS / 4;
  if constexpr (kThreads % kQuads == 0 && kChunk % (kThreads / kQuads) == 0) {
    constexpr int kRowStep = kThreads / kQuads;
    const int q = threadIdx.x % kQuads, r0 = threadIdx.x / kQuads;
    const bool col_ok = 4 * q < cols;
    const float* s = src + r0 * src_ld + 4 * q;
    float* o = dst + r0 * dst_ld + 4 * q;
#pragma unroll
    for (int k = 0; k < kChunk / kRowStep; ++k, s += kRowStep * src_ld, o += kRowStep * dst_ld) {
      if (col_ok && r0 + k * kRowStep < rows) cp_async16(o, s);
      else *reinterpret_cast<float4*>(o) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  } else {
    for (int i = threadIdx.x; i < kChunk * kQuads; i += kThreads) {
      const int c = i / kQuads, d = 4 * (i % kQuads);
      float* o = dst + c * dst_ld + d;
      if (c < rows && d < cols) cp_async16(o, src + c * src_ld + d);
      else *reinterpret_cast<float4*>(o) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// mma.sync m16n8k8 TF32 helpers. Fragment layouts (PTX ISA, .tf32):
// g = lane / 4, t = lane % 4; A (16x8, row): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
// B (8x8, col): b0 (t, g), b1 (t+4, g); C (16x8): c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1).
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Operand bits: cvt.rna when the shared tile holds plain fp32; kRaw when it was stored already TF32-rounded
// (tf32_round), so a tile read by several products is rounded once.
template <bool kRaw>
__device__ __forceinline__ uint32_t op_bits(float x) {
  if constexpr (kRaw) return __float_as_uint(x);
  else return tf32(x);
}
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(tf32(x)); }
// NT floats at p (NT = 1, 2, 4; p aligned to 4 NT bytes): one scalar, 64- or 128-bit access.
template <int NT>
__device__ __forceinline__ void load_vec(float (&x)[NT], const float* p) {
  if constexpr (NT == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if constexpr (NT == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x, x[1] = v.y;
  } else {
    static_assert(NT == 1);
    x[0] = *p;
  }
}
template <int NT>
__device__ __forceinline__ void store_vec(float* p, const float (&x)[NT]) {
  if constexpr (NT == 4) *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  else if constexpr (NT == 2) *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
  else {
    static_assert(NT == 1);
    *p = x[0];
  }
}

// Fragments of tiles stored TF32-rounded with k contiguous (A[m][k], B^T[n][k]) come through ldmatrix: an
// m8n8.b16 matrix is 8 rows of 16 bytes, and lane l receives the 32-bit word (row l / 4, word l % 4) of each, the
// bits unchanged; for an 8x4 block of fp32 that is element (g, t), where a0 and b0 sit in the .tf32 layouts above.
// So one x4 gathers a whole A fragment, or the B fragments of two n-tiles or of two k-steps: 1 shared load where
// scalar loads took 4. Lane l gives the address of row l % 8 of block l / 8: row strides and k offsets are
// multiples of 4 floats (16-byte rows), and strides of 4 mod 32 floats put a block's 8 rows on distinct bank quads.
// (.trans swaps 16-bit halves, not words, so tiles read [k][n] cannot use it.)
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const float* m, int ld, int row, int col) {
  mma::ldmatrix_x4(r, mma::smem_addr(m + row * ld + col));
}
// A fragment of the 16x8 tile at (row0, k0): blocks (row0, k0), (row0 + 8, k0), (row0, k0 + 4), (row0 + 8, k0 + 4)
// are a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4).
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const float* m, int ld, int row0, int k0, int lane) {
  ldsm_x4(a, m, ld, row0 + lane % 16, k0 + 4 * (lane / 16));
}
// B fragments (k, n) = m[n][k] of the n-tiles at n0 and n0 + 8: blocks (n0, k0), (n0, k0 + 4), (n0 + 8, k0),
// (n0 + 8, k0 + 4) are b[0][0] = m[n0 + g][k0 + t], b[0][1] (k0 + t + 4), b[1][0], b[1][1].
__device__ __forceinline__ void ldsm_b_nk_n16(uint32_t (*b)[2], const float* m, int ld, int n0, int k0, int lane) {
  uint32_t r[4];
  ldsm_x4(r, m, ld, n0 + lane % 8 + 8 * (lane / 16), k0 + 4 * (lane / 8 % 2));
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// B fragments (k, n) = m[n][k] of the n-tile at n0 for the k-steps at k0 and k0 + 8: blocks (n0, k0 + 4 i), i < 4.
__device__ __forceinline__ void ldsm_b_nk_k16(uint32_t (*b)[2], const float* m, int ld, int n0, int k0, int lane) {
  uint32_t r[4];
  ldsm_x4(r, m, ld, n0 + lane % 8, k0 + 4 * (lane / 8));
  b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
}
// B fragment (k, n) = m[k][n]: B stored row-major (rows = k), as Delta[j][v]; b0 = m[k0 + t][n0 + g].
template <bool kRaw = false>
__device__ __forceinline__ void load_b_kn(uint32_t b[2], const float* m, int ld, int n0, int k0, int g, int t) {
  b[0] = op_bits<kRaw>(m[(k0 + t) * ld + n0 + g]);
  b[1] = op_bits<kRaw>(m[(k0 + t + 4) * ld + n0 + g]);
}
// load_b_kn for NT n-tiles whose columns interleave: tile j's column n is n0 + NT n + j. A lane's NT values of a row
// are then adjacent, one 64- or 128-bit load (n0 and ld multiples of 4 floats); b[j][0] = m[k0 + t][n0 + NT g + j].
// The product's owner maps its accumulators back the same way (tile j's column 2 t + e % 2 -> n0 + NT (2 t + e % 2)
// + j): each output is still one mma chain over the same operands, only the lane that holds it changes.
template <int NT, bool kRaw = false>
__device__ __forceinline__ void load_b_kn_interleaved(uint32_t (&b)[NT][2], const float* m, int ld, int n0, int k0,
                                                      int g, int t) {
  float x0[NT], x1[NT];
  load_vec<NT>(x0, m + (k0 + t) * ld + n0 + NT * g);
  load_vec<NT>(x1, m + (k0 + t + 4) * ld + n0 + NT * g);
#pragma unroll
  for (int j = 0; j < NT; ++j) b[j][0] = op_bits<kRaw>(x0[j]), b[j][1] = op_bits<kRaw>(x1[j]);
}
// Rounds a landed [C][COLS] shared tile to TF32 in place (all threads; the caller syncs before and after), a
// float4 at a time (m and ld multiples of 4 floats): a quarter of the shared loads and stores of scalar passes.
template <int COLS>
__device__ __forceinline__ void round_tile(float* m, int ld) {
  static_assert(COLS % 4 == 0);
  constexpr int kQuads = COLS / 4;
  for (int i = threadIdx.x; i < kChunk * kQuads; i += kThreads) {
    float* q = m + (i / kQuads) * ld + 4 * (i % kQuads);
    float v[4];
    load_vec<4>(v, q);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = tf32_round(v[e]);
    store_vec<4>(q, v);
  }
}

}  // namespace lily::cuda::dn_chunk
