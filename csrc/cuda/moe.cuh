// MoE routing, pair sort and combine (moe.cu); the expert GEMMs are gemm.cuh's grouped_*, the decode experts
// gemv.cuh's. Device pointers, stream-ordered, no host synchronisation.
#pragma once
#include "cuda/common.cuh"
#include "kernels/params.h"

namespace lily::cuda {

// Router softmax (fp32) over E experts, top-k by repeated argmax (ties -> lower index), optional renorm.
// logits: fp32 [S, E] -> top_idx int32 [S, k], top_w fp32 [S, k].
void moe_route(cudaStream_t st, const kp::MoeParams& p, const float* logits, int32_t* top_idx, float* top_w);
// Groups the S*k (token, expert) pairs by expert and cuts each group into tiles of at most tile_rows:
//   pair_row[P] (token row), pair_id[P] (s*k + j), pair_w[P]; tiles: n_tiles[1], tile_expert/row0/rows[max_tiles].
// Three launches, no host synchronisation; max_tiles = ceil(S*k / tile_rows) + E; block_base: int32 scratch of
// moe_sort_scratch(S*k, E) elements (per-block counts, then positions).
struct SortBuffers {
  int32_t *pair_row = nullptr, *pair_id = nullptr;
  float* pair_w = nullptr;
  int32_t *n_tiles = nullptr, *tile_expert = nullptr, *tile_row0 = nullptr, *tile_rows = nullptr;
  int32_t* block_base = nullptr;
};
int64_t moe_sort_scratch(int64_t pairs, int n_experts);
void moe_sort(cudaStream_t st, const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows,
              const SortBuffers& b);
// The routed experts of a chunk of S > 1 rows: the sort, then gate/up and down over its tile map (gemm.cuh's
// grouped products). h [S, H] bf16 -> act [S*k, I] bf16 (scratch), d [S*k, H] bf16 (row s*k + j: token s's pair j,
// times its routing weight, rounded once: gemm.cuh's grouped_down says why bf16). tile_rows 0: chosen from the mean
// rows per expert (else the ablation's); host_count: the ablation that waits for the tile count on the host and
// launches exactly that.
void moe_experts(cudaStream_t st, const kp::MoeParams& p, const DLinear& gate, const DLinear& up, const DLinear& down,
                 const bf16* h, const int32_t* top_idx, const float* top_w, const SortBuffers& b, bf16* act, bf16* d,
                 int tile_rows, bool host_count);
// x[s, :] += sigmoid(gate[s]) * sh[s, :] + sum_j d[s*k + j, :] (fp32 sum, j in order).  sh fp32 [S, H], d bf16 [S*k, H],
// gate fp32 [S], x fp32 [S, H].
void moe_combine(cudaStream_t st, const kp::MoeParams& p, const float* sh, const float* gate, const bf16* d, float* x);

}  // namespace lily::cuda
