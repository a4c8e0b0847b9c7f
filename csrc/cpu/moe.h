// Sparse MoE FFN (docs/model.md §4.4): fp32 router softmax over all experts, top-k, optional renormalisation,
// rows grouped by expert, SiLU(gate)*up -> down, plus the sigmoid-gated shared expert.
#pragma once
#include <vector>

#include "core/weights.h"
#include "cpu/thread_pool.h"
#include "kernels/params.h"

namespace lily::cpu {

// Reusable buffers; sized on first use to the chunk's row count (bounded by chunk size).
struct MoeScratch {
  std::vector<float> logits;       // [S, E]
  std::vector<int> top_idx;        // [S, k]
  std::vector<float> top_w;        // [S, k]
  std::vector<int> rows;           // [S*k] rows grouped by expert
  std::vector<float> row_w;        // [S*k]
  std::vector<float> hb, g, up, d; // [S*k, H], [S*k, I], [S*k, I], [S*k, H]: (row, expert) pairs by expert
  std::vector<float> sg, su;       // [S, Is]
  std::vector<float> sig;          // [S]
};

// Routing only: top_idx/top_w [S, k] from router logits [S, E] (ties -> lower expert index).
void moe_route(const kp::MoeParams& p, const float* logits, int* top_idx, float* top_w);

// out[S, H] = MoE(h[S, H]) (overwritten).
void moe_forward(ThreadPool& pool, const kp::MoeParams& p, const MoeWeights& w, const float* h, float* out,
                 MoeScratch& sc);

}  // namespace lily::cpu
