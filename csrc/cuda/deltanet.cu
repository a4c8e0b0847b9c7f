// The Gated DeltaNet family (docs/model.md §4.3), in the order a layer runs it: the causal conv (+ SiLU, q/k l2 norm),
// the recurrence (prefill: deltanet_scan, whose forms live in deltanet_seq.cu and deltanet_chunk.cu; one token:
// deltanet_step, with the l2 norm and the gated RMSNorm fused in), the gated RMSNorm (prefill: deltanet_scan_norm,
// fused into the chunked form's output kernel where the head fits it, else gated_norm_kernel after the scan).
#include "cuda/deltanet.cuh"

namespace lily::cuda {
namespace {

// Conv: 128-thread blocks, 8 resident per SM (__launch_bounds__: at most 64 registers, no spills), kConvRows rows
// per thread. 16 rows: at S = 4096 and C = 8192 the float4 path's grid is 16 x 256 blocks, about four waves over the
// 132 SMs (32 rows: two, the last wave's tail a larger share of the run); the K-1 halo rows a thread also reads
// (3 per 16) are the previous row block's last rows, read at about the same time (16 blocks earlier in launch
// order), so they come from L2 rather than HBM.
constexpr int kConvThreads = 128;
constexpr int kConvRows = 16;
// Rows whose X loads a thread issues together before their sums: 4 float4 loads in flight per thread, 64 KB per SM
// at 32 warps, 8.6 MB over 132 SMs (4.8 TB/s x ~1 us of latency is ~5 MB). kConvRows is a multiple of it, so only a
// row block cut short by S ends in a partial batch.
constexpr int kConvBatch = 4;
constexpr int kStepWarps = 4;   // state rows (dv) per block of the one-token scan

// Row i of X = [conv_state (K-1 rows); qkv (S rows)] at channel c.
__device__ __forceinline__ const float* conv_row(const float* cs, const float* qkv, int64_t i, int64_t c, int64_t C,
                                                 int K) {
  return i < K - 1 ? cs + i * C + c : qkv + (i - (K - 1)) * C + c;
}
// V consecutive floats (V = 4: one 16-byte access).
template <int V>
__device__ __forceinline__ void load_v(const float* src, float (&x)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(src);
    x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
  } else {
    x[0] = *src;
  }
}
template <int V>
__device__ __forceinline__ void store_v(float* dst, const float (&x)[V]) {
  if constexpr (V == 4)
    *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
  else
    dst[0] = x[0];
}

// u[t, c] = silu(sum_j w[c, j] X[t + j, c]); tap K-1 multiplies the current row. Reads conv_state only; u must not
// alias qkv or conv_state. Each thread owns V consecutive channels and kConvRows rows.
// KS > 0: the kernel size is KS and the K-row window slides in registers (each X row read once per thread,
// not K times); KS == 0: any K, re-reading the window. Same sum order either way, so the results are identical.
// V == 4 (C % 4 == 0, 16-byte aligned rows, Dk % 4 == 0, 128 % Dk == 0) also applies the q/k l2 norm: a warp owns
// 128 channels from a multiple of 128 and heads start at multiples of Dk, so a head is Dk/4 aligned consecutive
// lanes and an xor butterfly below Dk/4 sums its squares. Every lane runs every shuffle (the row loop's bounds are
// the block's). Lanes past C hold zeros; a v head's lanes sum among themselves (head-aligned segments never mix q/k
// and v lanes) and leave their values unscaled. V == 1: l2norm_kernel follows.
template <int KS, int V>
__global__ void __launch_bounds__(kConvThreads, 8)
    conv_kernel(kp::DeltaNetParams p, const float* __restrict__ qkv, const float* __restrict__ w,
                const float* __restrict__ cs, float* __restrict__ u) {
  const int64_t C = p.conv_dim, c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  const bool in = c < C;  // then all V channels are (C % V == 0)
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kConvRows, t1 = min64(p.S, t0 + kConvRows);
  constexpr int KW = KS > 0 ? KS : 1;
  // KS > 0: the weights and the window, X rows t-1 .. t+KS-2 before the shift of row t (KS == 0 reads both anew)
  float wr[KW][V] = {}, win[KW][V] = {};
  if constexpr (KS > 0) {
    if (in) {
#pragma unroll
      for (int i = 0; i < V; ++i)
#pragma unroll
        for (int j = 0; j < KS; ++j) wr[j][i] = w[(c + i) * KS + j];
#pragma unroll
      for (int j = 0; j < KS - 1; ++j) load_v(conv_row(cs, qkv, t0 + j, c, C, KS), win[j + 1]);
    }
  }
  for (int64_t tb = t0; tb < t1; tb += kConvBatch) {
    float o[kConvBatch][V];
    if constexpr (KS > 0) {
      float nx[kConvBatch][V] = {};  // X rows tb+r+KS-1: the new row of each of the batch's sums
#pragma unroll
      for (int r = 0; r < kConvBatch; ++r)
        if (in && tb + r < t1) load_v(conv_row(cs, qkv, tb + r + KS - 1, c, C, KS), nx[r]);
#pragma unroll
      for (int r = 0; r < kConvBatch; ++r) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
#pragma unroll
          for (int j = 0; j < KS - 1; ++j) win[j][i] = win[j + 1][i];
          win[KS - 1][i] = nx[r][i];
          float acc = 0.f;
#pragma unroll
          for (int j = 0; j < KS; ++j) acc += wr[j][i] * win[j][i];
          o[r][i] = acc / (1.f + expf(-acc));
        }
      }
    } else {
      const int K = p.conv_kernel;
#pragma unroll
      for (int r = 0; r < kConvBatch; ++r) {
        float acc[V] = {};
        if (in && tb + r < t1)
          for (int j = 0; j < K; ++j) {
            float x[V];
            load_v(conv_row(cs, qkv, tb + r + j, c, C, K), x);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += w[(c + i) * K + j] * x[i];
          }
#pragma unroll
        for (int i = 0; i < V; ++i) o[r][i] = acc[i] / (1.f + expf(-acc[i]));
      }
    }
    if constexpr (V == 4) {  // l2norm_kernel's formula on the head's Dk values; the batch's rows interleaved
      const int64_t q_end = static_cast<int64_t>(p.k_heads) * p.k_dim;
      const bool qk = in && c < 2 * q_end;
      const float head_scale = c < q_end ? rsqrtf(static_cast<float>(p.k_dim)) : 1.f;
      const int seg = p.k_dim / 4;  // lanes per head
      float ss[kConvBatch];
#pragma unroll
      for (int r = 0; r < kConvBatch; ++r) {
        ss[r] = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) ss[r] += o[r][i] * o[r][i];
      }
#pragma unroll
      for (int m = 16; m > 0; m >>= 1)
#pragma unroll
        for (int r = 0; r < kConvBatch; ++r) {
          const float other = __shfl_xor_sync(0xffffffffu, ss[r], m);
          ss[r] += m < seg ? other : 0.f;
        }
      if (qk) {  // warp-uniform at the real shape (q/k end at channel 2 Hk Dk = 4096): v warps skip it
#pragma unroll
        for (int r = 0; r < kConvBatch; ++r) {
          const float inv = 1.f / sqrtf(ss[r] + p.qk_eps) * head_scale;
#pragma unroll
          for (int i = 0; i < V; ++i) o[r][i] *= inv;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kConvBatch; ++r)
      if (in && tb + r < t1) store_v(u + (tb + r) * C + c, o[r]);
  }
}

// New conv state = the last K-1 rows of X; ascending r only overwrites rows no longer needed.
__global__ void conv_state_kernel(kp::DeltaNetParams p, const float* qkv, float* cs) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, C = p.conv_dim;
  if (c >= C) return;
  const int K = p.conv_kernel;
  for (int r = 0; r < K - 1; ++r) cs[r * C + c] = *conv_row(cs, qkv, p.S + r, c, C, K);
}

// One warp per (row, q-or-k head): x *= 1/sqrt(sum x^2 + eps), times Dk^-0.5 for q (after conv_kernel<KS, 1>).
__global__ void l2norm_kernel(kp::DeltaNetParams p, float* u) {
  const int64_t wid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, nh = 2 * p.k_heads;
  if (wid >= p.S * nh) return;
  const int64_t t = wid / nh;
  const int hh = static_cast<int>(wid % nh);
  float* x = u + t * p.conv_dim + static_cast<int64_t>(hh) * p.k_dim;
  float ss = 0.f;
  for (int i = lane; i < p.k_dim; i += 32) ss += x[i] * x[i];
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss + p.qk_eps) * (hh < p.k_heads ? rsqrtf(static_cast<float>(p.k_dim)) : 1.f);
  for (int i = lane; i < p.k_dim; i += 32) x[i] *= inv;
}

// One warp per (row, value head): RMSNorm(y; w) * silu(z) -> bf16 (the out_proj input).
__global__ void gated_norm_kernel(kp::DeltaNetParams p, const float* y, const float* z, const float* w, bf16* out) {
  const int64_t wid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, Dv = p.v_dim;
  if (wid >= p.S * p.v_heads) return;
  const float* yr = y + wid * Dv;
  const float* zr = z + wid * Dv;
  float ss = 0.f;
  for (int i = lane; i < Dv; i += 32) ss += yr[i] * yr[i];
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / static_cast<float>(Dv) + p.norm_eps);
  for (int i = lane; i < Dv; i += 32) {
    const float zz = zr[i];
    out[wid * Dv + i] = __float2bfloat16(gated_out(yr[i], inv, w[i], zz));
  }
}

// DeltaNet recurrence for one token: one warp per state row (h, dv), q/k l2 normalisation fused in (the
// arithmetic of l2norm_kernel and scan_kernel at S = 1), then the gated RMSNorm of the head fused in: the head's
// last block to finish (counted in head_done[h], which it resets to zero) normalises the head's Dv outputs
// (gated_norm_kernel's arithmetic), so the out-projection stages a plain bf16 row. (The norm in the
// out-projection's staging cost every one of its 256 blocks two dependent passes over y and z: 11.7 us against
// 6.7 for the same bytes with a bf16 row. A thread-block cluster per head, the squares added through distributed
// shared memory, measured 1.1% slower in the step: dev/README.md; decode_gemv_h200.md.)
template <int NK>
__global__ void __launch_bounds__(kStepWarps * 32)
    deltanet_step_kernel(kp::DeltaNetParams p, const float* u, const float* b, const float* a, const float* dt_bias,
                         const float* a_log, float* ssm, float* y, const float* z, const float* nw, bf16* out,
                         int32_t* head_done) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, dv = blockIdx.x * kStepWarps + warp;
  const int Dk = p.k_dim;
  float* sp = ssm + (static_cast<int64_t>(h) * p.v_dim + min(dv, p.v_dim - 1)) * Dk;
  // The state row is this kernel's own (the previous launch never writes it): its DRAM loads go out before the PDL
  // wait, so they overlap the in-projection's tail instead of following it.
  float st[NK];
#pragma unroll
  for (int i = 0; i < NK; ++i) st[i] = lane + 32 * i < Dk ? sp[lane + 32 * i] : 0.f;
  pdl_trigger();
  pdl_wait();
  if (dv < p.v_dim) {
    const int kh = h / (p.v_heads / p.k_heads);
    const int64_t key_dim = static_cast<int64_t>(p.k_heads) * Dk;
    float q[NK], k[NK];
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const bool in = lane + 32 * i < Dk;
      q[i] = in ? u[static_cast<int64_t>(kh) * Dk + lane + 32 * i] : 0.f;
      k[i] = in ? u[key_dim + static_cast<int64_t>(kh) * Dk + lane + 32 * i] : 0.f;
    }
    const float v = u[2 * key_dim + static_cast<int64_t>(h) * p.v_dim + dv];
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float iq = 1.f / sqrtf(sq + p.qk_eps) * rsqrtf(static_cast<float>(Dk));
    const float ik = 1.f / sqrtf(sk + p.qk_eps);
#pragma unroll
    for (int i = 0; i < NK; ++i) q[i] *= iq, k[i] *= ik;
    const float A = expf(a_log[h]), dtb = dt_bias[h];
    const float beta = 1.f / (1.f + expf(-b[h]));
    const float g = expf(-A * softplusf_(a[h] + dtb));
    float kst = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      st[i] *= g;
      kst += st[i] * k[i];
    }
    const float delta = beta * (v - warp_sum(kst));
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      st[i] += delta * k[i];
      o += st[i] * q[i];
    }
    o = warp_sum(o);
    if (lane == 0) {
      y[static_cast<int64_t>(h) * p.v_dim + dv] = o;
      __threadfence();  // visible to the head's last block before this block counts itself
    }
#pragma unroll
    for (int i = 0; i < NK; ++i)
      if (lane + 32 * i < Dk) sp[lane + 32 * i] = st[i];
  }
  __shared__ int last;
  __shared__ float red[kStepWarps];
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&head_done[h], 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int Dv = p.v_dim;
  const float* yr = y + static_cast<int64_t>(h) * Dv;
  const float* zr = z + static_cast<int64_t>(h) * Dv;
  float ss = 0.f;
  for (int i = threadIdx.x; i < Dv; i += blockDim.x) {
    const float t = __ldcg(yr + i);
    ss += t * t;
  }
  ss = warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  ss = 0.f;
#pragma unroll
  for (int w = 0; w < kStepWarps; ++w) ss += red[w];
  const float inv = 1.f / sqrtf(ss / static_cast<float>(Dv) + p.norm_eps);
  for (int i = threadIdx.x; i < Dv; i += blockDim.x) {
    const float zz = zr[i];
    out[static_cast<int64_t>(h) * Dv + i] = __float2bfloat16(gated_out(__ldcg(yr + i), inv, nw[i], zz));
  }
  if (threadIdx.x == 0) head_done[h] = 0;  // ready for the next launch (graph replays included)
}

// The conv for V channels per thread (deltanet_conv picks V), one instance per kernel size.
template <int V>
void launch_conv(cudaStream_t st, const kp::DeltaNetParams& p, const float* qkv, const float* conv_w,
                 const float* conv_state, float* u) {
  const int64_t threads = (p.conv_dim + V - 1) / V;
  const dim3 grid(static_cast<unsigned>((threads + kConvThreads - 1) / kConvThreads),
                  static_cast<unsigned>((p.S + kConvRows - 1) / kConvRows));
  switch (p.conv_kernel) {  // the model's kernel size is 4; the sliding window for the small ones
    case 2: conv_kernel<2, V><<<grid, kConvThreads, 0, st>>>(p, qkv, conv_w, conv_state, u); break;
    case 3: conv_kernel<3, V><<<grid, kConvThreads, 0, st>>>(p, qkv, conv_w, conv_state, u); break;
    case 4: conv_kernel<4, V><<<grid, kConvThreads, 0, st>>>(p, qkv, conv_w, conv_state, u); break;
    default: conv_kernel<0, V><<<grid, kConvThreads, 0, st>>>(p, qkv, conv_w, conv_state, u); break;
  }
  LILY_LAUNCH_CHECK();
}

}  // namespace

void deltanet_conv(cudaStream_t st, const kp::DeltaNetParams& p, const float* qkv, const float* conv_w,
                   float* conv_state, float* u) {
  // Four channels per thread with the l2 norm fused where a warp's 128 channels hold whole heads and every row is
  // 16-byte aligned (the model: C = 8192, Dk = 128); otherwise one channel per thread, then l2norm_kernel.
  auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec = p.conv_dim % 4 == 0 && p.k_dim > 0 && p.k_dim % 4 == 0 && 128 % p.k_dim == 0 && a16(qkv) &&
                   a16(u) && a16(conv_state);
  if (vec)
    launch_conv<4>(st, p, qkv, conv_w, conv_state, u);
  else
    launch_conv<1>(st, p, qkv, conv_w, conv_state, u);
  conv_state_kernel<<<static_cast<unsigned>((p.conv_dim + 127) / 128), 128, 0, st>>>(p, qkv, conv_state);
  LILY_LAUNCH_CHECK();
  if (vec) return;  // the l2 norm was fused
  const int64_t threads = p.S * 2 * p.k_heads * 32;
  l2norm_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p, u);
  LILY_LAUNCH_CHECK();
}

int deltanet_scan_pick(const kp::DeltaNetParams& p, int form) {
  if (form == kScanAuto) return p.S >= kScanChunkMinRows ? kScanChunked : kScanSequential;
  if (form != kScanSequential && form != kScanChunked)
    throw std::invalid_argument("[lily] cuda deltanet_scan: form is 0 (auto), 1 (sequential) or 2 (chunked)");
  return form;
}

// The chunked form's scratch: the caller's when it is large enough, else a fallback buffer grown on demand.
// cudaMalloc/cudaFree synchronise, so callers that capture graphs or care about the stall pass their own scratch
// of deltanet_chunk_scratch_bytes(p) bytes.
static float* chunk_scratch(const kp::DeltaNetParams& p, float* scratch, size_t scratch_bytes) {
  const size_t need = deltanet_chunk_scratch_bytes(p);
  if (scratch != nullptr && scratch_bytes >= need) return scratch;
  static float* own = nullptr;
  static size_t own_bytes = 0;
  if (own_bytes < need) {
    if (own != nullptr) LILY_CUDA_CHECK(cudaFree(own));
    own = nullptr;
    own_bytes = 0;
    LILY_CUDA_CHECK(cudaMalloc(&own, need));
    own_bytes = need;
  }
  return own;
}

void deltanet_scan(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y, int form, float* scratch,
                   size_t scratch_bytes) {
  if (deltanet_scan_pick(p, form) == kScanSequential)
    return deltanet_scan_seq(st, p, u, b, a, dt_bias, a_log, ssm, y, 8);
  deltanet_scan_chunked(st, p, u, b, a, dt_bias, a_log, ssm, y, chunk_scratch(p, scratch, scratch_bytes));
}

void deltanet_scan_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z,
                        const float* norm_w, bf16* out, int form, float* scratch, size_t scratch_bytes) {
  if (deltanet_scan_pick(p, form) == kScanChunked && p.v_dim <= kScanNormMaxDv)
    return deltanet_scan_chunked_norm(st, p, u, b, a, dt_bias, a_log, ssm, z, norm_w, out,
                                      chunk_scratch(p, scratch, scratch_bytes));
  deltanet_scan(st, p, u, b, a, dt_bias, a_log, ssm, y, form, scratch, scratch_bytes);
  deltanet_gated_norm(st, p, y, z, norm_w, out);
}

void deltanet_gated_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* y, const float* z,
                         const float* w, bf16* out) {
  const int64_t threads = p.S * p.v_heads * 32;
  gated_norm_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, st>>>(p, y, z, w, out);
  LILY_LAUNCH_CHECK();
}

void deltanet_step(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                   const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z, const float* norm_w,
                   bf16* out, int32_t* head_done) {
  const dim3 grid(static_cast<unsigned>((p.v_dim + kStepWarps - 1) / kStepWarps), p.v_heads);
  const dim3 block(kStepWarps * 32);
#define LILY_STEP(NK) \
  launch_pdl(deltanet_step_kernel<NK>, grid, block, 0, st, p, u, b, a, dt_bias, a_log, ssm, y, z, norm_w, out, head_done)
  switch ((p.k_dim + 31) / 32) {
    case 1: LILY_STEP(1); break;
    case 2: LILY_STEP(2); break;
    case 3: LILY_STEP(3); break;
    case 4: LILY_STEP(4); break;
    default: throw std::invalid_argument("[lily] cuda deltanet_step: linear_key_head_dim > 128 is not supported");
  }
#undef LILY_STEP
}

}  // namespace lily::cuda
