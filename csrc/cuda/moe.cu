#include "cuda/moe.cuh"

namespace lily::cuda {
namespace {

// One warp per token row (route_topk_warp).
__global__ void route_kernel(kp::MoeParams p, const float* logits, int32_t* top_idx, float* top_w) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (s >= p.S) return;
  route_topk_warp(logits + s * p.n_experts, p.n_experts, p.top_k, p.norm_topk_prob != 0, top_idx + s * p.top_k,
                  top_w + s * p.top_k, threadIdx.x % 32);
}

// One block of 1,024 threads: histogram -> exclusive scans (pairs and tiles per expert) -> tile map, one thread
// per expert -> scatter of pairs. The pairs of a warp that share an expert meet in one shared-memory atomic
// (__match_any_sync): routing is skewed, and one atomic per pair serialised on the popular experts.
__global__ void sort_kernel(kp::MoeParams p, const int32_t* top_idx, const float* top_w, int tile_rows,
                            int32_t* pair_row, int32_t* pair_id, float* pair_w, int32_t* n_tiles,
                            int32_t* tile_expert, int32_t* tile_row0, int32_t* tile_rows_out) {
  extern __shared__ int sm[];
  __shared__ int ws[33];
  const int E = p.n_experts, k = p.top_k, lane = threadIdx.x % 32;
  const int64_t P = p.S * k;
  int* counts = sm;
  int* fill = sm + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t base = 0; base < P; base += blockDim.x) {  // warp-uniform trip count (__match_any_sync)
    const int64_t i = base + threadIdx.x;
    const int e = i < P ? top_idx[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(peers) - 1) atomicAdd(&counts[e], __popc(peers));
  }
  __syncthreads();
  const int e = threadIdx.x;
  const int c = e < E ? counts[e] : 0, nt = (c + tile_rows - 1) / tile_rows;
  int total_tiles = 0;
  const int c_before = block_exclusive_scan(c, ws, nullptr);
  const int t_before = block_exclusive_scan(nt, ws, &total_tiles);
  if (e < E) {
    fill[e] = c_before;
    for (int j = 0; j < nt; ++j) {  // experts ascending, rows ascending: the map the serial loop wrote
      tile_expert[t_before + j] = e;
      tile_row0[t_before + j] = c_before + j * tile_rows;
      tile_rows_out[t_before + j] = min(tile_rows, c - j * tile_rows);
    }
  }
  if (threadIdx.x == 0) *n_tiles = total_tiles;
  __syncthreads();
  // Order inside an expert group is arbitrary: each pair's result depends only on its own row.
  for (int64_t base = 0; base < P; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int ei = i < P ? top_idx[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, ei);
    const int leader = __ffs(peers) - 1;
    int start = 0;
    if (ei >= 0 && lane == leader) start = atomicAdd(&fill[ei], __popc(peers));
    start = __shfl_sync(0xffffffffu, start, leader);
    if (ei >= 0) {
      const int pos = start + __popc(peers & ((1u << lane) - 1u));
      pair_row[pos] = static_cast<int32_t>(i / k);
      pair_id[pos] = static_cast<int32_t>(i);
      pair_w[pos] = top_w[i];
    }
  }
}

__global__ void combine_kernel(int64_t S, int64_t H, int k, const float* sh, const float* gate, const float* d,
                               float* x) {
  const int64_t n = S * H;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / H, c = i % H;
    float acc = sigmoidf_(gate[s]) * sh[i];
    for (int j = 0; j < k; ++j) acc += d[(s * k + j) * H + c];
    x[i] += acc;
  }
}

}  // namespace

void moe_route(cudaStream_t st, const kp::MoeParams& p, const float* logits, int32_t* top_idx, float* top_w) {
  if (p.n_experts > 256) throw std::invalid_argument("[lily] cuda moe_route: more than 256 experts");
  const int64_t threads = p.S * 32;
  route_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p, logits, top_idx, top_w);
  LILY_LAUNCH_CHECK();
}

void moe_sort(cudaStream_t st, const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows,
              int32_t* pair_row, int32_t* pair_id, float* pair_w, int32_t* n_tiles, int32_t* tile_expert,
              int32_t* tile_row0, int32_t* tile_rows_out) {
  if (p.n_experts > 1024) throw std::invalid_argument("[lily] cuda moe_sort: more than 1,024 experts");
  sort_kernel<<<1, 1024, 2 * p.n_experts * sizeof(int), st>>>(p, top_idx, top_w, tile_rows, pair_row, pair_id, pair_w,
                                                             n_tiles, tile_expert, tile_row0, tile_rows_out);
  LILY_LAUNCH_CHECK();
}

void moe_combine(cudaStream_t st, const kp::MoeParams& p, const float* sh, const float* gate, const float* d, float* x) {
  const int64_t n = p.S * p.hidden;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
  combine_kernel<<<blocks, 256, 0, st>>>(p.S, p.hidden, p.top_k, sh, gate, d, x);
  LILY_LAUNCH_CHECK();
}

}  // namespace lily::cuda
