// gemm_lab: issue 15's first candidate, the 4-bit x bf16 prefill GEMM on Hopper warpgroup MMA (wgmma), standalone.
//   Y[M, N] (fp32) = X[M, K] (bf16, row-major) . W[N, K]^T, W in MLX affine 4-bit (group 64: uint32 words of 8
//   nibbles LSB first, bf16 scale and bias per group, w = scale * q + bias).
// Structure (FlashAttention-3 / DeepGEMM shape, simplified: no TMA, no clusters):
//   * CTA tile 128 (M) x 128 (N), K in tiles of 64 (one 128-byte swizzle row of bf16), a ring of kStages stages in
//     shared memory, each the A tile (128 x 64 bf16) and the dequantised B tile (128 x 64 bf16), both K-major with
//     the 128-byte swizzle wgmma reads (16-byte chunk c of row r at chunk c ^ (r % 8) inside each 1024-byte block).
//   * Warp specialisation, 3 warpgroups: WG0 produces (each thread one A row and one B row per stage: 16-byte
//     global loads one stage ahead in registers, the dequantisation in fp32 (magic-number int -> float: one LOP3 +
//     one FADD per code, then one FMA) packed to bf16 pairs, swizzled 16-byte shared stores, a proxy fence, an
//     mbarrier arrival); WG1 and WG2 consume (64 rows each: 4 wgmma.m64n128k16 per stage from shared-memory
//     descriptors, fp32 accumulators in registers, then each warp arrives on the stage's "empty" barrier).
//   * The dequantised weights are rounded to bf16 (the matrix units' input); the accumulation is fp32.
// Checked against a plain CUDA-core kernel with the same bf16-rounded weights (the first 256 rows, rel RMS; every
// output finite) and an fp64 host reference on sampled entries; outputs NaN-poisoned first. Timed on the real prefill shapes.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/gemm_lab dev/gemm_lab/gemm_wgmma.cu
//   /tmp/gemm_lab [M]                (H200; M defaults to 4096)
// v1 ran on the H200 (2026-12-02): correct, 177-195 TFLOP/s at M = 4096. v2 (below v1) streams both operands by
// cp.async several stages ahead and keeps a wgmma group in flight; v3 is v2 with the dequantisation in bf16x2
// arithmetic (dequant8_bf16x2): 177-181 TFLOP/s. v4 (the weights as the register operand) ran 2026-12-02 at 421-473
// TFLOP/s and became csrc/cuda/gemm_wgmma.cu; its lab form is in git (`git show 92ce5fc:dev/gemm_lab/gemm_wgmma.cu`).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/mma_bf16.cuh"  // cp.async
#include "cuda/wgmma.cuh"     // mbarriers, cp4, ld_s32, word_of, the swizzle and descriptor (the engine kernel's)

namespace mma = lily::cuda::mma;
using namespace lily::cuda::wg;

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kStages = 4;
constexpr int kTileBytes = kBM * kBK * 2;           // 16 KB: one operand tile of one stage
constexpr int kStageBytes = 2 * kTileBytes;         // A + B
constexpr int kSmem = kStages * kStageBytes + 1024;  // + alignment slack (swizzled tiles need 1024-byte alignment)
constexpr int kThreads = 384;                        // 3 warpgroups

__device__ __forceinline__ uint4 ld_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_s128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// D[64 x 128] += A[64 x 16] . B[128 x 16]^T, both from shared memory; 64 fp32 accumulators per thread.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.eq.u32 p, 1, 1;\n"  // scale-d = true: D += A B
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16f(uint32_t h) { return __uint_as_float(h << 16); }

// 8 codes of one word -> 8 bf16 (4 words of 2): w = s q + b in fp32, q via the 2^23 magic number.
__device__ __forceinline__ uint4 dequant8(uint32_t v, float s, float b) {
  float w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float q = __uint_as_float(((v >> (4 * j)) & 15u) | 0x4B000000u) - 8388608.f;
    w[j] = fmaf(s, q, b);
  }
  return make_uint4(pack_bf16(w[0], w[1]), pack_bf16(w[2], w[3]), pack_bf16(w[4], w[5]), pack_bf16(w[6], w[7]));
}

// v3's dequantisation: the same 8 codes in bf16x2 arithmetic. The codes of nibbles j and j + 4 land in one word's two
// bf16 halves with the 128.0 magic (one LOP3: 128 + q exactly), q = x - 128 is exact, and w = q s + b is one fused
// bf16x2 FMA (a single rounding; v1 / v2 round fp32 s q + b to bf16, a double rounding that differs on rare ties);
// four PRMTs put the pairs in k order. 19 instructions for 8 weights, against ~56 for dequant8.
__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ uint32_t magic_pair(uint32_t v) {  // (v & 0x000F000F) | 0x43004300 in one LOP3
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "n"(0x000F000Fu), "n"(0x43004300u));
  return d;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint4 dequant8_bf16x2(uint32_t v, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  const __nv_bfloat162 c128 = bits_bf2(0x43004300u);
  uint32_t p[4];  // p[j] = (w_j, w_j+4)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 x = bits_bf2(magic_pair(v >> (4 * j)));
    p[j] = bf2_bits(__hfma2(__hsub2(x, c128), s2, b2));
  }
  return make_uint4(prmt(p[0], p[1], 0x5410), prmt(p[2], p[3], 0x5410), prmt(p[0], p[1], 0x7632),
                    prmt(p[2], p[3], 0x7632));
}

struct Args {
  const uint16_t* x;       // [M, K] bf16
  const uint32_t* codes;   // [N, K/8]
  const uint16_t* scales;  // [N, K/64]
  const uint16_t* biases;
  float* y;                // [M, N]
  int M, N, K;
};

// Producer registers for one stage: this thread's A row (128 bytes) and B row (32 bytes of codes + scale, bias).
struct Loads {
  uint4 a[8];
  uint4 c[2];
  uint32_t s, b;
};

// What both kernels share: the 1024-aligned dynamic shared memory, the stage barriers, a producer thread's rows
// and the accumulator store.
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}
template <int S>
__device__ void init_stage_barriers(uint64_t (&full)[S], uint64_t (&empty)[S]) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      bar_init(&full[s], 128);  // every producer thread arrives
      bar_init(&empty[s], 8);   // lane 0 of each consumer warp, after its wgmma reads are done
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}
struct ProducerRows {  // producer thread t's A row m0 + t and B row n0 + t (clamped to the last rows)
  const unsigned char* xa;
  const uint32_t* cw;
  const uint16_t *sc, *bi;
  __device__ ProducerRows(const Args& g, int m0, int n0, int t) {
    const int ra = min(m0 + t, g.M - 1), rb = min(n0 + t, g.N - 1);
    xa = reinterpret_cast<const unsigned char*>(g.x + static_cast<int64_t>(ra) * g.K);
    cw = g.codes + static_cast<int64_t>(rb) * (g.K / 8);
    sc = g.scales + static_cast<int64_t>(rb) * (g.K / 64);
    bi = g.biases + static_cast<int64_t>(rb) * (g.K / 64);
  }
};
// Consumer warpgroup `half`'s 64 x 128 accumulators to Y: 8-column block i / 4; rows 16 warp + lane / 4 (+ 8 for
// the second pair).
__device__ void store_acc(const Args& g, const float (&d)[64], int m0, int n0, int half, int t) {
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = m0 + half * 64 + warp * 16 + lane / 4 + 8 * ((i / 2) % 2);
    const int col = n0 + (i / 4) * 8 + (lane % 4) * 2 + (i % 2);
    if (row < g.M && col < g.N) g.y[static_cast<int64_t>(row) * g.N + col] = d[i];
  }
}

__global__ void __launch_bounds__(kThreads, 1) gemm_wgmma_kernel(const __grid_constant__ Args g) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const uint32_t sbase = smem_addr(aligned_smem(smem_raw));
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, ktiles = g.K / kBK;
  init_stage_barriers(full, empty);

  if (wg == 0) {  // ---- producer: thread t loads A row m0 + t and B row n0 + t ----
    const ProducerRows rw(g, m0, n0, t);
    const unsigned char* xa = rw.xa;
    const uint32_t* cw = rw.cw;
    const uint16_t *sc = rw.sc, *bi = rw.bi;
    auto load = [&](int kt, Loads& L) {
#pragma unroll
      for (int c = 0; c < 8; ++c) L.a[c] = ld_nc(xa + kt * 128 + c * 16);
      L.c[0] = ld_nc(cw + kt * 8);
      L.c[1] = ld_nc(cw + kt * 8 + 4);
      L.s = __ldg(sc + kt);
      L.b = __ldg(bi + kt);
    };
    Loads cur, nxt;
    load(0, cur);
    for (int kt = 0; kt < ktiles; ++kt) {
      const int s = kt % kStages;
      if (kt + 1 < ktiles) load(kt + 1, nxt);  // one stage ahead in registers
      if (kt >= kStages) bar_wait(&empty[s], ((kt / kStages) - 1) & 1);
      const uint32_t a_s = sbase + s * kStageBytes, b_s = a_s + kTileBytes;
#pragma unroll
      for (int c = 0; c < 8; ++c) st_s128(a_s + swz(t, c), cur.a[c]);
      const float sf = bf16f(cur.s), bf = bf16f(cur.b);
      const uint32_t w8[8] = {cur.c[0].x, cur.c[0].y, cur.c[0].z, cur.c[0].w, cur.c[1].x, cur.c[1].y, cur.c[1].z, cur.c[1].w};
#pragma unroll
      for (int c = 0; c < 8; ++c) st_s128(b_s + swz(t, c), dequant8(w8[c], sf, bf));  // word c = k 8c..8c+7
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores -> the async proxy (wgmma)
      bar_arrive(&full[s]);
      if (kt + 1 < ktiles) cur = nxt;
    }
  } else {  // ---- consumers: warpgroup wg - 1 computes rows 64 (wg - 1) .. + 63 of the tile ----
    const int half = wg - 1;
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt) {
      const int s = kt % kStages;
      bar_wait(&full[s], (kt / kStages) & 1);
      const uint32_t a_s = sbase + s * kStageBytes + half * 64 * 128, b_s = sbase + s * kStageBytes + kTileBytes;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64n128k16(d, desc(a_s + kk * 32), desc(b_s + kk * 32));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (t % 32 == 0) bar_arrive(&empty[s]);
    }
    store_acc(g, d, m0, n0, half, t);
  }
}

// ---- v2 (2026-12-02, after v1 ran at 18-20% of 990 on the H200): the producer never waits on a global load ----
// v1's producer held one stage of loads in registers, so every stage paid most of a global round trip (~1 us against
// the ~0.35 us of MMA a stage holds), and its consumers drained the tensor pipe after every stage (wait_group 0).
// v2: the producer streams A (raw bf16, straight into the swizzled tile) and the raw 4-bit codes with their scale and
// bias words (into a small raw tile) by cp.async, kV2Ahead stages ahead of the stage it dequantises; a stage's slot
// is refilled once the consumers release it (empty barrier; refilling the slot of the stage just before would wait
// on consumers who wait on this stage: two slots of slack). The consumers keep one wgmma group in flight
// (wait_group 1) and release the stage before it.
constexpr int kV2Stages = 6;
constexpr int kV2Ahead = kV2Stages - 2;  // stage kt + 4 refills stage kt - 2's slot, released one iteration earlier
constexpr int kRawBytes = kBN * 32 + kBN * 8;                 // codes [128][32 B] + words of scale, bias [128][2]
constexpr int kV2StageBytes = 2 * kTileBytes + kRawBytes;     // A, B (bf16), raw B
constexpr int kV2Smem = kV2Stages * kV2StageBytes + 1024;

__device__ __forceinline__ uint4 ld_s128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t half_of(uint32_t w, const uint16_t* p) {
  return (reinterpret_cast<uintptr_t>(p) & 2) ? w >> 16 : w & 0xFFFFu;
}

template <bool kBf16Math>  // false: v2 (fp32 dequantisation), true: v3 (bf16x2, dequant8_bf16x2)
__global__ void __launch_bounds__(kThreads, 1) gemm_wgmma_v2_kernel(const __grid_constant__ Args g) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kV2Stages], empty[kV2Stages];
  const uint32_t sbase = smem_addr(aligned_smem(smem_raw));
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, ktiles = g.K / kBK;
  init_stage_barriers(full, empty);

  if (wg == 0) {  // ---- producer: thread t streams A row m0 + t and B row n0 + t ----
    const ProducerRows rw(g, m0, n0, t);
    const unsigned char* xa = rw.xa;
    const uint32_t* cw = rw.cw;
    const uint16_t *sc = rw.sc, *bi = rw.bi;
    auto slot = [&](int kt) { return sbase + (kt % kV2Stages) * kV2StageBytes; };
    auto issue = [&](int kt) {  // stage kt's bytes of this thread, one commit group (empty past the end)
      if (kt < ktiles) {
        const uint32_t a_s = slot(kt), raw = a_s + 2 * kTileBytes;
#pragma unroll
        for (int c = 0; c < 8; ++c) mma::cp_async16(a_s + swz(t, c), xa + kt * 128 + c * 16, true);
        mma::cp_async16(raw + t * 32, cw + kt * 8, true);
        mma::cp_async16(raw + t * 32 + 16, cw + kt * 8 + 4, true);
        cp4(raw + kBN * 32 + t * 8, word_of(sc + kt));
        cp4(raw + kBN * 32 + t * 8 + 4, word_of(bi + kt));
      }
      mma::cp_async_commit();
    };
    for (int j = 0; j < kV2Ahead; ++j) issue(j);  // the slots start empty
    for (int kt = 0; kt < ktiles; ++kt) {
      // refill the slot of stage kt + ahead once its last readers (stage kt - 2's consumers) released it
      const int kn = kt + kV2Ahead;
      if (kn < ktiles && kn >= kV2Stages) bar_wait(&empty[kn % kV2Stages], ((kn / kV2Stages) - 1) & 1);
      issue(kn);
      mma::cp_async_wait<kV2Ahead>();  // this thread's copies of stage kt have landed
      const uint32_t a_s = slot(kt), b_s = a_s + kTileBytes, raw = a_s + 2 * kTileBytes;
      const uint4 c0 = ld_s128(raw + t * 32), c1 = ld_s128(raw + t * 32 + 16);
      const uint32_t sh = half_of(ld_s32(raw + kBN * 32 + t * 8), sc + kt);
      const uint32_t bh = half_of(ld_s32(raw + kBN * 32 + t * 8 + 4), bi + kt);
      const uint32_t w8[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      if constexpr (kBf16Math) {
        const __nv_bfloat162 s2 = bits_bf2(sh * 0x10001u), b2 = bits_bf2(bh * 0x10001u);  // the bf16 in both halves
#pragma unroll
        for (int c = 0; c < 8; ++c) st_s128(b_s + swz(t, c), dequant8_bf16x2(w8[c], s2, b2));
      } else {
        const float sf = bf16f(sh), bf = bf16f(bh);
#pragma unroll
        for (int c = 0; c < 8; ++c) st_s128(b_s + swz(t, c), dequant8(w8[c], sf, bf));
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // A (cp.async) and B (stores) -> wgmma's proxy
      bar_arrive(&full[kt % kV2Stages]);
    }
    mma::cp_async_wait<0>();
  } else {  // ---- consumers: rows 64 (wg - 1) .. + 63; one wgmma group in flight ----
    const int half = wg - 1;
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt) {
      const int s = kt % kV2Stages;
      bar_wait(&full[s], (kt / kV2Stages) & 1);
      const uint32_t a_s = sbase + s * kV2StageBytes + half * 64 * 128, b_s = sbase + s * kV2StageBytes + kTileBytes;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) wgmma_m64n128k16(d, desc(a_s + kk * 32), desc(b_s + kk * 32));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // stage kt - 1's group is done
      if (kt > 0 && t % 32 == 0) bar_arrive(&empty[(kt - 1) % kV2Stages]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store_acc(g, d, m0, n0, half, t);
  }
}

// The plain twin: one thread per output, the same bf16-rounded weights, fp32 accumulation.
__global__ void gemm_ref_kernel(const __grid_constant__ Args g) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= g.N || m >= g.M) return;
  float acc = 0.f;
  for (int k = 0; k < g.K; ++k) {
    const uint32_t q = (g.codes[static_cast<int64_t>(n) * (g.K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
    const int64_t gi = static_cast<int64_t>(n) * (g.K / 64) + k / 64;
    const float w = fmaf(bf16f(g.scales[gi]), static_cast<float>(q), bf16f(g.biases[gi]));
    const float wb = bf16f(pack_bf16(w, 0.f) & 0xFFFFu);
    acc = fmaf(wb, bf16f(g.x[static_cast<int64_t>(m) * g.K + k]), acc);
  }
  g.y[static_cast<int64_t>(m) * g.N + n] = acc;
}

using lily::cuda::host_bf16;
using lily::cuda::host_float;

int main(int argc, char** argv) {
  const int M = argc > 1 ? std::atoi(argv[1]) : 4096;
  struct Shape { const char* name; int N, K; };
  const Shape shapes[] = {{"dn in-proj", 12352, 2048}, {"dn out-proj", 2048, 4096}, {"attn q+k+v", 9216, 2048},
                          {"shared gate|up", 1024, 2048}, {"odd N", 300, 128}};
  cudaDeviceProp prop;
  LILY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("gemm_lab: %s, %d SMs, M = %d\n", prop.name, prop.multiProcessorCount, M);
  LILY_CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  LILY_CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_v2_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kV2Smem));
  LILY_CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_v2_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kV2Smem));
  struct Variant { const char* name; void (*kernel)(const Args); int smem; };
  const Variant variants[] = {{"v1", gemm_wgmma_kernel, kSmem},
                              {"v3", gemm_wgmma_v2_kernel<true>, kV2Smem}};
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  int fails = 0;
  for (const Shape& sh : shapes) {
    const int N = sh.N, K = sh.K;
    if (K % kBK) { std::printf("skip %s: K %% 64\n", sh.name); continue; }
    std::vector<uint16_t> hx(static_cast<size_t>(M) * K), hs(static_cast<size_t>(N) * K / 64), hb(hs.size());
    std::vector<uint32_t> hc(static_cast<size_t>(N) * K / 8);
    for (auto& v : hx) v = host_bf16(nd(rng));
    for (auto& v : hc) v = rng();
    for (size_t i = 0; i < hs.size(); ++i) {
      const float s = (0.5f + (rng() % 1000) / 1000.f) / (8.f * std::sqrt(static_cast<float>(K)));
      hs[i] = host_bf16(s);
      hb[i] = host_bf16(-7.5f * s * (0.5f + (rng() % 1000) / 1000.f));
    }
    Args g{};
    uint16_t *dx, *dsc, *dbi;
    uint32_t* dc;
    float *dy, *dr;
    LILY_CUDA_CHECK(cudaMalloc(&dx, hx.size() * 2));
    LILY_CUDA_CHECK(cudaMalloc(&dc, hc.size() * 4));
    LILY_CUDA_CHECK(cudaMalloc(&dsc, hs.size() * 2));
    LILY_CUDA_CHECK(cudaMalloc(&dbi, hb.size() * 2));
    LILY_CUDA_CHECK(cudaMalloc(&dy, static_cast<size_t>(M) * N * 4));
    LILY_CUDA_CHECK(cudaMalloc(&dr, static_cast<size_t>(M) * N * 4));
    LILY_CUDA_CHECK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    LILY_CUDA_CHECK(cudaMemcpy(dc, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
    LILY_CUDA_CHECK(cudaMemcpy(dsc, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
    LILY_CUDA_CHECK(cudaMemcpy(dbi, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    LILY_CUDA_CHECK(cudaMemset(dy, 0xFF, static_cast<size_t>(M) * N * 4));  // NaN first
    g.x = dx, g.codes = dc, g.scales = dsc, g.biases = dbi, g.M = M, g.N = N, g.K = K;
    const dim3 grid((N + kBN - 1) / kBN, (M + kBM - 1) / kBM);
    g.y = dr;
    const int ref_rows = std::min(M, 256);  // the twin is slow (one thread per output): the first 256 rows
    gemm_ref_kernel<<<dim3((N + 127) / 128, ref_rows), 128>>>(g);
    LILY_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> y(static_cast<size_t>(M) * N), r(y.size());
    LILY_CUDA_CHECK(cudaMemcpy(r.data(), dr, r.size() * 4, cudaMemcpyDeviceToHost));
    for (const Variant& var : variants) {
      LILY_CUDA_CHECK(cudaMemset(dy, 0xFF, static_cast<size_t>(M) * N * 4));  // NaN first
      g.y = dy;
      var.kernel<<<grid, kThreads, var.smem>>>(g);
      LILY_CUDA_CHECK(cudaGetLastError());
      LILY_CUDA_CHECK(cudaDeviceSynchronize());
      LILY_CUDA_CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      bool finite = true;
      for (size_t i = 0; i < y.size(); ++i) finite = finite && std::isfinite(y[i]);
      for (size_t i = 0; i < static_cast<size_t>(ref_rows) * N; ++i) {
        num += (static_cast<double>(y[i]) - r[i]) * (y[i] - r[i]);
        den += static_cast<double>(r[i]) * r[i];
      }
      const double rel = std::sqrt(num / std::max(den, 1e-300));
      double host_worst = 0;  // fp64 host reference on 64 sampled entries (fp32 weights, not rounded)
      for (int i = 0; i < 64; ++i) {
        const int m = rng() % M, n = rng() % N;
        double acc = 0, mag = 0;
        for (int k = 0; k < K; ++k) {
          const uint32_t q = (hc[static_cast<size_t>(n) * (K / 8) + k / 8] >> (4 * (k % 8))) & 15u;
          const size_t gi = static_cast<size_t>(n) * (K / 64) + k / 64;
          const double w = static_cast<double>(host_float(hs[gi])) * q + host_float(hb[gi]);
          acc += w * host_float(hx[static_cast<size_t>(m) * K + k]);
          mag += std::fabs(w * host_float(hx[static_cast<size_t>(m) * K + k]));
        }
        host_worst = std::fmax(host_worst, std::fabs(y[static_cast<size_t>(m) * N + n] - acc) / std::fmax(mag, 1e-30));
      }
      // the weights are rounded to bf16 (2^-9 relative); against the twin with the same rounding only the fp32
      // summation order differs
      const bool ok = finite && rel <= 1e-4 && host_worst <= 4e-3;
      fails += !ok;
      cudaEvent_t e0, e1;
      LILY_CUDA_CHECK(cudaEventCreate(&e0));
      LILY_CUDA_CHECK(cudaEventCreate(&e1));
      g.y = dy;
      const int reps = 10;
      LILY_CUDA_CHECK(cudaEventRecord(e0));
      for (int i = 0; i < reps; ++i) var.kernel<<<grid, kThreads, var.smem>>>(g);
      LILY_CUDA_CHECK(cudaEventRecord(e1));
      LILY_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ms /= reps;
      const double tflops = 2.0 * M * N * K / (ms * 1e-3) / 1e12;
      std::printf("%s %s %-16s M=%d N=%d K=%d  vs twin rel_rms %.2e, vs fp64 (per |w x| sum) %.2e%s  |  %.3f ms  "
                  "%.1f TFLOP/s  (%.0f%% of 990)\n",
                  ok ? "PASS" : "FAIL", var.name, sh.name, M, N, K, rel, host_worst, finite ? "" : " NON-FINITE", ms,
                  tflops, 100.0 * tflops / 990.0);
      cudaEventDestroy(e0), cudaEventDestroy(e1);
    }
    cudaFree(dx), cudaFree(dc), cudaFree(dsc), cudaFree(dbi), cudaFree(dy), cudaFree(dr);
  }
  std::printf("SUMMARY gemm_lab %d failed\n", fails);
  return fails ? 1 : 0;
}
