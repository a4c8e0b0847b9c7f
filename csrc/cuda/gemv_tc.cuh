// Device helpers of the tensor-core decode GEMVs (gemv_tc.cu: register loads; gemv_ring.cu / gemv_bulk.cu: weights
// streamed into shared memory by the bulk copy engine). The fragment layout and the arithmetic are explained
// at the top of gemv_tc.cu.
#pragma once
#include "cuda/gemv_stage.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda::gemv {

// Multiprocessors of the current device (read once).
inline int device_sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    return v;
  }();
  return n;
}

constexpr int kRowBlock = 16;
constexpr int kGroup = 64;

// Numbers the 16-row block tasks of a proj launch: segment s's tasks start at seg[s].warp0 and it has
// seg[s].warps_per_slot row blocks per slot (the fields the scalar kernel uses for warps). Returns the count.
inline int64_t number_row_block_tasks(ProjArgs& a) {
  int64_t tasks = 0;
  for (int s = 0; s < a.nseg; ++s) {
    Seg& g = a.seg[s];
    if (g.w0.p.in != a.in) throw std::invalid_argument("[lily] cuda decode proj: segment input length mismatch");
    g.warps_per_slot = static_cast<int32_t>((g.w0.p.out + kRowBlock - 1) / kRowBlock);
    g.warp0 = static_cast<int32_t>(tasks);
    tasks += static_cast<int64_t>(g.slots) * g.warps_per_slot;
  }
  return tasks;
}

__host__ __device__ __forceinline__ bool tc_ok(const kp::LinearParams& p) {
  return p.kind == 0 && p.bits == 4 && p.group == kGroup && p.in % kGroup == 0;
}

// Index of value r (0..63) of a group inside the group's staged 64-block.
__device__ __forceinline__ int perm64(int r) {
  const int c = r >> 4, m = r & 15, mm = m & 7;
  return c * 16 + 4 * (mm & 3) + (m >= 8 ? 2 : 0) + (mm >> 2);
}

// xp: xs [n] in perm64 order per group; gs[g]: fp32 sum of group g's (bf16) values. n % 64 == 0.
__device__ __forceinline__ void permute_x(const bf16* xs, bf16* xp, float* gs, int n, int warp, int lane) {
  for (int g = warp; g < n / kGroup; g += kWarps) {
    const bf16 v0 = xs[g * kGroup + lane], v1 = xs[g * kGroup + 32 + lane];
    xp[g * kGroup + perm64(lane)] = v0;
    xp[g * kGroup + perm64(lane + 32)] = v1;
    const float s = warp_sum(__bfloat162float(v0) + __bfloat162float(v1));
    if (lane == 0) gs[g] = s;
  }
}

__device__ __forceinline__ uint32_t nib_pair(uint32_t w, int i) {  // bf16x2 (128 + code i, 128 + code i+4)
  return ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
}

using mma::mma_bf16;  // mma_bf16.cuh

// Any weight format, scalar lanes: lane = 2 r + half takes row row0 + r, values [32 half, 32 half + 32) of
// each 64-slice l in [l0, l1). Returns the lane pair's sum (valid in both lanes of the pair).
__device__ __forceinline__ float scalar_rows(const DLinear& W, int64_t e, int64_t row0, int l0, int l1,
                                             const bf16* xs, int lane) {
  const int64_t row = min64(row0 + lane / 2, W.p.out - 1);
  float acc = 0.f;
  for (int l = l0; l < l1; ++l) {
    const int64_t k0 = static_cast<int64_t>(l) * kGroup + (lane & 1) * 32;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float w[8];
      load_w8(W, e, row, k0 + 8 * j, w);
#pragma unroll
      for (int t = 0; t < 8; ++t) acc += w[t] * __bfloat162float(xs[k0 + 8 * j + t]);
    }
  }
  return acc + __shfl_xor_sync(0xffffffffu, acc, 1);
}

}  // namespace lily::cuda::gemv
