// Hopper helpers shared by the warp-specialised wgmma GEMM (gemm_wgmma.cu) and the wgmma flash attention
// (attention_prefill_wgmma.cu): mbarriers (init, arrive, parity wait, and the arrival
// of a thread's cp.async copies), the 4-byte cp.async, a 32-bit shared load, the word holding a bf16 and which half,
// the 128-byte swizzle with wgmma's shared-memory descriptors, and the wgmma instructions themselves.
#pragma once
#include <cstdint>

#include "cuda/mma_bf16.cuh"

namespace lily::cuda::wg {

using mma::smem_addr;

__device__ __forceinline__ void bar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n W_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W_%=;\n}\n" ::"r"(smem_addr(b)), "r"(phase) : "memory");
}
__device__ __forceinline__ void cp_bar_arrive(uint64_t* b) {  // arrives once this thread's cp.asyncs have landed
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {  // 16 bytes of a valid source
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint32_t ld_s32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}
// The 4-byte word holding a bf16 (cp.async moves 4 bytes at least); half_bit: which half of it the bf16 is.
__device__ __forceinline__ const void* word_of(const uint16_t* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(3));
}
__device__ __forceinline__ uint32_t half_bit(const uint16_t* p) { return (reinterpret_cast<uintptr_t>(p) >> 1) & 1u; }

// Byte offset of 16-byte chunk c (0..7) of row r in a K-major 128-byte-swizzled tile (what wgmma's descriptor reads).
__host__ __device__ __forceinline__ uint32_t swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
// wgmma shared-memory descriptor of a 128-byte-swizzled tile (8-row swizzle atoms of 1024 bytes). K-major (the
// defaults): consecutive 8-row groups sbo = 1024 bytes apart, lbo unused. N-major (a B operand with N contiguous):
// lbo = the bytes between consecutive 64-wide blocks along N, sbo = between consecutive 8-row groups along k (PTX
// ISA, "Matrix Descriptor").
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo = 16, uint32_t sbo = 1024) {
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (static_cast<uint64_t>(1) << 62);
}

// ---- warpgroup MMA (m64nNk16, bf16 operands, fp32 accumulators in the PTX fragment layout: accumulator i of a
// thread of warp w holds row 16 w + lane / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (lane % 4) + i % 2) ----
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LILY_WGMMA 1
#endif
// Operand lists of the wgmma wrappers: 8 / 32 accumulators from d[i] on.
#define LILY_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                     "+f"(d[i + 6]), "+f"(d[i + 7])
#define LILY_ACC32(i) LILY_ACC8(i), LILY_ACC8(i + 8), LILY_ACC8(i + 16), LILY_ACC8(i + 24)
#define LILY_REGS32 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
                    "%24,%25,%26,%27,%28,%29,%30,%31"
#define LILY_REGS64 LILY_REGS32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51," \
                    "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define LILY_REGS128 LILY_REGS64 ",%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83," \
                     "%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104," \
                     "%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122," \
                     "%123,%124,%125,%126,%127"

// D[64 x N] += A[64 x 16] . B, N = 2 x the accumulator count (64, 128, 256): A in registers (the m16n8k16 A
// fragment of each warp's 16 rows), B [16 x N] through a shared-memory descriptor, K-major (kTransB 0) or N-major
// (kTransB 1). Always accumulates.
template <int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
#ifdef LILY_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LILY_REGS32 "}, {%32,%33,%34,%35}, %36, "
               "p, 1, 1, %37;\n}\n"
               : LILY_ACC32(0)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(kTransB));
#endif
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
#ifdef LILY_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LILY_REGS64 "}, {%64,%65,%66,%67}, %68, "
               "p, 1, 1, %69;\n}\n"
               : LILY_ACC32(0), LILY_ACC32(32)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(kTransB));
#endif
}
template <int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
#ifdef LILY_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" LILY_REGS128 "}, {%128,%129,%130,%131}, "
               "%132, p, 1, 1, %133;\n}\n"
               : LILY_ACC32(0), LILY_ACC32(32), LILY_ACC32(64), LILY_ACC32(96)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(kTransB));
#endif
}
// D[64 x 64] (+)= A[64 x 16] . B[64 x 16]^T, both K-major through descriptors; accumulate 0 overwrites D.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#ifdef LILY_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LILY_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : LILY_ACC32(0)
               : "l"(da), "l"(db), "r"(accumulate));
#endif
}
#undef LILY_ACC8
#undef LILY_ACC32
#undef LILY_REGS32
#undef LILY_REGS64
#undef LILY_REGS128

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {  // at most N committed groups still in flight
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps registers live and in place across an asynchronous wgmma that reads or writes them.
template <int N>
__device__ __forceinline__ void keep(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void keep(uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
}  // namespace lily::cuda::wg
