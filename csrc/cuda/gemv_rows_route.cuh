// The routing of the M-row decode GEMV's routed launches (gemv_rows.cu): each row's top-k experts and the distinct
// experts of all the rows' choices, which the launch streams once each.
#pragma once
#include "cuda/common.cuh"
#include "cuda/gemv_rows.cuh"

namespace lily::cuda::rows {

struct RouteArgs {
  int32_t M, E, top_k, norm_topk, route_from_idx;
  const float* rlogits;  // [M, E] (route_from_idx: unused)
  int32_t* top_idx;      // [M, top_k]: written by block 0, or read (route_from_idx)
  float* top_w;          // [M, top_k]: written by block 0 (route_from_idx: unused)
};

// A routed launch's choice (route_rows): the distinct experts of the rows' choices in ascending id, u = 0 .. U - 1,
// and for each the slots of each row that chose it (a bit per slot: a non-finite row chooses expert 0 in every slot).
struct Route {
  int32_t idx[kMaxRows][kMaxTopK];
  float w[kMaxRows][kMaxTopK];
  uint32_t bits[kMaxExperts / 32];  // the chosen experts
  int32_t before[kMaxExperts / 32];  // chosen experts below each word
  int32_t uexp[kMaxRows * kMaxTopK];
  uint16_t slots[kMaxRows * kMaxTopK][kMaxRows];
  int32_t U;
};

// The routing of a routed launch (after the PDL wait; every block computes it, block 0 writes it): warp m picks row
// m's top-k (route_topk_warp, one row's arithmetic whatever M is), then the union of the choices as a bitmap, its
// experts ranked by id (u), and each (u, row)'s slots.
__device__ inline void route_rows(const RouteArgs& g, Route& rt) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, k = g.top_k, words = (g.E + 31) / 32;
  for (int i = tid; i < words; i += blockDim.x) rt.bits[i] = 0u;
  for (int i = tid; i < g.M * k * kMaxRows; i += blockDim.x) rt.slots[i / kMaxRows][i % kMaxRows] = 0;
  if (g.route_from_idx) {
    for (int i = tid; i < g.M * k; i += blockDim.x) rt.idx[i / k][i % k] = g.top_idx[i];
  }
  for (int m = warp; m < g.M && !g.route_from_idx; m += blockDim.x >> 5) {
    route_topk_warp(g.rlogits + static_cast<int64_t>(m) * g.E, g.E, k, g.norm_topk != 0, rt.idx[m], rt.w[m], lane);
    __syncwarp();
    if (blockIdx.x == 0 && lane < k) g.top_idx[m * k + lane] = rt.idx[m][lane], g.top_w[m * k + lane] = rt.w[m][lane];
  }
  __syncthreads();
  for (int i = tid; i < g.M * k; i += blockDim.x) {
    const int e = rt.idx[i / k][i % k];
    atomicOr(&rt.bits[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix of the words' popcounts (at most 32 words)
    const int c = lane < words ? __popc(rt.bits[lane]) : 0;
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += t;
    }
    if (lane < words) rt.before[lane] = incl - c;
    if (lane == 31) rt.U = incl;
  }
  __syncthreads();
  for (int i = tid; i < g.M * k; i += blockDim.x) {
    const int m = i / k, j = i % k, e = rt.idx[m][j];
    const int u = rt.before[e >> 5] + __popc(rt.bits[e >> 5] & ((1u << (e & 31)) - 1u));
    rt.uexp[u] = e;
    atomicOr(reinterpret_cast<unsigned int*>(&rt.slots[u][m & ~1]), (1u << j) << (16 * (m & 1)));
  }
  __syncthreads();
}

}  // namespace lily::cuda::rows
