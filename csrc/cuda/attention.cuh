// Gated GQA attention over the bf16 KV cache (attention.cu: prep, dispatch, CUDA-core kernel, split combine;
// attention_prefill.cu: tensor-core flash attention on mma.sync, attention_prefill_wgmma.cu: the same on Hopper's
// wgmma; attention_decode.cu: tensor-core one-row kernel).
#pragma once
#include "cuda/common.cuh"
#include "kernels/params.h"

namespace lily::cuda {

// q/k RMSNorm + partial RoPE; k, v appended to the bf16 cache at rows pos0..pos0+S-1.
// qg: fp32 [S, Hq, 2D] ([query | gate] per head) -> q fp32 [S, Hq, D]; k, v fp32 [S, Hkv*D];
// k_cache, v_cache bf16 [capacity, Hkv*D].
void attention_prep(cudaStream_t st, const kp::AttentionParams& p, const float* qg, const float* k, const float* v,
                    const float* q_norm, const float* k_norm, float* q, bf16* k_cache, bf16* v_cache,
                    const int32_t* dpos = nullptr);
// Split plan for S rows at pos0: how many key splits keep the GPU busy; partials hold
// S * Hq * n_splits * (D + 2) floats. S > 1 plans for attention_mma, S == 1 for the decode kernels (attn_kernel's
// plan, which the tensor-core decode kernel also takes). part must hold what the plan says.
kp::AttnSplitParams attention_plan(const kp::AttentionParams& p, int sm_count);
// Causal GQA attention over the cache (keys 0..pos0+t for row t), then o = bf16(softmax(qK^T) V * sigmoid(gate)).
// part: fp32 scratch [S, Hq, n_splits, D + 2]; o: bf16 [S, Hq*D].
// dpos (prep and attention): when set, pos0 is read from the device (decode graphs) and the split length is
// derived there from the key count over the fixed sp.n_splits (empty splits write m = -inf, l = 0).
// Kernels: prefill chunks (S > 1, dpos null) the tensor-core flash attention (attention_prefill.cu); one row with
// tensor_core_decode and 8 query heads per KV head (head_dim 128 / 256) the tensor-core decode kernel
// (attention_decode.cu); anything else the CUDA-core attn_kernel (its sp.heads_per_block: the GQA packing).
// wgmma_prefill = false runs prefill chunks on the mma.sync kernel on Hopper too (the check program's twin).
void attention(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
               const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o,
               const int32_t* dpos = nullptr, bool tensor_core_decode = false, bool wgmma_prefill = true);

// attention_decode.cu (called by attention() with tensor_core_decode): one query row on the tensor cores, 8 query heads
// per KV head, head_dim 128 or 256; writes the split partials for attn_combine_kernel (any n_splits).
bool attention_decode_tc_supported(const kp::AttentionParams& p);
void attention_decode_tc(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                         const bf16* k_cache, const bf16* v_cache, float* part, const int32_t* dpos);

// Arguments of the prefill flash-attention kernels (both implementations). q: fp32 [S, Hq, D]; qg: fp32 [S, Hq, 2D]
// (gate = second half of each head's block); kc, vc: bf16 [capacity, Hkv*D]; part: fp32 [S, Hq, n_splits, D + 2]
// (only when n_splits > 1); o: bf16 [S, Hq*D] (only when n_splits == 1).
struct AttnPrefillArgs {
  kp::AttentionParams p;
  kp::AttnSplitParams sp;
  const float* q;
  const float* qg;
  const bf16* kc;
  const bf16* vc;
  float* part;
  bf16* o;
};

// attention_prefill_wgmma.cu: attention_mma's kernel on wgmma (sm_90, D in {64, 128, 256}); attention_mma calls it.
bool attention_wgmma_supported(const kp::AttentionParams& p);
void attention_wgmma(cudaStream_t st, const AttnPrefillArgs& a);

// attention_prefill.cu (called by attention(); exposed for the check program)
// Whether attention_mma handles this shape (D in {32, 64, 128, 256}, Hq a multiple of Hkv).
bool attention_mma_supported(const kp::AttentionParams& p);
// Split plan for attention_mma: splits keys only when the 128-row tiles leave SMs idle (small S, long cache).
kp::AttnSplitParams attention_mma_plan(const kp::AttentionParams& p, int sm_count);
// Causal GQA flash attention (mma.sync bf16, fp32 softmax) over keys 0..pos0+t for row t. q fp32 [S, Hq, D]
// is rounded to bf16. n_splits == 1: writes o bf16 [S, Hq*D] = softmax(qK^T)V * sigmoid(gate), gate from
// qg fp32 [S, Hq, 2D]; n_splits > 1: writes part fp32 [S, Hq, n_splits, D + 2] (attn_kernel's layout) and
// the caller merges with the combine kernel. On sm_90 the wgmma kernel runs where it supports the shape; wgmma = false
// runs the mma.sync kernel anyway (the check program compares and times the two).
void attention_mma(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                   const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o, bool wgmma = true);

}  // namespace lily::cuda
