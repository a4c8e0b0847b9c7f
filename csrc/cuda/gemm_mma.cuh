// Tensor-core prefill GEMM for MLX affine-quantized weights (4- or 8-bit codes, group 64): mma.sync m16n8k16
// bf16 -> fp32, a 4-stage cp.async pipeline that copies raw codes + scales/biases (not dequantized bf16),
// and dequantization from shared memory straight into the B fragment registers.
// linear.cu dispatches here wherever gemm_mma_supported and keeps the wmma GEMM as the fallback for the rest.
#pragma once
#include "cuda/linear.cuh"

namespace lily::cuda {

// Arguments of gemm_mma_kernel. Plain or grouped rows per gp/g exactly as the wmma GEMM:
//   y[orow, n] (=|+=) scale * (A[arow] . W0[e, n])     fp32 epilogue (store / accumulate)
//   yb[orow, n] = bf16(silu(A[arow] . W0[e, n]) * (A[arow] . W1[e, n]))   dual epilogue (FFN gate/up)
struct GemmMmaArgs {
  DLinear W0;                // [E?, out, in] quantized, in % 64 == 0
  DLinear W1;                // dual only: same shape and format as W0
  kp::GemmParams gp;
  GroupMap g;                // grouped only
  const bf16* A = nullptr;   // [rows, lda] bf16, lda % 8 == 0, 16-byte aligned
  float* y = nullptr;        // [rows, ldy] fp32 (store / accumulate)
  bf16* yb = nullptr;        // [rows, ldy] bf16 (dual)
};

// True when the mma path runs this product: kind 0, 4 or 8 bits, group 64, in % 64 == 0, 16-byte aligned
// codes and A rows; W1 (dual, may be nullptr) must match W0. Otherwise callers use the wmma GEMM.
bool gemm_mma_supported(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda);

// Rows per block tile (16/32/64/128) of a plain GEMM with M rows and `cols` output columns.
int gemm_mma_plain_rows(int64_t M, int64_t cols, bool dual);

// Launches the kernel with `bm` rows per tile (16, 32, 64 or 128). Grouped tiles must hold <= bm rows.
void gemm_mma(cudaStream_t st, const GemmMmaArgs& a, bool dual, int bm);

}  // namespace lily::cuda
