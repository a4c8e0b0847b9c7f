// Device pieces both prefill flash-attention kernels share (attention_prefill.cu on mma.sync,
// attention_prefill_wgmma.cu on wgmma): their online softmax step on a tile of scores, and their epilogue.
#pragma once
#include "cuda/attention.cuh"

namespace lily::cuda {

constexpr float kAttnLog2e = 1.4426950408889634f;  // scores are kept in log2 units: exp2f(s * scale * log2e - m)

// One key tile's online-softmax step on a thread's scores s [NK] (the PTX accumulator layout: s[4 n + e] is key
// k0 + 8 n + 2 tig + (e & 1) of the thread's row e / 2), in two halves so the caller rescales O between them (where
// both kernels had it; after the exponentials ptxas scheduled the wgmma kernel's loop worse: 208 more instructions).
// softmax_max: scale to log2 units (sl2 = scale log2 e), set keys at or past the row's limit (lim0 / lim1, exclusive)
// to -inf when need_mask, update the running max m; corr0 / corr1: the factors O's rows and l are rescaled by; mu0 /
// mu1: the max to subtract (0 for a row with no key yet, so exp2f gives 0, not NaN).
template <int NK>
__device__ __forceinline__ void softmax_max(float (&s)[NK], float sl2, bool need_mask, int64_t k0, int tig,
                                            int64_t lim0, int64_t lim1, float& m0, float& m1, float& mu0, float& mu1,
                                            float& corr0, float& corr1) {
#pragma unroll
  for (int j = 0; j < NK; ++j) {
    s[j] *= sl2;
    if (need_mask) {
      const int64_t key = k0 + (j / 4) * 8 + 2 * tig + (j & 1);
      if (key >= ((j & 2) ? lim1 : lim0)) s[j] = -INFINITY;
    }
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int n = 0; n < NK / 4; ++n) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * n], s[4 * n + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * n + 2], s[4 * n + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
  corr0 = exp2f(m0 - mu0), corr1 = exp2f(m1 - mu1);
  m0 = mn0, m1 = mn1;
}
// softmax_exp: s -> exp2(s - mu), the running sums l (this thread's columns only) rescaled and added to.
template <int NK>
__device__ __forceinline__ void softmax_exp(float (&s)[NK], float mu0, float mu1, float corr0, float corr1, float& l0,
                                            float& l1) {
  float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
  for (int n = 0; n < NK / 4; ++n) {
    s[4 * n] = exp2f(s[4 * n] - mu0), s[4 * n + 1] = exp2f(s[4 * n + 1] - mu0);
    s[4 * n + 2] = exp2f(s[4 * n + 2] - mu1), s[4 * n + 3] = exp2f(s[4 * n + 3] - mu1);
    rs0 += s[4 * n] + s[4 * n + 1];
    rs1 += s[4 * n + 2] + s[4 * n + 3];
  }
  l0 = l0 * corr0 + rs0;
  l1 = l1 * corr1 + rs1;
}

// Stores one thread's half of an output row: flat row f (token f / G, query head kvh G + f % G); acc [D / 2] in the
// PTX accumulator layout (acc[4 j + 2 half + e] = column 8 j + 2 tig + e of the thread's row `half`), m its running
// max in log2 units, l its quad-summed sum. One split: o = bf16(acc / l * sigmoid(gate)); several: the partials
// attn_combine_kernel merges (m in natural-log units, l and o unnormalised).
template <int D>
__device__ __forceinline__ void prefill_store_row(const AttnPrefillArgs& a, int64_t f, int G, int kvh, int split,
                                                  int half, int tig, float m, float l, const float (&acc)[D / 2]) {
  const int64_t row = (f / G) * a.p.n_heads + static_cast<int64_t>(kvh) * G + f % G;
  if (a.sp.n_splits == 1) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float* gate = a.qg + row * 2 * D + D;
    bf16* out = a.o + row * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int d = j * 8 + 2 * tig;
      const float2 gv = *reinterpret_cast<const float2*>(gate + d);
      const float x0 = acc[4 * j + 2 * half] * inv * (1.f / (1.f + expf(-gv.x)));
      const float x1 = acc[4 * j + 2 * half + 1] * inv * (1.f / (1.f + expf(-gv.y)));
      *reinterpret_cast<__nv_bfloat162*>(out + d) = __floats2bfloat162_rn(x0, x1);
    }
  } else {
    float* out = a.part + (row * a.sp.n_splits + split) * (D + 2);
    if (tig == 0) out[0] = m * (1.f / kAttnLog2e), out[1] = l;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int d = j * 8 + 2 * tig;
      *reinterpret_cast<float2*>(out + 2 + d) = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
  }
}

}  // namespace lily::cuda
