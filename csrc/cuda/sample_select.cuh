// The device sampler's final block (sample.cu) on top-k's kept set once it is small: top-k keeps about k entries
// (more only with ties at the k-th value), so when they fit the block's kThreads they are gathered into shared
// memory in vocab order and top-p, min-p and the draw run on them alone, where the radix top-p and the draw read
// the whole candidate list (~6K entries at V = 248K, k = 50) four and one more times (the H200 timed top-k 50 +
// top-p 0.9 + min-p + penalties at 43 us this way, 90 before). Semantics: sample.cuh.
#pragma once
#include <climits>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/sample.cuh"

namespace lily::cuda::sample::kept {

constexpr int kWarps = kThreads / 32;

struct KeyWeight {
  uint32_t key;  // the order-preserving key of the value
  float w;       // its weight
};

// Shared memory of one block of kThreads.
struct Smem {
  KeyWeight e[kThreads];               // the kept set, vocab order
  int32_t token[kThreads];             // its vocab indices
  int chunk_n[2][kWarps];              // gather: per-warp counts (two: a chunk's reads overlap the next's writes)
  double wd[kWarps];
  uint32_t kp;
  int first, last;
};

// The entries of key >= kk among vals[0, n) into s.e / s.token in vocab order, the first kThreads of them; returns
// how many there are (above kThreads, s is incomplete). zp: this thread's share of their mass, positions t,
// t + kThreads, ... added in turn (the radix top-p's loop, so one block_sum gives both paths one target).
template <class KeyOf, class Weight, class TokenOf>
__device__ int gather(Smem& s, const float* vals, int n, uint32_t kk, KeyOf key_of, Weight weight, TokenOf token_of,
                      double& zp) {
  constexpr int kBatch = 4;  // chunks loaded ahead: one L2 round trip per batch, not per chunk
  const int t = threadIdx.x, lane = t % 32, w = t / 32;
  int count = 0, parity = 0;
  zp = 0.0;
  for (int b0 = 0; b0 < n; b0 += kBatch * kThreads) {
    float v[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int i = b0 + q * kThreads + t;
      v[q] = i < n ? vals[i] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      if (b0 + q * kThreads >= n) break;  // block-uniform
      const int i = b0 + q * kThreads + t;
      const uint32_t key = key_of(v[q]);
      const bool in = i < n && key >= kk;
      const float e = in ? weight(v[q]) : 0.f;
      if (in) zp += e;
      const unsigned bal = __ballot_sync(0xffffffffu, in);
      if (lane == 0) s.chunk_n[parity][w] = __popc(bal);
      __syncthreads();
      const int c = s.chunk_n[parity][lane];
      int inc = c;
      for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc += o;
      }
      const int at = count + __shfl_sync(0xffffffffu, inc - c, w) + __popc(bal & ((1u << lane) - 1u));
      if (in && at < kThreads) s.e[at] = KeyWeight{key, e}, s.token[at] = token_of(i);
      count += __shfl_sync(0xffffffffu, inc, 31);
      parity ^= 1;
    }
  }
  __syncthreads();
  return count;
}

// Inclusive prefix sum of v over the block in thread order; total: the block's sum, in every thread.
__device__ inline double block_inclusive_sum(double v, double* sd, double& total) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  for (int off = 1; off < 32; off <<= 1) {
    const double q = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += q;
  }
  __syncthreads();  // sd's previous readers are done
  if (lane == 31) sd[w] = v;
  __syncthreads();
  double before = 0.0;
  total = 0.0;
  for (int j = 0; j < kWarps; ++j) before += j < w ? sd[j] : 0.0, total += sd[j];
  return before + v;
}

// Top-p on the gathered set (ns <= kThreads): the smallest key whose strictly-greater mass is below the target, and
// the largest key always (the radix walk's rule: its first non-empty bin is always taken). Each entry sums the mass
// above its own key over the whole set: ns^2 pairs, one broadcast shared load each; on the H200 ~0.5 us at ns ~ 50
// (k = 50) and 20 at 1000 (heavy ties), where a bitonic sort and a prefix sum timed 3.3 and 12 (k ~ 50 is the common
// case). The mass is summed 8 weights in float, then in double (a double add per pair timed 41 us at 1000): within
// ~1e-6 of exact, against the radix bins' float sums in any order (float atomics), so only a target within rounding
// of a key's mass can go the other way.
__device__ inline uint32_t top_p_key(Smem& s, int ns, double target) {
  const int t = threadIdx.x;
  const int n8 = (ns + 7) / 8 * 8;
  if (t == 0) s.kp = 0xFFFFFFFFu;
  if (t >= ns && t < n8) s.e[t] = KeyWeight{0u, 0.f};  // padding: above no key
  __syncthreads();
  uint32_t pass = 0xFFFFFFFFu;
  if (t < ns) {
    const uint32_t me = s.e[t].key;
    double above = 0.0;
    bool top = true;
    for (int j0 = 0; j0 < n8; j0 += 8) {
      float part = 0.f;
#pragma unroll
      for (int j = j0; j < j0 + 8; ++j) {
        const KeyWeight o = s.e[j];
        if (o.key > me) part += o.w, top = false;
      }
      above += part;
    }
    if (top || above < target) pass = me;
  }
  const uint32_t lowest = __reduce_min_sync(0xffffffffu, pass);
  if (t % 32 == 0) atomicMin(&s.kp, lowest);
  __syncthreads();
  return s.kp;
}

// Top-p (when topp; target = top_p * the kept mass, in double as the host's, not rounded to float), min-p and the
// draw on the gathered set (ns <= kThreads, entry i on thread i): the first kept entry (vocab order) whose inclusive
// cumulative weight exceeds u * total (double sums); past the end (rounding), the last kept one; none_token when no
// kept weight is positive (NaN weights count as none: a T whose float 1/T overflows leaves the argmax).
__device__ inline int draw(Smem& s, int ns, bool topp, double target, float min_w, float u, int none_token) {
  const uint32_t kp = topp ? top_p_key(s, ns, target) : 0u;
  const int t = threadIdx.x, lane = t % 32, w = t / 32;
  if (t == 0) s.first = INT_MAX, s.last = -1;
  float e = 0.f;
  if (t < ns && s.e[t].key >= kp) {
    e = s.e[t].w;
    if (!(e >= min_w)) e = 0.f;
  }
  double total;
  const double cum = block_inclusive_sum(e, s.wd, total);
  const double at = static_cast<double>(u) * total;
  const unsigned hit = __ballot_sync(0xffffffffu, e > 0.f && cum > at);
  const unsigned any = __ballot_sync(0xffffffffu, e > 0.f);
  if (lane == 0 && hit) atomicMin(&s.first, w * 32 + __ffs(hit) - 1);
  if (lane == 0 && any) atomicMax(&s.last, w * 32 + 31 - __clz(any));
  __syncthreads();
  const int pos = s.first != INT_MAX ? s.first : s.last;
  return pos >= 0 ? s.token[pos] : none_token;
}

}  // namespace lily::cuda::sample::kept
