// Linear layers of one output row at prefill (the shared expert's gate, 8-bit): y[s] = x[s] . W[0], one warp per
// token row. The GEMMs tile 128 output rows and run one K pass per tile, so a 1-row weight cost them a full pass
// per 16 tokens: 131-142 us for 4,096 tokens x 2,048 (gemm_mma_kernel<16, 8>, H200 ncu), where reading x once
// takes ~5 us. Here every warp streams its own row of x with 16-byte loads and dequantizes the (L1-resident) weight
// row with common.cuh's load_w8, rounded to bf16 as the mma GEMM's weights are; fp32 accumulate.
#include "cuda/gemm.cuh"

namespace lily::cuda {
namespace {

constexpr int kOneThreads = 256;  // 8 token rows per block

__global__ void __launch_bounds__(kOneThreads) one_output_kernel(DLinear W, const bf16* x, int64_t ldx, int64_t S,
                                                                 float* y, int64_t ldy, bool accumulate) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * kOneThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (s >= S) return;
  const bf16* xr = x + s * ldx;
  float acc = 0.f;
  for (int64_t i = 8 * lane; i < W.p.in; i += 256) {  // 8 consecutive elements per lane (one group: group % 8 == 0)
    const uint4 xv = *reinterpret_cast<const uint4*>(xr + i);
    const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
    float w[8];
    load_w8(W, 0, 0, i, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float xj = __uint_as_float(j % 2 ? xw[j / 2] & 0xFFFF0000u : xw[j / 2] << 16);
      acc = fmaf(xj, __bfloat162float(__float2bfloat16_rn(w[j])), acc);  // the weight rounded once to bf16
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) y[s * ldy] = accumulate ? y[s * ldy] + acc : acc;
}

}  // namespace

bool one_output_supported(const DLinear& W, const bf16* x, int64_t ldx) {
  return W.p.out == 1 && W.p.kind == 0 && (W.p.bits == 4 || W.p.bits == 8) && W.p.group % 8 == 0 &&
         W.p.in % 8 == 0 && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && W.codes && W.scales &&
         W.biases;
}

void linear_one_output(cudaStream_t st, const DLinear& W, const bf16* x, int64_t ldx, int64_t S, float* y, int64_t ldy,
                       bool accumulate) {
  if (S <= 0) return;
  const unsigned blocks = static_cast<unsigned>((S * 32 + kOneThreads - 1) / kOneThreads);
  one_output_kernel<<<blocks, kOneThreads, 0, st>>>(W, x, ldx, S, y, ldy, accumulate);
  LILY_LAUNCH_CHECK();
}

}  // namespace lily::cuda
