// Shared device helpers of the CUDA backend: error checks, bf16 conversion, warp reductions, and the
// device view of a linear layer (LinearParams + pointers) with per-element dequantization.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/params.h"

namespace lily::cuda {

using bf16 = __nv_bfloat16;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("[lily] cuda: ") + what + ": " + cudaGetErrorString(e));
}
#define LILY_CUDA_CHECK(x) ::lily::cuda::check((x), #x)
// After a launch: reports configuration errors at once (asynchronous faults surface at the next sync).
#define LILY_LAUNCH_CHECK() ::lily::cuda::check(cudaGetLastError(), __func__)

// Whether the current device is sm_90 (Hopper: the wgmma kernels' architecture; cached per process).
inline bool device_is_sm90() {
  static const bool v = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return false;
    return major == 9 && minor == 0;
  }();
  return v;
}

// Host-side bf16 bits <-> float (round to nearest even), for the check programs and experiments that build inputs.
inline uint16_t host_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float host_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Device view of a Linear; pointers into device memory.
struct DLinear {
  kp::LinearParams p;
  const uint32_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* biases = nullptr;
  const void* dense = nullptr;
};

__device__ __forceinline__ float bf2f(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
__device__ __forceinline__ float bf2f(bf16 b) { return __bfloat162float(b); }

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Router top-k of one token row, by one warp: the k largest of E (<= 256) logits (ties -> lower index), each round
// one warp max of order-preserving integer keys (redux.sync) and one warp min of the holders' indices, then the
// softmax weights of the chosen, renormalised over them when `norm` (exp(l_j - l_max) / sum over the chosen: the
// softmax's denominator cancels) or divided by the full softmax denominator otherwise. Lane j < k writes idx_out[j]
// and w_out[j]. Selecting on logits rather than on rounded probabilities is the fp64 twin's order. (The earlier form,
// a softmax of all E and k rounds of a shuffle argmax, took ~2.3 us on the decode step's critical path: the
// experts' launch waited on it in every block: barrier stalls 35% of that launch kind, 27% after; +2.4% of the decode
// step, benchmarks/results/decode_gemv_h200.md.)
// A non-finite row (a NaN or +inf logit, or every logit -inf) picks expert 0 with a NaN weight in every slot, so the
// NaN reaches the output and no index past E ever serves as a weight offset or histogram slot; absent experts
// (e >= E) hold key 0, below every real logit's.
// Float -> uint32 with the same order (the router's keys, the greedy head's argmax keys).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ void route_topk_warp(const float* logits, int E, int k, bool norm, int32_t* idx_out,
                                                float* w_out, int lane) {
  float v[8];
  uint32_t key[8];
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? logits[e] : -INFINITY;
    key[i] = e < E ? order_key(v[i]) : 0u;
    bad = bad || isnan(v[i]) || v[i] == INFINITY;
  }
  float mx = 0.f, chosen = 0.f, my_w = 0.f;
  int my_idx = 0;
  for (int j = 0; j < k; ++j) {
    uint32_t lk = key[0];  // this lane's best: the first of equal keys has the lower index
    float lv = v[0];
    int li = 0;
#pragma unroll
    for (int i = 1; i < 8; ++i)
      if (key[i] > lk) lk = key[i], lv = v[i], li = i;
    const uint32_t m = __reduce_max_sync(0xffffffffu, lk);
    const int win = __reduce_min_sync(0xffffffffu, lk == m ? lane + 32 * li : 0x7fffffff);
    if (lane == (win & 31)) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i == li) key[i] = 0u;
    }
    const float wv = __shfl_sync(0xffffffffu, lv, win & 31);
    if (j == 0) mx = wv;
    const float ev = expf(wv - mx);
    if (lane == j) my_idx = win, my_w = ev;
    chosen += ev;
  }
  bad = __any_sync(0xffffffffu, bad) || mx == -INFINITY;
  float den = chosen;
  if (!norm) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += lane + 32 * i < E ? expf(v[i] - mx) : 0.f;
    den = warp_sum(t);
  }
  if (lane < k) {
    idx_out[lane] = bad ? 0 : my_idx;
    w_out[lane] = bad ? __int_as_float(0x7fc00000) : my_w / den;
  }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + __expf(-x)); }
// log(1 + e^x) without overflow (same threshold as the CPU backend).
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// 8 consecutive weights W[row, k0..k0+8) of expert e as floats (k0 % 8 == 0; zero past `in`).
__device__ __forceinline__ void load_w8(const DLinear& W, int64_t e, int64_t row, int64_t k0, float out[8]) {
  const kp::LinearParams& p = W.p;
  if (p.kind == 0) {
    const int64_t wpr = p.in * p.bits / 32, gpr = p.in / p.group;
    const uint32_t* c = W.codes + e * p.expert_words + row * wpr;
    const int64_t g = e * p.expert_groups + row * gpr + k0 / p.group;
    // (code << shift) | 0x3F800000 is the float 1 + code/2^bits: no int-to-float conversion (quarter rate).
    const float s = bf2f(W.scales[g]), b = bf2f(W.biases[g]);
    if (p.bits == 4) {
      const uint32_t w = c[k0 / 8];
      const float s16 = 16.f * s, b16 = b - s16;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int sh = 19 - 4 * j;
        const uint32_t m = (sh >= 0 ? w << sh : w >> -sh) & 0x00780000u;
        out[j] = fmaf(s16, __uint_as_float(m | 0x3F800000u), b16);
      }
    } else {
      const float s256 = 256.f * s, b256 = b - s256;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t w = c[k0 / 4 + h];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int sh = 15 - 8 * j;
          const uint32_t m = (sh >= 0 ? w << sh : w >> -sh) & 0x007F8000u;
          out[4 * h + j] = fmaf(s256, __uint_as_float(m | 0x3F800000u), b256);
        }
      }
    }
  } else if (p.kind == 1) {
    const uint16_t* d = static_cast<const uint16_t*>(W.dense) + e * p.expert_elems + row * p.in;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = k0 + j < p.in ? bf2f(d[k0 + j]) : 0.f;
  } else {
    const float* d = static_cast<const float*>(W.dense) + e * p.expert_elems + row * p.in;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = k0 + j < p.in ? d[k0 + j] : 0.f;
  }
}

// Exclusive prefix sum of v over the block (blockDim a multiple of 32, <= 1024); *total (if given) = the sum.
// ws: 33 ints of shared scratch.
__device__ __forceinline__ int block_exclusive_scan(int v, int* ws, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  int inc = v;
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += n;
  }
  if (lane == 31) ws[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < nw ? ws[lane] : 0;
    int winc = w;
    for (int off = 1; off < 32; off <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, winc, off);
      if (lane >= off) winc += n;
    }
    if (lane < nw) ws[lane] = winc - w;
    if (lane == 31) ws[32] = winc;
  }
  __syncthreads();
  const int r = ws[warp] + inc - v;
  if (total) *total = ws[32];
  __syncthreads();  // ws is reused by the next scan
  return r;
}

// PDL: a kernel launched with programmatic stream serialisation may start while its predecessor is still
// running. It must not read the predecessor's outputs (nor write anything the predecessor reads) before
// pdl_wait(), which returns once the predecessor grid has completed and its memory is visible; without the
// launch attribute both are no-ops. Every decode kernel calls pdl_wait() on every path, so completion stays
// transitive along the chain. pdl_trigger() lets the next kernel be scheduled as soon as all our blocks run.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// Streaming multiprocessors of the current device (cached; 132 if the query fails).
inline int device_sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 132;
    return v;
  }();
  return n;
}

// Launch with the PDL attribute (cudaLaunchKernelEx; stream-ordered, capturable in graphs).
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "cudaLaunchKernelEx");
}

}  // namespace lily::cuda
