#include "cuda/moe.cuh"

#include "cuda/gemm.cuh"

#include <type_traits>

namespace lily::cuda {
namespace {

// One warp per token row (route_topk_warp).
__global__ void route_kernel(kp::MoeParams p, const float* logits, int32_t* top_idx, float* top_w) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (s >= p.S) return;
  route_topk_warp(logits + s * p.n_experts, p.n_experts, p.top_k, p.norm_topk_prob != 0, top_idx + s * p.top_k,
                  top_w + s * p.top_k, threadIdx.x % 32);
}

// The sort in three launches over blocks of kSortPairs pairs (one block of 1,024 threads walking all pairs took
// ~135 us per 4K-token prefill on the H200: 32 dependent load rounds per pass): count (per-block histograms) ->
// plan (one block: per-expert totals, the scans, the tile map, each block's first position per expert) -> scatter.
// The pairs of a warp that share an expert meet in one shared-memory atomic (__match_any_sync): routing is
// skewed, and one atomic per pair serialised on the popular experts.
constexpr int kSortThreads = 256, kSortUnroll = 8, kSortPairs = kSortThreads * kSortUnroll;

// Block b's pairs b * kSortPairs + r * kSortThreads + tid (r < kSortUnroll), loaded before any is used; -1 past P.
__device__ __forceinline__ void load_block_pairs(const int32_t* top_idx, int64_t P, int (&e)[kSortUnroll]) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kSortPairs + threadIdx.x;
#pragma unroll
  for (int r = 0; r < kSortUnroll; ++r) e[r] = base + r * kSortThreads < P ? top_idx[base + r * kSortThreads] : -1;
}

// block_base[b, e] = pairs of expert e in block b.
__global__ void sort_count_kernel(int64_t P, int E, const int32_t* top_idx, int32_t* block_base) {
  extern __shared__ int counts[];  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  int e[kSortUnroll];
  load_block_pairs(top_idx, P, e);
  __syncthreads();
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kSortUnroll; ++r) {
    const unsigned peers = __match_any_sync(0xffffffffu, e[r]);
    if (e[r] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&counts[e[r]], __popc(peers));
  }
  __syncthreads();
  for (int x = threadIdx.x; x < E; x += blockDim.x) block_base[static_cast<int64_t>(blockIdx.x) * E + x] = counts[x];
}

// One thread per expert (blockDim >= E): totals over the nb blocks, exclusive scans of pairs and tiles, the tile
// map (experts ascending, rows ascending), and block_base[b, e] turned into block b's first sorted position of e.
__global__ void sort_plan_kernel(int nb, int E, int tile_rows, int32_t* block_base, int32_t* n_tiles,
                                 int32_t* tile_expert, int32_t* tile_row0, int32_t* tile_rows_out) {
  __shared__ int ws[33];
  const int e = threadIdx.x;
  int c = 0;
  if (e < E)
    for (int b = 0; b < nb; ++b) {  // block_base[b, e] <- pairs of e in blocks before b
      const int n = block_base[static_cast<int64_t>(b) * E + e];
      block_base[static_cast<int64_t>(b) * E + e] = c;
      c += n;
    }
  const int nt = (c + tile_rows - 1) / tile_rows;
  int total_tiles = 0;
  const int c_before = block_exclusive_scan(c, ws, nullptr);
  const int t_before = block_exclusive_scan(nt, ws, &total_tiles);
  if (e < E) {
    for (int b = 0; b < nb; ++b) block_base[static_cast<int64_t>(b) * E + e] += c_before;
    for (int j = 0; j < nt; ++j) {
      tile_expert[t_before + j] = e;
      tile_row0[t_before + j] = c_before + j * tile_rows;
      tile_rows_out[t_before + j] = min(tile_rows, c - j * tile_rows);
    }
  }
  if (threadIdx.x == 0) *n_tiles = total_tiles;
}

// Each block places its pairs from its first positions per expert. Order inside an expert group is arbitrary
// (warps race for the shared counter): each pair's result depends only on its own row.
__global__ void sort_scatter_kernel(int64_t P, int E, int k, const int32_t* top_idx, const float* top_w,
                                    const int32_t* block_base, int32_t* pair_row, int32_t* pair_id, float* pair_w) {
  extern __shared__ int fill[];  // [E]
  for (int x = threadIdx.x; x < E; x += blockDim.x) fill[x] = block_base[static_cast<int64_t>(blockIdx.x) * E + x];
  int e[kSortUnroll];
  load_block_pairs(top_idx, P, e);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kSortPairs + threadIdx.x;
#pragma unroll
  for (int r = 0; r < kSortUnroll; ++r) {
    const unsigned peers = __match_any_sync(0xffffffffu, e[r]);
    const int leader = __ffs(peers) - 1;
    int start = 0;
    if (e[r] >= 0 && lane == leader) start = atomicAdd(&fill[e[r]], __popc(peers));
    start = __shfl_sync(0xffffffffu, start, leader);
    if (e[r] >= 0) {
      const int64_t i = base + r * kSortThreads;
      const int pos = start + __popc(peers & ((1u << lane) - 1u));
      pair_row[pos] = static_cast<int32_t>(i / k);
      pair_id[pos] = static_cast<int32_t>(i);
      pair_w[pos] = top_w[i];
    }
  }
}

// One thread per VEC consecutive features of one token row (the row is gridDim.y-strided), the terms added in the
// order of the CPU twin: sigmoid(g) sh, then the k experts' rows.
template <int VEC>
__global__ void combine_kernel(int64_t S, int64_t H, int k, const float* sh, const float* gate, const bf16* d,
                               float* x) {
  using V = std::conditional_t<VEC == 4, float4, float>;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c >= H) return;
  for (int64_t s = blockIdx.y; s < S; s += gridDim.y) {
    const float g = sigmoidf_(gate[s]);
    V acc = *reinterpret_cast<const V*>(sh + s * H + c);
    const bf16* ds = d + s * k * H + c;
    if constexpr (VEC == 4) {
      acc.x *= g, acc.y *= g, acc.z *= g, acc.w *= g;
      for (int j = 0; j < k; ++j) {  // four bf16 of d in one 8-byte load
        const uint2 u = *reinterpret_cast<const uint2*>(ds + j * H);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
        acc.x += lo.x, acc.y += lo.y, acc.z += hi.x, acc.w += hi.y;
      }
      float4& o = *reinterpret_cast<float4*>(x + s * H + c);
      o.x += acc.x, o.y += acc.y, o.z += acc.z, o.w += acc.w;
    } else {
      acc *= g;
      for (int j = 0; j < k; ++j) acc += __bfloat162float(ds[j * H]);
      x[s * H + c] += acc;
    }
  }
}

}  // namespace

void moe_route(cudaStream_t st, const kp::MoeParams& p, const float* logits, int32_t* top_idx, float* top_w) {
  if (p.n_experts > 256) throw std::invalid_argument("[lily] cuda moe_route: more than 256 experts");
  const int64_t threads = p.S * 32;
  route_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p, logits, top_idx, top_w);
  LILY_LAUNCH_CHECK();
}

int64_t moe_sort_scratch(int64_t pairs, int n_experts) { return (pairs + kSortPairs - 1) / kSortPairs * n_experts; }

void moe_sort(cudaStream_t st, const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows,
              const SortBuffers& b) {
  if (p.n_experts > 1024) throw std::invalid_argument("[lily] cuda moe_sort: more than 1,024 experts");
  if (tile_rows < 1) throw std::invalid_argument("[lily] cuda moe_sort: tile_rows must be >= 1");
  const int64_t P = p.S * p.top_k, nb = (P + kSortPairs - 1) / kSortPairs;
  if (nb < 1 || nb > INT32_MAX / p.n_experts) throw std::invalid_argument("[lily] cuda moe_sort: pair count");
  const size_t smem = p.n_experts * sizeof(int);
  sort_count_kernel<<<static_cast<unsigned>(nb), kSortThreads, smem, st>>>(P, p.n_experts, top_idx, b.block_base);
  LILY_LAUNCH_CHECK();
  sort_plan_kernel<<<1, (p.n_experts + 31) / 32 * 32, 0, st>>>(static_cast<int>(nb), p.n_experts, tile_rows,
                                                              b.block_base, b.n_tiles, b.tile_expert, b.tile_row0,
                                                              b.tile_rows);
  LILY_LAUNCH_CHECK();
  sort_scatter_kernel<<<static_cast<unsigned>(nb), kSortThreads, smem, st>>>(
      P, p.n_experts, p.top_k, top_idx, top_w, b.block_base, b.pair_row, b.pair_id, b.pair_w);
  LILY_LAUNCH_CHECK();
}

void moe_experts(cudaStream_t st, const kp::MoeParams& p, const DLinear& gate, const DLinear& up, const DLinear& down,
                 const bf16* h, const int32_t* top_idx, const float* top_w, const SortBuffers& b, bf16* act, bf16* d,
                 int tile_rows, bool host_count) {
  const int64_t P = p.S * p.top_k;
  // Rows per expert tile from the mean rows per expert (or the ablation's); the wmma GEMM (the fallback for weights
  // the mma GEMM does not take) holds at most kGemmBM rows per tile.
  int tr = tile_rows > 0 ? tile_rows : pick_expert_tile(P, p.n_experts);
  if (!gemm_mma_supported(gate, &up, h, p.hidden) || !gemm_mma_supported(down, nullptr, act, p.inter))
    tr = std::min(tr, kGemmBM);
  moe_sort(st, p, top_idx, top_w, tr, b);
  int64_t tiles = grouped_max_tiles(P, p.n_experts, tr);  // grid bound; the count is on the device
  if (host_count) {
    int32_t n = 0;
    LILY_CUDA_CHECK(cudaMemcpyAsync(&n, b.n_tiles, sizeof(n), cudaMemcpyDeviceToHost, st));
    LILY_CUDA_CHECK(cudaStreamSynchronize(st));
    tiles = n;
  }
  const GroupMap g{b.n_tiles, b.tile_expert, b.tile_row0, b.tile_rows, b.pair_row, b.pair_id, b.pair_w, tiles};
  grouped_gate_up(st, gate, up, g, h, p.hidden, act, tr);
  grouped_down(st, down, g, act, d, tr);
}

void moe_combine(cudaStream_t st, const kp::MoeParams& p, const float* sh, const float* gate, const bf16* d, float* x) {
  const int64_t H = p.hidden;
  const int vec = H % 4 == 0 ? 4 : 1;  // float4 rows when the row length allows (every real model)
  const dim3 grid(static_cast<unsigned>((H / vec + 255) / 256), static_cast<unsigned>(std::min<int64_t>(p.S, 65535)));
  if (vec == 4) combine_kernel<4><<<grid, 256, 0, st>>>(p.S, H, p.top_k, sh, gate, d, x);
  else combine_kernel<1><<<grid, 256, 0, st>>>(p.S, H, p.top_k, sh, gate, d, x);
  LILY_LAUNCH_CHECK();
}

}  // namespace lily::cuda
