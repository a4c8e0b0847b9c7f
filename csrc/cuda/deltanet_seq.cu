// Gated DeltaNet prefill, sequential form (docs/model.md §4.3 step 7): the exact per-token fp32 recurrence with 8 (or 16)
// lanes per state row (3 shuffle steps per reduction, 4 rows per warp) and the token inputs staged into shared
// memory 32 tokens ahead with cp.async, so no global load sits on the per-token critical path. deltanet_scan
// (deltanet.cu) runs it for short prompts; the chunked form (deltanet_chunk.cu) takes the long ones.
// tests/kernels/test_cuda_deltanet.py compares both with an fp64 host recurrence.
#include "cuda/deltanet_scan.cuh"

namespace lily::cuda {
namespace {

using namespace dn_scan;
constexpr int kStageTokens = 32;  // tokens staged per shared-memory buffer

// LANES lanes own one state row S[h, dv, :]; lane `sub` holds elements sub + LANES*i.
// DKP = Dk rounded up to a multiple of 32; q/k columns past Dk are zero in shared memory, so padded state
// elements stay 0 and the inner loops need no guards.
template <int LANES, int DKP>
struct SeqLayout {
  static constexpr int kRows = kThreads / LANES;  // state rows per block
  static constexpr int kElems = DKP / LANES;      // state elements per lane
  // one staging buffer: q [T][DKP] | k [T][DKP] | v [T][kRows] | g [T] | beta [T]
  static constexpr int kQ = 0, kK = kStageTokens * DKP, kV = 2 * kStageTokens * DKP;
  static constexpr int kG = kV + kStageTokens * kRows, kB = kG + kStageTokens;
  static constexpr int kBuf = kB + kStageTokens;
  static constexpr size_t kSmemBytes = 2 * kBuf * sizeof(float);
};

template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int LANES, int DKP>
__global__ void __launch_bounds__(kThreads) seq_scan_kernel(ScanArgs args) {
  using L = SeqLayout<LANES, DKP>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const kp::DeltaNetParams& p = args.p;
  const int tid = threadIdx.x, sub = tid % LANES, row = tid / LANES;
  const int h = blockIdx.y, dv0 = blockIdx.x * L::kRows, dv = dv0 + row;
  const int Dk = p.k_dim, Dv = p.v_dim, Hv = p.v_heads, kh = h / (p.v_heads / p.k_heads);
  const int64_t S = p.S, C = p.conv_dim, key_dim = static_cast<int64_t>(p.k_heads) * Dk;
  const float A = expf(args.a_log[h]), dtb = args.dt_bias[h];

  for (int i = tid; i < 2 * L::kBuf; i += kThreads) smem[i] = 0.f;  // zero padding columns of both buffers
  __syncthreads();

  // Issues the cp.async copies of tokens t0 .. t0 + n - 1 into buffer `buf` (padding columns untouched).
  auto stage = [&](int buf, int64_t t0) {
    float* sb = smem + buf * L::kBuf;
    const int n = static_cast<int>(min64(kStageTokens, S - t0));
    for (int i = tid; i < n * Dk; i += kThreads) {
      const int t = i / Dk, c = i % Dk;
      const float* src = args.u + (t0 + t) * C + static_cast<int64_t>(kh) * Dk + c;
      cp_async4(sb + L::kQ + t * DKP + c, src);
      cp_async4(sb + L::kK + t * DKP + c, src + key_dim);
    }
    for (int i = tid; i < n * L::kRows; i += kThreads) {
      const int t = i / L::kRows, r = i % L::kRows;
      if (dv0 + r < Dv)
        cp_async4(sb + L::kV + t * L::kRows + r,
                  args.u + (t0 + t) * C + 2 * key_dim + static_cast<int64_t>(h) * Dv + dv0 + r);
    }
    for (int t = tid; t < n; t += kThreads) {
      cp_async4(sb + L::kG + t, args.a + (t0 + t) * Hv + h);
      cp_async4(sb + L::kB + t, args.b + (t0 + t) * Hv + h);
    }
  };

  float st[L::kElems];
  float* sp = args.ssm + (static_cast<int64_t>(h) * Dv + dv) * Dk;
#pragma unroll
  for (int i = 0; i < L::kElems; ++i) st[i] = (dv < Dv && sub + LANES * i < Dk) ? sp[sub + LANES * i] : 0.f;
  float* yp = args.y + static_cast<int64_t>(h) * Dv + dv;
  const int64_t y_stride = static_cast<int64_t>(Hv) * Dv;

  stage(0, 0);
  cp_async_commit();
  const int64_t n_stages = (S + kStageTokens - 1) / kStageTokens;
  for (int64_t si = 0; si < n_stages; ++si) {
    const int64_t t0 = si * kStageTokens;
    if (si + 1 < n_stages) stage(static_cast<int>((si + 1) & 1), t0 + kStageTokens);
    cp_async_commit();  // possibly empty group: keeps wait_group<1> meaning "buffer si has landed"
    cp_async_wait<1>();
    __syncthreads();
    float* sb = smem + (si & 1) * L::kBuf;
    const int n = static_cast<int>(min64(kStageTokens, S - t0));
    if (tid < n) {  // gates in place, same formulas as the CPU twin
      sb[L::kG + tid] = expf(-A * softplusf_(sb[L::kG + tid] + dtb));
      sb[L::kB + tid] = 1.f / (1.f + expf(-sb[L::kB + tid]));
    }
    __syncthreads();
#pragma unroll 2  // lets the next token's shared loads overlap this token's reductions
    for (int t = 0; t < n; ++t) {
      const float* q = sb + L::kQ + t * DKP + sub;
      const float* k = sb + L::kK + t * DKP + sub;
      const float g = sb[L::kG + t], beta = sb[L::kB + t], v = sb[L::kV + t * L::kRows + row];
      // Two partial sums halve the dependent FMA chain; the order differs from the CPU twin only by rounding.
      float kst0 = 0.f, kst1 = 0.f;
#pragma unroll
      for (int i = 0; i < L::kElems; i += 2) {
        st[i] *= g;
        kst0 = fmaf(st[i], k[LANES * i], kst0);
        if (i + 1 < L::kElems) {
          st[i + 1] *= g;
          kst1 = fmaf(st[i + 1], k[LANES * (i + 1)], kst1);
        }
      }
      const float delta = beta * (v - group_sum<LANES>(kst0 + kst1));
      float o0 = 0.f, o1 = 0.f;
#pragma unroll
      for (int i = 0; i < L::kElems; i += 2) {
        st[i] = fmaf(delta, k[LANES * i], st[i]);
        o0 = fmaf(st[i], q[LANES * i], o0);
        if (i + 1 < L::kElems) {
          st[i + 1] = fmaf(delta, k[LANES * (i + 1)], st[i + 1]);
          o1 = fmaf(st[i + 1], q[LANES * (i + 1)], o1);
        }
      }
      const float o = group_sum<LANES>(o0 + o1);
      if (sub == 0 && dv < Dv) yp[(t0 + t) * y_stride] = o;
    }
    __syncthreads();  // buffer si & 1 is restaged by the next iteration
  }
  if (dv < Dv) {
#pragma unroll
    for (int i = 0; i < L::kElems; ++i)
      if (sub + LANES * i < Dk) sp[sub + LANES * i] = st[i];
  }
}

template <int LANES, int DKP>
void launch_seq(cudaStream_t st, const ScanArgs& args) {
  using L = SeqLayout<LANES, DKP>;
  set_smem(seq_scan_kernel<LANES, DKP>, L::kSmemBytes);
  const dim3 grid(static_cast<unsigned>((args.p.v_dim + L::kRows - 1) / L::kRows), args.p.v_heads);
  seq_scan_kernel<LANES, DKP><<<grid, kThreads, L::kSmemBytes, st>>>(args);
  LILY_LAUNCH_CHECK();
}

}  // namespace

void deltanet_scan_seq(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                       const float* dt_bias, const float* a_log, float* ssm, float* y, int lanes_per_row) {
  check_shape(p, "deltanet_scan_seq");
  if (p.S <= 0) return;
  const ScanArgs args{p, u, b, a, dt_bias, a_log, ssm, y, false};
  const int nk = (p.k_dim + 31) / 32;
  if (lanes_per_row == 16) {
    switch (nk) {
      case 1: return launch_seq<16, 32>(st, args);
      case 2: return launch_seq<16, 64>(st, args);
      case 3: return launch_seq<16, 96>(st, args);
      default: return launch_seq<16, 128>(st, args);
    }
  }
  if (lanes_per_row != 8) throw std::invalid_argument("[lily] cuda deltanet_scan_seq: lanes_per_row is 8 or 16");
  switch (nk) {
    case 1: return launch_seq<8, 32>(st, args);
    case 2: return launch_seq<8, 64>(st, args);
    case 3: return launch_seq<8, 96>(st, args);
    default: return launch_seq<8, 128>(st, args);
  }
}

}  // namespace lily::cuda
