// Hopper helpers shared by the warp-specialised wgmma GEMM (gemm_wgmma.cu) and its lab (dev/gemm_lab): mbarriers
// (init, arrive, parity wait, and the arrival of a thread's cp.async copies), the 4-byte cp.async, a 32-bit shared
// load, the word holding a bf16 and which half, and the 128-byte swizzle with wgmma's shared-memory descriptor.
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
// wgmma shared-memory descriptor: K-major, 128-byte swizzle, 8-row core-matrix groups 1024 bytes apart.
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

}  // namespace lily::cuda::wg
