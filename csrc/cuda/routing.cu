#include "cuda/kernels.cuh"

namespace lily::cuda {
namespace {

constexpr int kMaxExpertsPerLane = 8;  // E <= 256

// One warp per token row: fp32 softmax over E, then k rounds of a warp argmax (ties -> lower index).
__global__ void route_kernel(kp::MoeParams p, const float* logits, int32_t* top_idx, float* top_w) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, E = p.n_experts, k = p.top_k;
  if (s >= p.S) return;
  const float* l = logits + s * E;
  float v[kMaxExpertsPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? l[e] : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float den = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    v[i] = lane + 32 * i < E ? expf(v[i] - mx) : 0.f;
    den += v[i];
  }
  den = warp_sum(den);
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) v[i] = lane + 32 * i < E ? v[i] / den : -1.f;
  float chosen = 0.f;
  for (int j = 0; j < k; ++j) {
    float bv = -2.f;
    int bi = 0;  // a non-finite row (every comparison false) picks expert 0, never an index past E
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i)
      if (v[i] > bv) bv = v[i], bi = lane + 32 * i;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i)
      if (lane + 32 * i == bi) v[i] = -1.f;
    if (bv < -1.5f) bv = __int_as_float(0x7fc00000);  // nothing beat the start value: NaN weight, NaN output
    if (lane == 0) top_idx[s * k + j] = bi, top_w[s * k + j] = bv;
    chosen += bv;
  }
  if (lane == 0 && p.norm_topk_prob)
    for (int j = 0; j < k; ++j) top_w[s * k + j] /= chosen;
}

// One block: histogram -> exclusive scan -> tile map (thread 0) -> scatter of pairs.
__global__ void sort_kernel(kp::MoeParams p, const int32_t* top_idx, const float* top_w, int tile_rows,
                            int32_t* pair_row, int32_t* pair_id, float* pair_w, int32_t* n_tiles,
                            int32_t* tile_expert, int32_t* tile_row0, int32_t* tile_rows_out) {
  extern __shared__ int sm[];
  const int E = p.n_experts, k = p.top_k;
  const int64_t P = p.S * k;
  int* counts = sm;
  int* fill = sm + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&counts[top_idx[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int off = 0, nt = 0;
    for (int e = 0; e < E; ++e) {
      fill[e] = off;
      for (int r = 0; r < counts[e]; r += tile_rows) {
        tile_expert[nt] = e;
        tile_row0[nt] = off + r;
        tile_rows_out[nt] = min(tile_rows, counts[e] - r);
        ++nt;
      }
      off += counts[e];
    }
    *n_tiles = nt;
  }
  __syncthreads();
  // Order inside an expert group is arbitrary: each pair's result depends only on its own row.
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) {
    const int pos = atomicAdd(&fill[top_idx[i]], 1);
    pair_row[pos] = static_cast<int32_t>(i / k);
    pair_id[pos] = static_cast<int32_t>(i);
    pair_w[pos] = top_w[i];
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
  if (p.n_experts > 32 * kMaxExpertsPerLane) throw std::invalid_argument("[lily] cuda moe_route: more than 256 experts");
  const int64_t threads = p.S * 32;
  route_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p, logits, top_idx, top_w);
  LILY_LAUNCH_CHECK();
}

void moe_sort(cudaStream_t st, const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows,
              int32_t* pair_row, int32_t* pair_id, float* pair_w, int32_t* n_tiles, int32_t* tile_expert,
              int32_t* tile_row0, int32_t* tile_rows_out) {
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
