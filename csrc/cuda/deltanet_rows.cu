// The DeltaNet decode step over M = p.S rows (deltanet.cuh deltanet_step_rows; issue 43: the speculative verify): the
// one-token step's arithmetic (deltanet.cu deltanet_step_kernel) applied to the M tokens in order by the warp that owns
// a state row, the state after every row kept in its slot, so a verify that rejects drafts rolls back by choosing a
// slot (no copy of the state before it, no replay). Row t's arithmetic is the one-token step's on the state after row
// t - 1, in the same order, so M rows equal M one-token steps bit for bit. Not yet wired into the engine.
#include "cuda/deltanet.cuh"

namespace lily::cuda {
namespace {

constexpr int kRowsWarps = 4;  // state rows (dv) per block, as the one-token step
constexpr int kMaxStepRows = 8;

template <int NK>
__global__ void __launch_bounds__(kRowsWarps * 32)
    deltanet_rows_kernel(kp::DeltaNetParams p, const float* u, const float* b, const float* a, const float* dt_bias,
                         const float* a_log, float* ssm, float* y, const float* z, const float* nw, bf16* out,
                         int32_t* head_done, float* state_rows) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, dv = blockIdx.x * kRowsWarps + warp;
  const int Dk = p.k_dim, M = static_cast<int>(p.S);
  const int64_t C = p.conv_dim, HD = static_cast<int64_t>(p.v_heads) * p.v_dim;
  const int64_t row_off = (static_cast<int64_t>(h) * p.v_dim + min(dv, p.v_dim - 1)) * Dk;
  float* sp = ssm + row_off;
  float st[NK];  // the state row: this kernel's own, loaded before the PDL wait
#pragma unroll
  for (int i = 0; i < NK; ++i) st[i] = lane + 32 * i < Dk ? sp[lane + 32 * i] : 0.f;
  pdl_trigger();
  pdl_wait();
  if (dv < p.v_dim) {
    const int kh = h / (p.v_heads / p.k_heads);
    const int64_t key_dim = static_cast<int64_t>(p.k_heads) * Dk;
    const float A = expf(a_log[h]), dtb = dt_bias[h];
    for (int t = 0; t < M; ++t) {
      const float* ut = u + t * C;
      float q[NK], k[NK];
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        const bool in = lane + 32 * i < Dk;
        q[i] = in ? ut[static_cast<int64_t>(kh) * Dk + lane + 32 * i] : 0.f;
        k[i] = in ? ut[key_dim + static_cast<int64_t>(kh) * Dk + lane + 32 * i] : 0.f;
      }
      const float v = ut[2 * key_dim + static_cast<int64_t>(h) * p.v_dim + dv];
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int i = 0; i < NK; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const float iq = 1.f / sqrtf(sq + p.qk_eps) * rsqrtf(static_cast<float>(Dk));
      const float ik = 1.f / sqrtf(sk + p.qk_eps);
#pragma unroll
      for (int i = 0; i < NK; ++i) q[i] *= iq, k[i] *= ik;
      const float beta = 1.f / (1.f + expf(-b[t * p.v_heads + h]));
      const float g = expf(-A * softplusf_(a[t * p.v_heads + h] + dtb));
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
      if (lane == 0) y[t * HD + static_cast<int64_t>(h) * p.v_dim + dv] = o;
      if (state_rows) {
        float* sr = state_rows + t * HD * Dk + row_off;
#pragma unroll
        for (int i = 0; i < NK; ++i)
          if (lane + 32 * i < Dk) sr[lane + 32 * i] = st[i];
      }
    }
    if (lane == 0) __threadfence();  // y visible to the head's last block before this block counts itself
#pragma unroll
    for (int i = 0; i < NK; ++i)
      if (lane + 32 * i < Dk) sp[lane + 32 * i] = st[i];
  }
  __shared__ int last;
  __shared__ float red[kRowsWarps];
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&head_done[h], 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int Dv = p.v_dim;
  for (int t = 0; t < M; ++t) {  // the gated norm of every row's head output (deltanet_step_kernel's, per row)
    const float* yr = y + t * HD + static_cast<int64_t>(h) * Dv;
    const float* zr = z + t * HD + static_cast<int64_t>(h) * Dv;
    float ss = 0.f;
    for (int i = threadIdx.x; i < Dv; i += blockDim.x) {
      const float v = __ldcg(yr + i);
      ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int w = 0; w < kRowsWarps; ++w) ss += red[w];
    __syncthreads();  // red is read before the next row writes it
    const float inv = 1.f / sqrtf(ss / static_cast<float>(Dv) + p.norm_eps);
    for (int i = threadIdx.x; i < Dv; i += blockDim.x) {
      const float zz = zr[i];
      out[t * HD + static_cast<int64_t>(h) * Dv + i] = __float2bfloat16(gated_out(__ldcg(yr + i), inv, nw[i], zz));
    }
  }
  if (threadIdx.x == 0) head_done[h] = 0;  // ready for the next launch (graph replays included)
}

}  // namespace

void deltanet_step_rows(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, float* y, const float* z,
                        const float* norm_w, bf16* out, int32_t* head_done, float* state_rows) {
  if (p.S < 1 || p.S > kMaxStepRows)
    throw std::invalid_argument("[lily] cuda deltanet_step_rows: " + std::to_string(p.S) + " rows, expected 1 to 8");
  const dim3 grid(static_cast<unsigned>((p.v_dim + kRowsWarps - 1) / kRowsWarps), p.v_heads);
  const dim3 block(kRowsWarps * 32);
#define LILY_ROWS(NK)                                                                                             \
  launch_pdl(deltanet_rows_kernel<NK>, grid, block, 0, st, p, u, b, a, dt_bias, a_log, ssm, y, z, norm_w, out, \
             head_done, state_rows)
  switch ((p.k_dim + 31) / 32) {
    case 1: LILY_ROWS(1); break;
    case 2: LILY_ROWS(2); break;
    case 3: LILY_ROWS(3); break;
    case 4: LILY_ROWS(4); break;
    default: throw std::invalid_argument("[lily] cuda deltanet_step_rows: linear_key_head_dim > 128 is not supported");
  }
#undef LILY_ROWS
}

}  // namespace lily::cuda
