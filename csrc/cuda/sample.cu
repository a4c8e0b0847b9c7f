// Device sampling (see sample.cuh for the semantics). One block: the row is 1 MB at full vocabulary and stays in
// L2 after the head wrote it, so ~11 block-wide passes cost tens of microseconds, against ~0.3-0.8 ms for the
// copy to the host plus a NumPy sampler. Thresholds are found by radix selection on an order-preserving
// 32-bit key of x (8 bits per pass), never by sorting: top-k selects the k-th largest key by counts, top-p
// the smallest key whose strictly-greater mass is below top_p by per-bin masses. Logits cluster in a few top
// bits, so a shared histogram would serialise on one or two bins; each lane owns its own column of the
// histogram (address bin * 32 + lane: no two lanes of a warp meet, and the bank is the lane), summed per bin
// after the pass.
#include <cfloat>

#include "cuda/common.cuh"
#include "cuda/sample.cuh"

namespace lily::cuda::sample {
namespace {

constexpr int kWarps = kThreads / 32;

// Monotone map float -> uint32 (larger float, larger key); NaN maps to 0, below -inf.
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 0u;
  if (v == 0.f) return 0x80000000u;  // -0 and +0 are one value (ties at a cutoff are all kept)
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

constexpr int kBins = 256;
constexpr size_t kHistBytes = kBins * 32 * (sizeof(uint32_t) + sizeof(float));  // dynamic shared memory

struct Smem {
  uint32_t cnt[kBins];   // per-bin totals of the lane columns
  float mass[kBins];
  float wf[kWarps];
  int wi[kWarps];
  double wd[kWarps];
  uint32_t prefix;   // radix selection: key bits decided so far
  float above;       // top-p: kept mass strictly above the current prefix
  int need;          // top-k: rank still to find inside the current prefix
  int chosen_warp;
  float remainder;
  int token;
};

// Max of x (NaN ignored) and its lowest index, over the block; result in every thread.
__device__ void block_argmax(Smem& s, float v, int i, float& m, int& am) {
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  if (l == 0) s.wf[w] = v, s.wi[w] = i;
  __syncthreads();
  v = s.wf[l];
  i = s.wi[l];
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  m = v;
  am = i;
  __syncthreads();
}

__device__ double block_sum(Smem& s, double v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  if (l == 0) s.wd[w] = v;
  __syncthreads();
  v = s.wd[l];
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  return v;
}

// Lane-column histograms in dynamic shared memory: hc/hm[bin * 32 + lane].
__device__ void hist_clear(uint32_t* hc, float* hm) {
  for (int j = threadIdx.x; j < kBins * 32; j += kThreads) hc[j] = 0u, hm[j] = 0.f;
  __syncthreads();
}

// s.cnt / s.mass [bin] = sums of the 32 lane columns; each thread of a bin's group starts at another column
// so that the 256 bins' threads read 32 different banks.
__device__ void hist_reduce(Smem& s, const uint32_t* hc, const float* hm) {
  __syncthreads();
  if (threadIdx.x < kBins) {
    const int b = threadIdx.x;
    uint32_t c = 0;
    float m = 0.f;
    for (int j = 0; j < 32; ++j) {
      const int l = (j + b) & 31;
      c += hc[b * 32 + l];
      m += hm[b * 32 + l];
    }
    s.cnt[b] = c;
    s.mass[b] = m;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) sample_kernel(Args a) {
  __shared__ Smem s;
  extern __shared__ uint32_t hist[];
  uint32_t* hc = hist;
  float* hm = reinterpret_cast<float*>(hist + kBins * 32);
  const int lane = threadIdx.x % 32;
  const Options o = *a.opt;
  const int V = a.vocab, t = threadIdx.x;
  float* x = a.x;

  // 1. processed logits: bias first (sparse), then the penalties, as the host sampler orders them
#pragma unroll 4
  for (int i = t; i < V; i += kThreads) x[i] = a.logits[i];
  __syncthreads();
  for (int j = t; j < o.n_bias; j += kThreads) x[a.bias_ids[j]] += a.bias_vals[j];
  __syncthreads();
  const bool rep = o.repetition_penalty != 1.f, cnt = o.presence_penalty != 0.f || o.frequency_penalty != 0.f;
  float m = -FLT_MAX;
  int am = V;
#pragma unroll 4
  for (int i = t; i < V; i += kThreads) {
    float v = x[i];
    if (rep && a.seen[i]) v = v > 0.f ? v / o.repetition_penalty : v * o.repetition_penalty;
    if (cnt) {
      const int c = a.counts[i];
      if (c) v -= o.frequency_penalty * static_cast<float>(c) + o.presence_penalty;
    }
    x[i] = v;
    if (v > m || (v == m && i < am)) m = v, am = i;  // NaN never compares greater
  }
  block_argmax(s, m, am, m, am);
  if (am >= V) am = 0;  // every entry NaN (or -FLT_MAX and below): token 0, as argmax of a NaN row would

  int token = am;
  if (!o.greedy && m > -FLT_MAX) {
    const float it = o.inv_temperature;
    auto weight = [&](float v) { return __expf((v - m) * it); };

    // 2. top-k: the key of the k-th largest x, 8 bits per pass
    uint32_t kk = 0;  // keep keys >= kk
    if (o.top_k > 0 && o.top_k < V) {
      if (t == 0) s.prefix = 0, s.need = o.top_k;
      uint32_t mask = 0;
      for (int shift = 24; shift >= 0; shift -= 8) {
        hist_clear(hc, hm);
        const uint32_t prefix = s.prefix;
#pragma unroll 4
        for (int i = t; i < V; i += kThreads) {
          const uint32_t key = order_key(x[i]);
          if ((key & mask) == prefix) atomicAdd(&hc[((key >> shift) & 255u) * 32 + lane], 1u);
        }
        hist_reduce(s, hc, hm);
        if (t == 0) {
          int need = s.need, b = 255;
          for (; b > 0 && need > static_cast<int>(s.cnt[b]); --b) need -= s.cnt[b];
          s.need = need;
          s.prefix = prefix | (static_cast<uint32_t>(b) << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
      }
      kk = s.prefix;
    }

    // 3. top-p over the kept: the smallest key whose strictly-greater kept mass is < top_p * kept mass
    uint32_t kp = 0;
    if (o.top_p < 1.f) {
      double z = 0.0;
#pragma unroll 4
      for (int i = t; i < V; i += kThreads)
        if (order_key(x[i]) >= kk) z += weight(x[i]);
      const float target = static_cast<float>(o.top_p * block_sum(s, z));
      if (t == 0) s.prefix = 0, s.above = 0.f;
      uint32_t mask = 0;
      for (int shift = 24; shift >= 0; shift -= 8) {
        hist_clear(hc, hm);
        const uint32_t prefix = s.prefix;
#pragma unroll 4
        for (int i = t; i < V; i += kThreads) {
          const float v = x[i];
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
    const float min_w = o.min_p;

    // 4. draw: warp w owns a contiguous span of the vocab (lanes stride by one, so loads coalesce)
    const int span = ((V + kWarps - 1) / kWarps + 31) / 32 * 32;
    const int w = t / 32, l = t % 32, lo = w * span, hi = min(V, lo + span);
    auto kept_w = [&](int i) {
      if (i >= hi) return 0.f;
      const float v = x[i];
      if (order_key(v) < keep_key) return 0.f;
      const float e = weight(v);
      return e >= min_w ? e : 0.f;
    };
    double part = 0.0;
#pragma unroll 4
    for (int i = lo + l; i < hi; i += 32) part += kept_w(i);
    for (int off = 16; off; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (l == 0) s.wd[w] = part;
    __syncthreads();
    if (t == 0) {
      double total = 0.0;
      for (int j = 0; j < kWarps; ++j) total += s.wd[j];
      const double target = static_cast<double>(*a.uniform) * total;
      // the first warp whose cumulative weight passes the target; if rounding lets none do (target ~ total),
      // the last warp with weight, with a remainder past its end (its walk then takes its last kept token)
      double before = 0.0, before_cw = 0.0;
      int cw = -1;
      for (int j = 0; j < kWarps; ++j) {
        if (s.wd[j] <= 0.0) continue;
        cw = j;
        before_cw = before;
        if (before + s.wd[j] > target) break;
        before += s.wd[j];
      }
      s.chosen_warp = cw;
      s.remainder = static_cast<float>(target - before_cw);
      s.token = am;
    }
    __syncthreads();
    if (w == s.chosen_warp) {
      const float rem = s.remainder;
      float run = 0.f;
      int last = -1;  // last kept index seen (rounding fallback)
      int found = -1;
      for (int base = lo; base < hi && found < 0; base += 32) {
        const float e = kept_w(base + l);
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
      if (l == 0) s.token = found >= 0 ? found : last >= 0 ? last : am;
    }
    __syncthreads();
    token = s.token;
  }
  if (t == 0) {
    *a.token = token;
    a.seen[token] = 1;
    a.counts[token] += 1;
  }
}

}  // namespace

void launch(cudaStream_t st, const Args& a) {
  static const bool attr = [] {  // more than the default 48 KB of dynamic shared memory
    LILY_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kHistBytes)));
    return true;
  }();
  (void)attr;
  sample_kernel<<<1, kThreads, kHistBytes, st>>>(a);
  LILY_CUDA_CHECK(cudaGetLastError());
}

DeviceSampler::~DeviceSampler() {
  for (void* p : {static_cast<void*>(opt_), static_cast<void*>(bias_ids_), static_cast<void*>(bias_vals_),
                  static_cast<void*>(seen_), static_cast<void*>(counts_), static_cast<void*>(x_)})
    if (p) cudaFree(p);
}

void DeviceSampler::begin(cudaStream_t st, const Options& opt, const int32_t* bias_ids, const float* bias_vals,
                          const uint8_t* seen, const int32_t* counts, int32_t n_bias, int32_t V) {
  ready_ = false;
  if (V != V_) {
    for (void** p : {reinterpret_cast<void**>(&seen_), reinterpret_cast<void**>(&counts_),
                     reinterpret_cast<void**>(&x_)})
      if (*p) cudaFree(*p), *p = nullptr;
    LILY_CUDA_CHECK(cudaMalloc(&seen_, V));
    LILY_CUDA_CHECK(cudaMalloc(&counts_, static_cast<size_t>(V) * sizeof(int32_t)));
    LILY_CUDA_CHECK(cudaMalloc(&x_, static_cast<size_t>(V) * sizeof(float)));
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
  Options o = opt;
  o.n_bias = n_bias;
  LILY_CUDA_CHECK(cudaMemcpyAsync(opt_, &o, sizeof(Options), cudaMemcpyHostToDevice, st));
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

}  // namespace lily::cuda::sample
