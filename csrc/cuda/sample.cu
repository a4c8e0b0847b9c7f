// Device sampling (see sample.cuh for the semantics), three launches. Two grid passes over the 1 MB row (one
// block per kSpan entries): the processed logits and each span's max; then the weights against the row max,
// each span's sums and its candidates compacted in vocab order: with top-k (k <= kCandCap / blocks) the span's
// own top-k (every entry whose key is >= the span's k-th largest, found by radix selection in the block: a
// superset of the row's top-k, ties included), else the entries of weight >= kCandTau. One final block then finds
// the thresholds by radix selection on an order-preserving 32-bit key (8 bits per pass; top-k by counts, top-p
// by per-bin masses), on the candidates alone when they provably hold the kept set (top-k: always; top-p alone:
// the usual case for a language model, a few hundred tokens), else on the whole row; and draws. A single block
// reading the whole row is latency-bound (~20 GB/s, 0.2 ms on the H200 at V = 248K): the grid passes and the
// short candidate list are what make this cheap (a flat row, e.g. random weights or a high temperature, has
// most of its entries above kCandTau, so top-k takes the per-span selection). Top-k's kept set, when it fits the
// block (sample_select.cuh), then takes top-p, min-p and the draw in shared memory.
// Logits cluster in a few top key bits, so one shared histogram would serialise on one or two bins: each lane
// owns a column of the histogram (address bin * 32 + lane: no two lanes of a warp meet, the bank is the lane),
// summed per bin after the pass.
#include <cfloat>
#include <climits>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/sample.cuh"
#include "cuda/sample_select.cuh"

namespace lily::cuda::sample {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr size_t kHistBytes = kBins * 32 * (sizeof(uint32_t) + sizeof(float));

// Monotone map float -> uint32 (larger float, larger key); NaN maps to 0, below -inf.
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 0u;
  if (v == 0.f) return 0x80000000u;  // -0 and +0 are one value (ties at a cutoff are all kept)
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The weight of a processed logit relative to the row max (NaN weighs nothing). Every kernel uses this one
// formula, so block sums and the final block's sums agree exactly.
__device__ __forceinline__ float weight_of(float v, float m, float inv_t) {
  return v == v ? __expf((v - m) * inv_t) : 0.f;
}

// The scratch of Args::work: per-block partials of the grid passes, then the candidate lists.
struct Work {
  float* part_max;   // [nb] block max of x
  int32_t* part_arg; // [nb] its lowest index
  float* part_z;     // [nb] block sum of weights
  float* part_keep;  // [nb] block sum of weights >= min_p
  int32_t* part_cnt; // [nb] candidates of the block
  float* cand_val;   // [nb * kSpan] block b's candidates at b * kSpan, in vocab order
  int32_t* cand_idx;
  float* list_val;   // [kCandCap] all candidates in vocab order (the final block's list; L2-resident)
  int32_t* list_idx;
};

__host__ __device__ inline int blocks_for(int V) { return (V + kSpan - 1) / kSpan; }

__host__ __device__ inline Work carve(float* base, int V) {
  const int nb = blocks_for(V);
  Work w;
  w.part_max = base;
  w.part_arg = reinterpret_cast<int32_t*>(base + nb);
  w.part_z = base + 2 * nb;
  w.part_keep = base + 3 * nb;
  w.part_cnt = reinterpret_cast<int32_t*>(base + 4 * nb);
  w.cand_val = base + 5 * nb;
  w.cand_idx = reinterpret_cast<int32_t*>(base + 5 * nb + nb * kSpan);
  w.list_val = base + 5 * nb + 2 * nb * kSpan;
  w.list_idx = reinterpret_cast<int32_t*>(w.list_val + kCandCap);
  return w;
}

// Max (NaN ignored) with its lowest index over the block; the result in every thread. nw: warps in the block.
template <int kNw>
__device__ void block_argmax(float& v, int& i, float* sf, int* si) {
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  __syncthreads();
  if (l == 0) sf[w] = v, si[w] = i;
  __syncthreads();
  v = l < kNw ? sf[l] : -FLT_MAX;
  i = l < kNw ? si[l] : INT_MAX;
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
}

template <int kNw>
__device__ double block_sum(double v, double* sd) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  __syncthreads();
  if (l == 0) sd[w] = v;
  __syncthreads();
  v = l < kNw ? sd[l] : 0.0;
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- grid pass 1: processed logits of the block's span, the span's max -----------------------------------
__global__ void __launch_bounds__(kGridThreads) process_kernel(Args a) {
  __shared__ float sf[kGridThreads / 32];
  __shared__ int si[kGridThreads / 32];
  pdl_trigger();
  pdl_wait();  // the logits are the head's
  const Options o = *a.opt;
  const Work wk = carve(a.work, a.vocab);
  const int V = a.vocab, t = threadIdx.x, lo = blockIdx.x * kSpan, hi = min(V, lo + kSpan);
  float* x = a.x;
  for (int i = lo + t; i < hi; i += kGridThreads) x[i] = a.logits[i];
  __syncthreads();
  // bias before the penalties (the host sampler's order); each block applies the entries in its span
  for (int j = t; j < o.n_bias; j += kGridThreads) {
    const int id = a.bias_ids[j];
    if (id >= lo && id < hi) x[id] += a.bias_vals[j];
  }
  __syncthreads();
  const bool rep = o.repetition_penalty != 1.f, cnt = o.presence_penalty != 0.f || o.frequency_penalty != 0.f;
  float m = -FLT_MAX;
  int am = INT_MAX;
  for (int i = lo + t; i < hi; i += kGridThreads) {
    float v = x[i];
    if (rep && a.seen[i]) v = v > 0.f ? v / o.repetition_penalty : v * o.repetition_penalty;
    if (cnt) {
      const int c = a.counts[i];
      // the product and the sum rounded apart, as the host (NumPy) and the CPU twin do: nvcc would otherwise fuse
      // them into one FMA (-fmad=true), a processed value one rounding off the host's, and a tie at a cut broken
      if (c) v -= __fadd_rn(__fmul_rn(o.frequency_penalty, static_cast<float>(c)), o.presence_penalty);
    }
    if (rep || cnt) x[i] = v;
    if (v > m || (v == m && i < am)) m = v, am = i;  // NaN never compares greater
  }
  block_argmax<kGridThreads / 32>(m, am, sf, si);
  if (t == 0) wk.part_max[blockIdx.x] = m, wk.part_arg[blockIdx.x] = am;
}

// ---- grid pass 2: weights against the row max; block sums; the span's candidates, compacted in order -------
// The key of the block's k-th largest entry of x[lo, hi) (every thread gets it; 0 when the span holds at most k
// entries, so all are kept): radix selection, 8 bits per pass from the top, a 256-bin shared histogram whose adds are
// aggregated per warp (logits share their top key bits: plain atomics would serialise on one bin).
__device__ uint32_t span_kth_key(const float* x, int lo, int hi, int k) {
  constexpr int kPer = kSpan / kGridThreads;
  __shared__ uint32_t hist[256];
  __shared__ int scan_ws[33];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int t = threadIdx.x, lane = t % 32;
  if (hi - lo <= k) return 0u;
  uint32_t key[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = lo + t + j * kGridThreads;
    key[j] = i < hi ? order_key(x[i]) : 0u;
  }
  if (t == 0) s_prefix = 0u, s_need = k;
  uint32_t mask = 0u;
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[t] = 0u;  // kGridThreads == 256 bins
    __syncthreads();
    const uint32_t prefix = s_prefix;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const bool in = lo + t + j * kGridThreads < hi && (key[j] & mask) == prefix;
      const uint32_t bin = in ? (key[j] >> shift) & 255u : 256u + lane;  // out-of-prefix lanes match nobody
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    // suffix sums over the bins (thread t owns bin 255 - t): S(b) = entries of the prefix in bins >= b
    const int b = 255 - t;
    const uint32_t c = hist[b];
    const uint32_t S = static_cast<uint32_t>(block_exclusive_scan(static_cast<int>(c), scan_ws, nullptr)) + c;
    const uint32_t need = static_cast<uint32_t>(s_need);
    __syncthreads();  // every thread has read s_need
    if (S >= need && S - c < need) {  // the bin holding the need-th largest: unique (an empty bin has S = S - c)
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_need = static_cast<int>(need - (S - c));
    }
    mask |= 255u << shift;
    __syncthreads();
  }
  return s_prefix;
}

__global__ void __launch_bounds__(kGridThreads) weigh_kernel(Args a) {
  constexpr int kNw = kGridThreads / 32;
  __shared__ float sf[kNw];
  __shared__ int si[kNw];
  __shared__ double sd[kNw];
  __shared__ int warp_n[kNw];
  pdl_trigger();
  pdl_wait();
  const Options o = *a.opt;
  if (o.greedy) return;  // the argmax needs no weights
  const Work wk = carve(a.work, a.vocab);
  const int V = a.vocab, t = threadIdx.x, lane = t % 32, wid = t / 32, nb = blocks_for(V);
  const int lo = blockIdx.x * kSpan, hi = min(V, lo + kSpan);
  float m = -FLT_MAX;
  int unused = 0;
  for (int j = t; j < nb; j += kGridThreads) m = fmaxf(m, wk.part_max[j]);
  block_argmax<kNw>(m, unused, sf, si);
  // top-k: the span's own top k are the candidates (their union over the spans holds the row's top k, ties too)
  const bool span_topk = o.top_k > 0 && o.top_k < V && static_cast<int64_t>(o.top_k) * nb <= kCandCap;
  const uint32_t kth = span_topk ? span_kth_key(a.x, lo, hi, o.top_k) : 0u;
  const float it = o.inv_temperature;
  double z = 0.0, keep = 0.0;
  int base = 0;  // candidates written so far
  for (int i0 = lo; i0 < hi; i0 += kGridThreads) {
    const int i = i0 + t;
    const float v = i < hi ? a.x[i] : -INFINITY;
    const float w = i < hi && m > -FLT_MAX ? weight_of(v, m, it) : 0.f;
    z += w;
    keep += w >= o.min_p ? w : 0.f;
    const bool cand = span_topk ? i < hi && order_key(v) >= kth : w >= kCandTau;
    const unsigned bal = __ballot_sync(0xffffffffu, cand);
    if (lane == 0) warp_n[wid] = __popc(bal);
    __syncthreads();
    int before = base, total = 0;
    for (int j = 0; j < kNw; ++j) {
      if (j < wid) before += warp_n[j];
      total += warp_n[j];
    }
    if (cand) {
      const int at = lo + before + __popc(bal & ((1u << lane) - 1u));
      wk.cand_val[at] = v;
      wk.cand_idx[at] = i;
    }
    base += total;
    __syncthreads();
  }
  z = block_sum<kNw>(z, sd);
  keep = block_sum<kNw>(keep, sd);
  if (t == 0) {
    wk.part_z[blockIdx.x] = static_cast<float>(z);
    wk.part_keep[blockIdx.x] = static_cast<float>(keep);
    wk.part_cnt[blockIdx.x] = base;
  }
}

// ---- the final block: thresholds on the candidates (or the whole row), then the draw -----------------------
struct Smem {
  uint32_t cnt[kBins];   // per-bin totals of the lane columns
  float mass[kBins];
  float wf[kWarps];
  int wi[kWarps];
  double wd[kWarps];
  int offs[kThreads];    // candidate list: where block j's candidates start
  int scan[kWarps + 1];  // block_exclusive_scan's
  uint32_t prefix;       // radix selection: key bits decided so far
  float above;           // top-p: kept mass strictly above the current prefix
  int need;              // top-k: rank still to find inside the current prefix
  int chosen;
  float remainder;
  int token;
};

// Lane-column histograms: hc/hm[bin * 32 + lane]; hm null: counts alone (top-k).
__device__ void hist_clear(uint32_t* hc, float* hm) {
  for (int j = threadIdx.x; j < kBins * 32; j += kThreads) {
    hc[j] = 0u;
    if (hm) hm[j] = 0.f;
  }
  __syncthreads();
}

// s.cnt / s.mass [bin] = sums of the 32 lane columns (each bin's thread starts at another column: no bank
// conflicts between the bins' threads).
__device__ void hist_reduce(Smem& s, const uint32_t* hc, const float* hm) {
  __syncthreads();
  if (threadIdx.x < kBins) {
    const int b = threadIdx.x;
    uint32_t c = 0;
    float m = 0.f;
    for (int j = 0; j < 32; ++j) {
      const int l = (j + b) & 31;
      c += hc[b * 32 + l];
      if (hm) m += hm[b * 32 + l];
    }
    s.cnt[b] = c;
    s.mass[b] = m;
  }
  __syncthreads();
}

// One warp walks positions [lo, hi) of `vals` in order: the first position whose inclusive cumulative kept
// weight exceeds rem; past the end (rounding), the last kept position; -1 when none is kept.
template <class KeptW>
__device__ int warp_walk(int lo, int hi, float rem, KeptW kept_w) {
  const int l = threadIdx.x % 32;
  float run = 0.f;
  int last = -1, found = -1;
  for (int base = lo; base < hi && found < 0; base += 32) {
    const float e = base + l < hi ? kept_w(base + l) : 0.f;
    float inc = e;
    for (int off = 1; off < 32; off <<= 1) {
      const float n = __shfl_up_sync(0xffffffffu, inc, off);
      if (l >= off) inc += n;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, e > 0.f && run + inc > rem);
    const unsigned any = __ballot_sync(0xffffffffu, e > 0.f);
    if (hit) found = base + __ffs(hit) - 1;
    else if (any) last = base + 31 - __clz(any);
    run += __shfl_sync(0xffffffffu, inc, 31);
  }
  return found >= 0 ? found : last;
}

// Thread 0: among `n` weights (in order), the first whose cumulative sum passes u * total; rounding past the
// end picks the last non-zero one with its remainder past its end. Sets s.chosen / s.remainder.
template <class WeightAt>
__device__ void pick_segment(Smem& s, int n, float u, WeightAt weight_at) {
  double total = 0.0;
  for (int j = 0; j < n; ++j) total += weight_at(j);
  const double target = static_cast<double>(u) * total;
  double before = 0.0, before_c = 0.0;
  int c = -1;
  for (int j = 0; j < n; ++j) {
    const double wj = weight_at(j);
    if (wj <= 0.0) continue;
    c = j;
    before_c = before;
    if (before + wj > target) break;
    before += wj;
  }
  s.chosen = c;
  s.remainder = static_cast<float>(target - before_c);
}

__global__ void __launch_bounds__(kThreads, 1) select_kernel(Args a) {
  __shared__ Smem s;
  __shared__ kept::Smem ks;
  extern __shared__ uint32_t dyn[];
  uint32_t* hc = dyn;
  float* hm = reinterpret_cast<float*>(dyn + kBins * 32);
  // No early trigger: with one (check_sample's loop of draws on the H200, 9ec5e77) the one-block whole-row path
  // (top-p alone on a flat row) timed 408 us against 137 before the PDL launches, while every other mode got
  // faster; the suspect is the next draw's grids launched early and left resident beside this block for its
  // whole run. Not yet re-measured without it. (In the decode step nothing follows the draw inside the graph.)
  pdl_wait();
  const Options o = *a.opt;
  const Work wk = carve(a.work, a.vocab);
  float* list_val = wk.list_val;
  int32_t* list_idx = wk.list_idx;
  const int V = a.vocab, t = threadIdx.x, lane = t % 32, nb = blocks_for(V);

  float m = -FLT_MAX;
  int am = INT_MAX;
  for (int j = t; j < nb; j += kThreads)
    if (wk.part_max[j] > m || (wk.part_max[j] == m && wk.part_arg[j] < am)) m = wk.part_max[j], am = wk.part_arg[j];
  block_argmax<kWarps>(m, am, s.wf, s.wi);
  if (am >= V) am = 0;  // every entry NaN or -inf: token 0, as argmax of such a row would

  int token = am;
  if (!o.greedy && m > -FLT_MAX) {
    const float it = o.inv_temperature, min_w = o.min_p;
    auto weight = [&](float v) { return weight_of(v, m, it); };
    const bool topk = o.top_k > 0 && o.top_k < V, topp = o.top_p < 1.f;
    if (!topk && !topp) {
      // every token with weight >= min_p is kept: the block sums pick the span, one warp walks it
      if (t == 0) {
        pick_segment(s, nb, *a.uniform, [&](int j) { return static_cast<double>(wk.part_keep[j]); });
        s.token = am;
      }
      __syncthreads();
      if (t < 32 && s.chosen >= 0) {
        const int lo = s.chosen * kSpan, hi = min(V, lo + kSpan);
        const int pos = warp_walk(lo, hi, s.remainder, [&](int i) {
          const float e = weight(a.x[i]);
          return e >= min_w ? e : 0.f;
        });
        if (t == 0 && pos >= 0) s.token = pos;
      }
      __syncthreads();
      token = s.token;
    } else {
      // The candidates (weight >= kCandTau) hold the kept set when there are at most kCandCap of them and they
      // hold top-k's k tokens, or (top-p alone) top_p of the row's mass: thresholds then come from them alone.
      int c_total = 0;
      {
        __syncthreads();  // s.wi was block_argmax's
        const int c = t < nb ? wk.part_cnt[t] : 0;
        // exclusive scan of the blocks' counts (nb <= kThreads)
        int inc = c;
        for (int off = 1; off < 32; off <<= 1) {
          const int n = __shfl_up_sync(0xffffffffu, inc, off);
          if (lane >= off) inc += n;
        }
        if (lane == 31) s.wi[t / 32] = inc;
        __syncthreads();
        int warp_before = 0;
        for (int j = 0; j < t / 32; ++j) warp_before += s.wi[j];
        if (t < nb) s.offs[t] = warp_before + inc - c;
        for (int j = 0; j < kWarps; ++j) c_total += s.wi[j];
        __syncthreads();
      }
      bool use_list = c_total <= kCandCap && (!topk || c_total >= o.top_k);
      double z_all = 0.0;
      if (use_list) {
        // warp w gathers spans w, w + 32, ...: a loop over the spans in which all threads wait on each span's count
        // was a chain of ~120 L2 round trips (top-k on the H200 timed ~100 us against 23 for plain temperature)
        for (int j = t / 32; j < nb; j += kWarps) {
          const int c = wk.part_cnt[j], off = s.offs[j];
          for (int q = lane; q < c; q += 32) {
            list_val[off + q] = wk.cand_val[j * kSpan + q];
            list_idx[off + q] = wk.cand_idx[j * kSpan + q];
          }
        }
        __syncthreads();  // the list (global memory) is read by other threads below
        double zp = 0.0;
        for (int j = t; j < nb; j += kThreads) zp += wk.part_z[j];
        z_all = block_sum<kWarps>(zp, s.wd);
        if (topp && !topk) {
          double lm = 0.0;
          for (int q = t; q < c_total; q += kThreads) lm += weight(list_val[q]);
          lm = block_sum<kWarps>(lm, s.wd);
          use_list = lm >= o.top_p * z_all * (1.0 + 1e-4);
        }
        __syncthreads();
      }
      const int n = use_list ? c_total : V;
      const float* vals = use_list ? list_val : a.x;

      // top-k: the key of the k-th largest value, 8 bits per pass
      uint32_t kk = 0;  // keep keys >= kk
      if (o.top_k > 0 && o.top_k < n) {
        if (t == 0) s.prefix = 0, s.need = o.top_k;
        uint32_t mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
          hist_clear(hc, nullptr);
          const uint32_t prefix = s.prefix;
#pragma unroll 4
          for (int i = t; i < n; i += kThreads) {
            const uint32_t key = order_key(vals[i]);
            if ((key & mask) == prefix) atomicAdd(&hc[((key >> shift) & 255u) * 32 + lane], 1u);
          }
          hist_reduce(s, hc, nullptr);
          // the bin holding the need-th largest (unique: an empty bin has S = S - c), S = entries in bins >= b;
          // a scan, not thread 0 walking down up to 256 bins
          const int need = s.need, b = kBins - 1 - t;
          const int c = t < kBins ? static_cast<int>(s.cnt[b]) : 0;
          const int S = block_exclusive_scan(c, s.scan, nullptr) + c;
          if (t < kBins && S >= need && S - c < need) {
            s.need = need - (S - c);
            s.prefix = prefix | (static_cast<uint32_t>(b) << shift);
          }
          mask |= 255u << shift;
          __syncthreads();
        }
        kk = s.prefix;
      }

      // Top-k keeps about k entries (more only with ties at the k-th value): gathered into shared memory, top-p,
      // min-p and the draw run on them alone (sample_select.cuh). The whole set's path below takes the rest: no
      // top-k, or more than kThreads kept.
      double z_kept = 0.0;  // top-k and top-p: the kept mass
      int n_kept = INT_MAX;
      if (topk) {
        n_kept = kept::gather(
            ks, vals, n, kk, [](float v) { return order_key(v); }, weight,
            [&](int i) { return use_list ? list_idx[i] : i; }, z_kept);
        if (topp) z_kept = block_sum<kWarps>(z_kept, s.wd);
      }
      if (n_kept <= kThreads) {
        token = kept::draw(ks, n_kept, topp, o.top_p * z_kept, min_w, *a.uniform, am);  // target in double
      } else {
        // top-p over the kept: the smallest key whose strictly-greater kept mass is < top_p * kept mass (the
        // row's mass when top-k is off, which the candidate list alone does not hold)
        uint32_t kp = 0;
        if (topp) {
          double z = z_kept;  // top-k: kept::gather's, summed as this loop would
          if (use_list && !topk) {
            z = z_all;
          } else if (!topk) {
#pragma unroll 4
            for (int i = t; i < n; i += kThreads)
              if (order_key(vals[i]) >= kk) z += weight(vals[i]);
            z = block_sum<kWarps>(z, s.wd);
          }
          const float target = static_cast<float>(o.top_p * z);
          if (t == 0) s.prefix = 0, s.above = 0.f;
          uint32_t mask = 0;
          for (int shift = 24; shift >= 0; shift -= 8) {
            hist_clear(hc, hm);
            const uint32_t prefix = s.prefix;
#pragma unroll 4
            for (int i = t; i < n; i += kThreads) {
              const float v = vals[i];
              const uint32_t key = order_key(v);
              if (key >= kk && (key & mask) == prefix) {
                const uint32_t j = ((key >> shift) & 255u) * 32 + lane;
                atomicAdd(&hc[j], 1u);
                atomicAdd(&hm[j], weight(v));
              }
            }
            hist_reduce(s, hc, hm);
            if (t == 0) {
              // walking down, the mass above bin b only grows: the answer is the last non-empty bin reached
              // while it is still below the target (the first non-empty bin always is: above < target)
              float acc = s.above, at = s.above;
              int chosen = -1;
              for (int b = 255; b >= 0; --b) {
                if (!s.cnt[b]) continue;
                if (!(acc < target) && chosen >= 0) break;
                chosen = b;
                at = acc;
                acc += s.mass[b];
              }
              s.above = at;
              s.prefix = prefix | (static_cast<uint32_t>(chosen < 0 ? 0 : chosen) << shift);
            }
            mask |= 255u << shift;
            __syncthreads();
          }
          kp = s.prefix;
        }
        const uint32_t keep_key = kk > kp ? kk : kp;

        // draw: warp w owns a contiguous span of positions (lanes stride by one, so loads coalesce)
        const int span = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
        const int w = t / 32, lo = min(n, w * span), hi = min(n, lo + span);
        auto kept_w = [&](int i) {
          const float v = vals[i];
          if (order_key(v) < keep_key) return 0.f;
          const float e = weight(v);
          return e >= min_w ? e : 0.f;
        };
        double part = 0.0;
#pragma unroll 4
        for (int i = lo + lane; i < hi; i += 32) part += kept_w(i);
        for (int off = 16; off; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
        __syncthreads();
        if (lane == 0) s.wd[w] = part;
        __syncthreads();
        if (t == 0) {
          pick_segment(s, kWarps, *a.uniform, [&](int j) { return s.wd[j]; });
          s.token = am;
        }
        __syncthreads();
        if (w == s.chosen) {
          const int pos = warp_walk(lo, hi, s.remainder, kept_w);
          if (lane == 0 && pos >= 0) s.token = use_list ? list_idx[pos] : pos;
        }
        __syncthreads();
        token = s.token;
      }
    }
  }
  if (t == 0) {
    *a.token = token;
    a.seen[token] = 1;
    a.counts[token] += 1;
  }
}

// One block a row: the head's block keys (gemv's argmax_key: order-preserving logit, then -row; rows: [n, gridDim.x])
// -> the row's next token.
__global__ void argmax_kernel(const unsigned long long* amax, int n, int32_t* token) {
  __shared__ unsigned long long red[32];
  pdl_wait();
  const int rows = gridDim.x;
  amax += blockIdx.x, token += blockIdx.x;
  unsigned long long m = 0ull;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = max(m, amax[static_cast<int64_t>(i) * rows]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = max(m, red[w]);
    *token = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(m & 0xFFFFFFFFull));
  }
}

}  // namespace

size_t workspace_floats(int V) {
  const int nb = blocks_for(V);
  return static_cast<size_t>(5) * nb + static_cast<size_t>(2) * nb * kSpan + static_cast<size_t>(2) * kCandCap;
}

void launch(cudaStream_t st, const Args& a) {
  static const bool attr = [] {  // more than the default 48 KB of dynamic shared memory
    LILY_CUDA_CHECK(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kHistBytes)));
    return true;
  }();
  (void)attr;
  if (blocks_for(a.vocab) > kThreads)
    throw std::invalid_argument("[lily] device sampler: vocab " + std::to_string(a.vocab) + " exceeds " +
                                std::to_string(kThreads * kSpan));
  // PDL launches (common.cuh): each kernel is resident and waiting when its predecessor ends
  const dim3 grid(static_cast<unsigned>(blocks_for(a.vocab)));
  launch_pdl(process_kernel, grid, dim3(kGridThreads), 0, st, a);
  launch_pdl(weigh_kernel, grid, dim3(kGridThreads), 0, st, a);
  launch_pdl(select_kernel, dim3(1), dim3(kThreads), kHistBytes, st, a);
}

DeviceSampler::~DeviceSampler() {
  for (void* p : {static_cast<void*>(opt_), static_cast<void*>(bias_ids_), static_cast<void*>(bias_vals_),
                  static_cast<void*>(seen_), static_cast<void*>(counts_), static_cast<void*>(x_),
                  static_cast<void*>(work_)})
    if (p) cudaFree(p);
}

Options options_of(const SampleOptions& so) {
  Options opt;
  opt.greedy = is_greedy(so);
  opt.inv_temperature = inverse_temperature(so);
  opt.top_k = so.top_k;
  opt.top_p = so.top_p;
  opt.min_p = so.min_p;
  opt.repetition_penalty = so.repetition_penalty;
  opt.presence_penalty = so.presence_penalty;
  opt.frequency_penalty = so.frequency_penalty;
  opt.n_bias = static_cast<int32_t>(so.bias_ids.size());
  return opt;
}

void DeviceSampler::begin(cudaStream_t st, const SampleOptions& so, int32_t V) {
  ready_ = false;
  const Options opt = options_of(so);
  const int32_t n_bias = opt.n_bias;
  const int32_t* bias_ids = so.bias_ids.data();
  const float* bias_vals = so.bias_vals.data();
  const uint8_t* seen = so.seen.empty() ? nullptr : so.seen.data();
  const int32_t* counts = so.counts.empty() ? nullptr : so.counts.data();
  if (V != V_) {
    for (void** p : {reinterpret_cast<void**>(&seen_), reinterpret_cast<void**>(&counts_),
                     reinterpret_cast<void**>(&x_)})
      if (*p) cudaFree(*p), *p = nullptr;
    LILY_CUDA_CHECK(cudaMalloc(&seen_, V));
    LILY_CUDA_CHECK(cudaMalloc(&counts_, static_cast<size_t>(V) * sizeof(int32_t)));
    LILY_CUDA_CHECK(cudaMalloc(&x_, static_cast<size_t>(V) * sizeof(float)));
    if (work_) cudaFree(work_), work_ = nullptr;
    LILY_CUDA_CHECK(cudaMalloc(&work_, workspace_floats(V) * sizeof(float)));
    V_ = V;
  }
  if (!opt_) LILY_CUDA_CHECK(cudaMalloc(&opt_, sizeof(Options)));
  if (n_bias > bias_cap_) {
    if (bias_ids_) cudaFree(bias_ids_), bias_ids_ = nullptr;
    if (bias_vals_) cudaFree(bias_vals_), bias_vals_ = nullptr;
    LILY_CUDA_CHECK(cudaMalloc(&bias_ids_, static_cast<size_t>(n_bias) * sizeof(int32_t)));
    LILY_CUDA_CHECK(cudaMalloc(&bias_vals_, static_cast<size_t>(n_bias) * sizeof(float)));
    bias_cap_ = n_bias;
  }
  // On the backend's stream (a non-blocking stream does not order against the legacy default stream), then a
  // wait: once per generation, and the caller's pageable vectors may go away when this returns.
  LILY_CUDA_CHECK(cudaMemcpyAsync(opt_, &opt, sizeof(Options), cudaMemcpyHostToDevice, st));
  if (n_bias) {
    LILY_CUDA_CHECK(cudaMemcpyAsync(bias_ids_, bias_ids, n_bias * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    LILY_CUDA_CHECK(cudaMemcpyAsync(bias_vals_, bias_vals, n_bias * sizeof(float), cudaMemcpyHostToDevice, st));
  }
  if (seen) LILY_CUDA_CHECK(cudaMemcpyAsync(seen_, seen, V, cudaMemcpyHostToDevice, st));
  else LILY_CUDA_CHECK(cudaMemsetAsync(seen_, 0, V, st));
  if (counts) LILY_CUDA_CHECK(cudaMemcpyAsync(counts_, counts, V * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  else LILY_CUDA_CHECK(cudaMemsetAsync(counts_, 0, V * sizeof(int32_t), st));
  LILY_CUDA_CHECK(cudaStreamSynchronize(st));
  ready_ = true;
}

void DeviceSampler::draw(cudaStream_t st, const float* logits, const float* uniform, int32_t* token) {
  Args a;
  a.logits = logits;
  a.x = x_;
  a.work = work_;
  a.opt = opt_;
  a.bias_ids = bias_ids_;
  a.bias_vals = bias_vals_;
  a.seen = seen_;
  a.counts = counts_;
  a.uniform = uniform;
  a.token = token;
  a.vocab = V_;
  launch(st, a);
}

void argmax_from_block_keys(cudaStream_t st, const unsigned long long* amax, int n, int32_t* token, int rows) {
  launch_pdl(argmax_kernel, dim3(rows), dim3(1024), 0, st, amax, n, token);
}

}  // namespace lily::cuda::sample
