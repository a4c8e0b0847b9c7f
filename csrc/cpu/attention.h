// Gated full attention core (docs/model.md §4.2 steps 2-8, without the projections).
#pragma once
#include "cpu/thread_pool.h"
#include "kernels/params.h"

namespace lily::cpu {

// qg: [S, Hq, 2D] per head [query | gate] (modified: q normed + rotated in place)
// k, v: [S, Hkv, D] fresh projections (k modified in place)
// q_norm, k_norm: [D]
// k_cache, v_cache: [>= pos0+S, Hkv, D]; rows pos0..pos0+S-1 are written (post-RoPE k)
// o: [S, Hq*D] = softmax(q K^T * scale, causal) V  * sigmoid(gate)
void attention_forward(ThreadPool& pool, const kp::AttentionParams& p, float* qg, float* k, const float* v,
                       const float* q_norm, const float* k_norm, float* k_cache, float* v_cache, float* o);

}  // namespace lily::cpu
