// Device helpers shared by the decode GEMVs (gemv.cu: scalar GEMV rows; gemv_tc.cu / gemv_ring.cu / gemv_bulk.cu:
// tensor-core GEMV rows): the staging prologue (input row into shared memory with the producer's normalisation), the
// routing prologue and the argmax key (PDL controls: common.cuh).
#pragma once
#include "cuda/gemv.cuh"

namespace lily::cuda::gemv {

constexpr int kWarps = 8;  // warps per block of the proj / down kernels
constexpr int kThreads = kWarps * 32;

// Barrier over the kThreads compute threads: the whole block, or named barrier 1 when the block also has a
// producer warp that runs its own loop (gemv_bulk.cu).
template <bool kNamed>
__device__ __forceinline__ void compute_sync() {
  if constexpr (kNamed) asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
  else __syncthreads();
}

// The input row into shared memory (bf16), with the producer's normalisation (same arithmetic as
// rms_norm_kernel and gated_norm_kernel, so the fused path rounds exactly as the unfused one).
template <bool kNamed = false>
__device__ __forceinline__ void stage_x(const ProjArgs& a, bf16* xs, float* red, int tid, int warp, int lane) {
  const int n = a.in;
  if (a.xmode == kXBf16) {
    if (n % 8 == 0 && (reinterpret_cast<uintptr_t>(a.xb) & 15u) == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(a.xb);
      uint4* dst = reinterpret_cast<uint4*>(xs);
      for (int i = tid; i < n / 8; i += kThreads) dst[i] = src[i];
    } else {
      for (int i = tid; i < n; i += kThreads) xs[i] = a.xb[i];
    }
  } else if (a.xmode == kXNorm) {
    const float* x = a.xf;
    float ss = 0.f;
    for (int i = tid; i < n; i += kThreads) ss += x[i] * x[i];
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    compute_sync<kNamed>();
    if (warp == 0) {
      float v = lane < kWarps ? red[lane] : 0.f;
      v = warp_sum(v);
      if (lane == 0) red[0] = v;
    }
    compute_sync<kNamed>();
    const float inv = rsqrtf(red[0] / static_cast<float>(n) + a.eps);
    const bool write = a.h_out != nullptr && blockIdx.x == 0;
    for (int i = tid; i < n; i += kThreads) {
      const bf16 h = __float2bfloat16(x[i] * inv * a.nw[i]);
      xs[i] = h;
      if (write) a.h_out[i] = h;
    }
  } else {  // gated RMSNorm per head of gdim elements, times silu(z)
    const int D = a.gdim, nh = n / D;
    for (int h = warp; h < nh; h += kWarps) {
      const float* yr = a.xf + static_cast<int64_t>(h) * D;
      const float* zr = a.zf + static_cast<int64_t>(h) * D;
      float ss = 0.f;
      for (int i = lane; i < D; i += 32) ss += yr[i] * yr[i];
      ss = warp_sum(ss);
      const float inv = 1.f / sqrtf(ss / static_cast<float>(D) + a.eps);
      for (int i = lane; i < D; i += 32) {
        const float zz = zr[i];
        xs[h * D + i] = __float2bfloat16(yr[i] * inv * a.nw[i] * (zz / (1.f + expf(-zz))));
      }
    }
  }
}

// The decode step's router row (route_kernel's arithmetic, common.cuh): top-k into shared memory, and block 0 also
// stores it for the host's expert statistics.
__device__ __forceinline__ void route_warp(const ProjArgs& a, int32_t* s_idx, float* s_w, int lane) {
  route_topk_warp(a.rlogits, a.E, a.top_k, a.norm_topk != 0, s_idx, s_w, lane);
  if (lane == 0 && blockIdx.x == 0 && a.top_idx)
    for (int j = 0; j < a.top_k; ++j) a.top_idx[j] = s_idx[j], a.top_w[j] = s_w[j];
}

__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t row) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // order-preserving
  return (static_cast<unsigned long long>(k) << 32) | static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<uint32_t>(row));
}

// Output row `row` of segment sg, slot `slot`: v0 is the row's dot product (the gate's for a dual segment),
// v1 the up projection's (dual only). Store (tracking the greedy head's argmax key), accumulate into the
// residual, SiLU(gate) * up in bf16, or the DeltaNet causal conv + SiLU of channel `row` with its state shift.
__device__ __forceinline__ void seg_epilogue(const ProjArgs& a, const Seg& sg, int slot, int64_t row, float v0,
                                             float v1, unsigned long long& key) {
  if (row >= sg.w0.p.out) return;
  const int64_t o = slot * sg.y_step + row;
  if (sg.mode == kOStore) {
    sg.y[o] = v0;
    key = max(key, argmax_key(v0, row));
  } else if (sg.mode == kOAccum) {
    sg.y[o] += v0;
  } else if (sg.mode == kODual) {
    sg.yb[o] = __float2bfloat16(siluf_(v0) * v1);
  } else {
    const int K = a.conv_k;
    const int64_t C = a.conv_dim;
    const float* w = a.conv_w + row * K;
    float* cs = a.conv_state;
    float cv = 0.f;
    for (int j = 0; j < K - 1; ++j) cv += w[j] * cs[j * C + row];
    cv += w[K - 1] * v0;
    a.u[row] = cv / (1.f + expf(-cv));
    for (int r = 0; r < K - 1; ++r) cs[r * C + row] = r + 1 < K - 1 ? cs[(r + 1) * C + row] : v0;
  }
}

}  // namespace lily::cuda::gemv
