// Tensor-core causal flash attention for prefill chunks (S > 1): FlashAttention-2 style with
// mma.sync m16n8k16 bf16 (fp32 accumulation), online softmax in the log2 domain, cp.async double buffering.
//
// Block = 128 "flat rows" x one KV head x one key split. Flat row f of KV head g is (token t = f / G,
// query head h = g*G + f % G): the G query heads that share a KV head are packed into the M dimension, so
// every K/V tile loaded to shared memory feeds 128 rows (G = 8: 16 tokens x 8 heads) and the causal
// diagonal of a block spans only 128 / G tokens. Each of the 8 warps owns 16 flat rows and the full head
// dim of their output (O: 16 x D fp32 in registers, D / 2 floats per thread).
// Row f attends keys [split0, min(split0 + split_len, pos0 + t + 1)); keys past the block's last valid key
// are zero-filled in shared memory (the cache rows there may hold garbage, even NaN).
// With one split the kernel applies the sigmoid gate and writes bf16 o; with several it writes the same
// (m, l, o) partials as attn_kernel, merged by attn_combine_kernel in attention.cu. The softmax step and the epilogue
// are shared with the wgmma kernel (attention_prefill.cuh).
#include "cuda/attention_prefill.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRows = 16 * kWarps;  // flat (token, head) rows per block

// Keys per shared-memory tile. D = 256 keeps 32 so O (128 regs) + S fit in 255 registers without spills.
template <int D>
struct MmaTile {
  static constexpr int kKeys = D >= 256 ? 32 : 64;
  static constexpr int kLd = D + 8;  // bf16 row stride: +16 bytes, so 8 rows of an ldmatrix hit 8 distinct bank quads
  static constexpr size_t kSmemBytes = static_cast<size_t>(kRows + 4 * kKeys) * kLd * sizeof(bf16);
};

using namespace mma;  // cp.async, ldmatrix, mma.sync helpers (mma_bf16.cuh)

template <int D>
__global__ void __launch_bounds__(kWarps * 32, 1) attn_mma_kernel(const AttnPrefillArgs a) {
  constexpr int BC = MmaTile<D>::kKeys, LD = MmaTile<D>::kLd;
  constexpr int NT = BC / 8;   // score n-tiles per warp
  constexpr int ND = D / 8;    // output n-tiles per warp
  constexpr int KD = D / 16;   // k-steps of QK^T
  constexpr int kThreads = kWarps * 32;
  extern __shared__ __align__(16) unsigned char attn_mma_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_mma_smem);  // [kRows, LD]
  bf16* Ks = Qs + kRows * LD;                          // [2 stages][BC, LD]
  bf16* Vs = Ks + 2 * BC * LD;                         // [2 stages][BC, LD]

  const kp::AttentionParams& p = a.p;
  const int G = p.n_heads / p.n_kv_heads;
  const int64_t n_flat = p.S * G;
  const int64_t f0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kRows;  // latest (heaviest) rows first
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int64_t kv_stride = static_cast<int64_t>(p.n_kv_heads) * D;
  const bf16* kbase = a.kc + static_cast<int64_t>(kvh) * D;
  const bf16* vbase = a.vc + static_cast<int64_t>(kvh) * D;
  const int64_t split0 = static_cast<int64_t>(split) * a.sp.split_len;
  const int64_t split_end = split0 + a.sp.split_len;
  const int64_t t_last = (min64(f0 + kRows, n_flat) - 1) / G;
  const int64_t block_end = min64(split_end, p.pos0 + t_last + 1);  // exclusive; keys past it are zero-filled
  const int64_t n_tiles = block_end > split0 ? (block_end - split0 + BC - 1) / BC : 0;

  auto load_kv = [&](int64_t k0, int stage) {
    bf16* kd = Ks + stage * BC * LD;
    bf16* vd = Vs + stage * BC * LD;
#pragma unroll
    for (int u = threadIdx.x; u < BC * D / 8; u += kThreads) {
      const int r = u / (D / 8), c = u % (D / 8);
      const bool valid = k0 + r < block_end;
      const int64_t off = (valid ? k0 + r : 0) * kv_stride + c * 8;
      cp_async16(smem_addr(kd + r * LD + c * 8), kbase + off, valid);
      cp_async16(smem_addr(vd + r * LD + c * 8), vbase + off, valid);
    }
  };
  if (n_tiles > 0) load_kv(split0, 0);
  cp_async_commit();

  // Q (fp32) -> bf16 shared tile; rows past S*G are zero (their scores are finite and never written).
  for (int u = threadIdx.x; u < kRows * D / 4; u += kThreads) {
    const int r = u / (D / 4), c = u % (D / 4);
    const int64_t f = f0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (f < n_flat) {
      const int64_t t = f / G, h = static_cast<int64_t>(kvh) * G + f % G;
      v = *reinterpret_cast<const float4*>(a.q + (t * p.n_heads + h) * D + c * 4);
    }
    uint2 packed;
    packed.x = pack_bf16x2(v.x, v.y);
    packed.y = pack_bf16x2(v.z, v.w);
    *reinterpret_cast<uint2*>(Qs + r * LD + c * 4) = packed;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: row group, thread in group
  const int64_t wf0 = f0 + warp * 16;         // the warp's first flat row
  const bool warp_active = wf0 < n_flat;
  // Key limits (exclusive): rows gid and gid + 8 of the warp; the warp's smallest and largest limit.
  auto row_limit = [&](int64_t f) { return f < n_flat ? min64(split_end, p.pos0 + f / G + 1) : split_end; };
  const int64_t lim0 = row_limit(wf0 + gid), lim1 = row_limit(wf0 + gid + 8);
  const int64_t warp_lo = row_limit(wf0), warp_hi = row_limit(min64(wf0 + 15, n_flat - 1));
  const float sl2 = p.scale * kAttnLog2e;  // scores in log2 units: exp2f(s * sl2 - m)

  float oacc[ND][4];
#pragma unroll
  for (int j = 0; j < ND; ++j) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // l: this thread's columns only (quad-summed at the end)

  const uint32_t q_lane = smem_addr(Qs + (warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8);
  const int k_lane_off = ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8;
  const int v_lane_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8;

  for (int64_t i = 0; i < n_tiles; ++i) {
    const int stage = static_cast<int>(i & 1);
    const int64_t k0 = split0 + i * BC;
    if (i + 1 < n_tiles) load_kv(k0 + BC, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed (the next one may still be in flight)
    __syncthreads();
    if (warp_active && k0 < warp_hi) {
      const uint32_t k_addr = smem_addr(Ks + stage * BC * LD + k_lane_off);
      const uint32_t v_addr = smem_addr(Vs + stage * BC * LD + v_lane_off);
      float s[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kd = 0; kd < KD; ++kd) {
        uint32_t qa[4];
        ldmatrix_x4(qa, q_lane + kd * 32);
#pragma unroll
        for (int nb = 0; nb < NT / 2; ++nb) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k_addr + (nb * 16 * LD + kd * 16) * 2);
          mma_bf16(s[2 * nb], qa, kb[0], kb[1]);
          mma_bf16(s[2 * nb + 1], qa, kb[2], kb[3]);
        }
      }
      // Only tiles that cross the warp's smallest limit need the mask.
      float(&sv)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(s);  // s[n][e] is sv[4 n + e]
      float mu0, mu1, corr0, corr1;
      softmax_max(sv, sl2, k0 + BC > warp_lo, k0, tig, lim0, lim1, m0, m1, mu0, mu1, corr0, corr1);
      // Rescaling O costs D/2 multiplies per thread; late in a long row the max rarely moves, so skip it
      // when no row of the warp changed (corr == 1 exactly).
      if (__any_sync(0xffffffffu, corr0 != 1.f || corr1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < ND; ++j) {
          oacc[j][0] *= corr0, oacc[j][1] *= corr0;
          oacc[j][2] *= corr1, oacc[j][3] *= corr1;
        }
      }
      softmax_exp(sv, mu0, mu1, corr0, corr1, l0, l1);
      // O += P V: the score accumulators of n-tiles (2kk, 2kk+1) are exactly the A fragment of keys 16kk..16kk+15.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int db = 0; db < ND / 2; ++db) {
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, v_addr + (kk * 16 * LD + db * 16) * 2);
          mma_bf16(oacc[2 * db], pa, vb[0], vb[1]);
          mma_bf16(oacc[2 * db + 1], pa, vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  if (!warp_active) return;

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t f = wf0 + gid + 8 * half;
    const float(&acc)[D / 2] = reinterpret_cast<const float(&)[D / 2]>(oacc);  // oacc[j][e] is acc[4 j + e]
    if (f < n_flat) prefill_store_row<D>(a, f, G, kvh, split, half, tig, half ? m1 : m0, half ? l1 : l0, acc);
  }
}

template <int D>
void launch_attn_mma(cudaStream_t st, const AttnPrefillArgs& a) {
  const size_t smem = MmaTile<D>::kSmemBytes;
  LILY_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  const int G = a.p.n_heads / a.p.n_kv_heads;
  const int64_t row_tiles = (a.p.S * G + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(row_tiles), a.p.n_kv_heads, a.sp.n_splits);
  attn_mma_kernel<D><<<grid, kWarps * 32, smem, st>>>(a);
  LILY_LAUNCH_CHECK();
}

}  // namespace

bool attention_mma_supported(const kp::AttentionParams& p) {
  const int D = p.head_dim;
  return (D == 32 || D == 64 || D == 128 || D == 256) && p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0;
}

kp::AttnSplitParams attention_mma_plan(const kp::AttentionParams& p, int sm_count) {
  kp::AttnSplitParams sp{};
  const int64_t G = p.n_heads / p.n_kv_heads, keys = p.pos0 + p.S;
  const int64_t blocks = (p.S * G + kRows - 1) / kRows * p.n_kv_heads;
  // One resident block per SM (registers: 147..244 per thread x 256 threads for D >= 64). Split the keys
  // only when the row tiles alone leave SMs idle: then aim at ~4 waves (so the tail wave is a small
  // fraction) with at least 512 keys per split, so the partial traffic stays negligible.
  int64_t n = 1;
  if (blocks < sm_count) n = std::clamp<int64_t>((4LL * sm_count + blocks - 1) / blocks, 1, (keys + 511) / 512);
  const int64_t len = ((keys + n - 1) / n + 63) / 64 * 64;  // a multiple of 64 (attn_kernel needs 32)
  sp.split_len = static_cast<int32_t>(len);
  sp.n_splits = static_cast<int32_t>((keys + len - 1) / len);
  sp.rows_per_block = G >= 8 ? 1 : static_cast<int32_t>(8 / G);  // attn_kernel's value: the plan also serves impl 0
  return sp;
}

void attention_mma(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                   const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o, bool wgmma) {
  const AttnPrefillArgs a{p, sp, q, qg, k_cache, v_cache, part, o};
  if (wgmma && attention_wgmma_supported(p)) return attention_wgmma(st, a);
  switch (p.head_dim) {
    case 32: launch_attn_mma<32>(st, a); break;
    case 64: launch_attn_mma<64>(st, a); break;
    case 128: launch_attn_mma<128>(st, a); break;
    case 256: launch_attn_mma<256>(st, a); break;
    default: throw std::invalid_argument("[lily] cuda attention_mma: head_dim must be 32, 64, 128 or 256");
  }
}

}  // namespace lily::cuda
