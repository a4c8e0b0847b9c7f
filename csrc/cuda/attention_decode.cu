// Decode attention (one query row, S = 1) on the tensor cores, for GQA groups of exactly 8 query heads per KV head
// (the model's 16 / 2). Why: the CUDA-core decode kernel (attn_kernel in attention.cu) streams the cache at only
// ~1.3 TB/s at 128K keys because it is FMA-bound (a shuffle, a shared load and 8 FMAs per key per lane in the PV
// loop); here both products run as mma.sync m16n8k16 with the 8 heads as the N dimension, so no row is padding:
//   scores  S^T [keys, heads] = K [keys, D] . Q^T [D, heads]       A = K rows (row-major), B = Q rows
//   output  O^T [D, heads]   += V^T [D, keys] . P^T [keys, heads]   A = V by ldmatrix.trans, B = P rows
// Block = one KV head x one key split, 4 warps. A tile is 64 keys: warp w scores keys 16w..16w+15 over all of D and
// accumulates output dims [wD/4, (w+1)D/4) over all 64 keys. K/V tiles arrive by cp.async into two buffers (the
// next tile in flight while this one is used); rows past the split's last key are zero-filled (the cache may hold
// garbage there, and 0 * NaN would poison the PV product). Online softmax per head: every thread owns heads 2t and
// 2t+1 (t = lane % 4) in both products, so the running max, its correction and the partial sums need no shuffles
// between heads; tile maxima meet in shared memory. Writes the (m, l, o) partials of attn_kernel, merged by
// attn_combine_kernel. The decode default; flag gqa_pack=0 selects attn_kernel. H200: 90 vs 209 us at 128K keys.
// Rows (issue 43: a speculative verify, streams decoded together): p.S = M <= 8 query rows at positions pos0 .. pos0 +
// M - 1 (the cache holds their keys), one block row per query row (grid.x), each exactly the one-row launch at its
// position: its own key count, split length (from the fixed n_splits) and partials, so row m equals that launch bit
// for bit. The rows' blocks read the same split tiles close together in time (L2 serves the repeats).
#include "cuda/attention.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda {
namespace {

using namespace mma;

constexpr int kG = 8;        // query heads per KV head (the mma N dimension)
constexpr int kTile = 64;    // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPLd = kTile + 8;  // bf16 row stride of P [head][key]
constexpr int kMaxQueryRows = 8;

template <int D>
struct DecodeTcLayout {
  static constexpr int kLd = D + 8;  // bf16 row stride of K, V, Q: 16-byte rows, ldmatrix rows on distinct banks
  static constexpr size_t kKV = static_cast<size_t>(kTile) * kLd;  // one K or V tile, elements
  static constexpr size_t kSmemBytes =
      (4 * kKV + kG * kLd + kG * kPLd) * sizeof(bf16) + 2 * kWarps * kG * sizeof(float);
};

template <int D>
__global__ void __launch_bounds__(kThreads) attn_decode_tc_kernel(kp::AttentionParams p, kp::AttnSplitParams sp,
                                                                   const float* q, const bf16* kc, const bf16* vc,
                                                                   float* part, const int32_t* dpos) {
  using L = DecodeTcLayout<D>;
  constexpr int LD = L::kLd;
  constexpr int kDimsPerWarp = D / kWarps;       // output dims of a warp
  constexpr int kMt = kDimsPerWarp / 16;         // its output m-tiles
  extern __shared__ __align__(16) unsigned char dtc_smem[];
  bf16* Kb = reinterpret_cast<bf16*>(dtc_smem);  // [2][kTile][LD]
  bf16* Vb = Kb + 2 * L::kKV;                    // [2][kTile][LD]
  bf16* Qs = Vb + 2 * L::kKV;                    // [kG][LD]
  bf16* Ps = Qs + kG * LD;                       // [kG][kPLd]
  float* red = reinterpret_cast<float*>(Ps + kG * kPLd);  // [kWarps][kG] tile maxima
  float* lsum = red + kWarps * kG;                         // [kWarps][kG] final sums
  pdl_trigger();
  pdl_wait();  // PDL launch (common.cuh): inputs are the previous kernel's
  const int row = blockIdx.x;  // query row: position pos0 + row
  q += static_cast<int64_t>(row) * p.n_heads * D;
  part += static_cast<int64_t>(row) * p.n_heads * sp.n_splits * (D + 2);
  if (dpos || p.S > 1) {  // decode graphs / rows: n_splits fixed, the split length from the row's key count
    p.pos0 = (dpos ? *dpos : p.pos0) + row;
    const int64_t keys = p.pos0 + 1;
    sp.split_len = static_cast<int32_t>(((keys + sp.n_splits - 1) / sp.n_splits + kTile - 1) / kTile * kTile);
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int kvh = blockIdx.y, s = blockIdx.z;
  const int64_t kv_row = static_cast<int64_t>(p.n_kv_heads) * D;
  const bf16* kbase = kc + static_cast<int64_t>(kvh) * D;
  const bf16* vbase = vc + static_cast<int64_t>(kvh) * D;
  const int64_t split0 = static_cast<int64_t>(s) * sp.split_len;
  const int64_t end = min64(split0 + sp.split_len, p.pos0 + 1);  // exclusive
  const int n_tiles = end > split0 ? static_cast<int>((end - split0 + kTile - 1) / kTile) : 0;

  auto issue = [&](int it) {
    const int64_t k0 = split0 + static_cast<int64_t>(it) * kTile;
    bf16* kd = Kb + (it & 1) * L::kKV;
    bf16* vd = Vb + (it & 1) * L::kKV;
    for (int u = tid; u < kTile * D / 8; u += kThreads) {
      const int r = u / (D / 8), c = u % (D / 8);
      const bool valid = k0 + r < end;
      const int64_t off = (valid ? k0 + r : 0) * kv_row + c * 8;
      cp_async16(smem_addr(kd + r * LD + c * 8), kbase + off, valid);
      cp_async16(smem_addr(vd + r * LD + c * 8), vbase + off, valid);
    }
    cp_async_commit();
  };
  if (n_tiles > 0) issue(0);
  // Q (fp32) of the 8 heads -> bf16 rows.
  for (int u = tid; u < kG * D / 2; u += kThreads) {
    const int hh = u / (D / 2), d = 2 * (u % (D / 2));
    const float2 v = *reinterpret_cast<const float2*>(q + static_cast<int64_t>(kvh * kG + hh) * D + d);
    *reinterpret_cast<uint32_t*>(Qs + hh * LD + d) = pack_bf16x2(v.x, v.y);
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // heads 2t, 2t+1
  float o[kMt][4];
#pragma unroll
  for (int i = 0; i < kMt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    const int64_t k0 = split0 + static_cast<int64_t>(it) * kTile;
    if (it + 1 < n_tiles) {
      issue(it + 1);  // its buffer was released by the barrier that ended tile it - 1
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile it (and Q, on the first pass) visible to every warp
    const bf16* Ks = Kb + (it & 1) * L::kKV;
    const bf16* Vs = Vb + (it & 1) * L::kKV;

    // Scores of keys 16w + {g, g + 8}, heads 2t, 2t + 1.
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const bf16* krow = Ks + (16 * warp + g) * LD + 2 * t;
    const bf16* qrow = Qs + g * LD + 2 * t;
#pragma unroll 4
    for (int k = 0; k < D; k += 16) {
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(krow + k);
      a[1] = *reinterpret_cast<const uint32_t*>(krow + 8 * LD + k);
      a[2] = *reinterpret_cast<const uint32_t*>(krow + k + 8);
      a[3] = *reinterpret_cast<const uint32_t*>(krow + 8 * LD + k + 8);
      mma_bf16(c, a, *reinterpret_cast<const uint32_t*>(qrow + k), *reinterpret_cast<const uint32_t*>(qrow + k + 8));
    }
    const bool va = k0 + 16 * warp + g < end, vb = k0 + 16 * warp + g + 8 < end;
    float sc[2][2];  // [key a/b][head 2t / 2t+1]
    sc[0][0] = va ? c[0] * p.scale : -INFINITY;
    sc[0][1] = va ? c[1] * p.scale : -INFINITY;
    sc[1][0] = vb ? c[2] * p.scale : -INFINITY;
    sc[1][1] = vb ? c[3] * p.scale : -INFINITY;
    float tm[2] = {fmaxf(sc[0][0], sc[1][0]), fmaxf(sc[0][1], sc[1][1])};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) tm[j] = fmaxf(tm[j], __shfl_xor_sync(0xffffffffu, tm[j], off));
    if (g == 0) red[warp * kG + 2 * t] = tm[0], red[warp * kG + 2 * t + 1] = tm[1];
    __syncthreads();
    float corr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mt = red[2 * t + j];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) mt = fmaxf(mt, red[w * kG + 2 * t + j]);
      const float mn = fmaxf(m[j], mt);  // finite: every tile holds at least one valid key
      corr[j] = expf(m[j] - mn);         // 0 on the first tile (m = -inf)
      const float pa = expf(sc[0][j] - mn), pb = expf(sc[1][j] - mn);
      l[j] = l[j] * corr[j] + pa + pb;
      Ps[(2 * t + j) * kPLd + 16 * warp + g] = __float2bfloat16(pa);
      Ps[(2 * t + j) * kPLd + 16 * warp + g + 8] = __float2bfloat16(pb);
      m[j] = mn;
    }
#pragma unroll
    for (int i = 0; i < kMt; ++i) o[i][0] *= corr[0], o[i][1] *= corr[1], o[i][2] *= corr[0], o[i][3] *= corr[1];
    __syncthreads();  // P complete; every warp has read this tile's maxima

    // O^T[dims of this warp, heads] += V^T . P^T over the tile's 64 keys.
    const int lr = lane % 8, lm = lane / 8;  // ldmatrix: row lr of matrix lm (keys +8 for lm >= 2, dims +8 odd lm)
#pragma unroll
    for (int kk = 0; kk < kTile; kk += 16) {
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(Ps + g * kPLd + kk + 2 * t);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(Ps + g * kPLd + kk + 2 * t + 8);
#pragma unroll
      for (int i = 0; i < kMt; ++i) {
        const int md = warp * kDimsPerWarp + 16 * i;
        uint32_t a[4];
        ldmatrix_x4_trans(a, smem_addr(Vs + (kk + lr + (lm >= 2 ? 8 : 0)) * LD + md + (lm & 1) * 8));
        mma_bf16(o[i], a, b0, b1);
      }
    }
    __syncthreads();  // every warp is done with buffer it & 1 (and with P and the maxima) before they are refilled
  }

  // l: the partial sums of keys g, g + 8 of every warp -> per-head totals.
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[j] += __shfl_xor_sync(0xffffffffu, l[j], off);
  if (g == 0) lsum[warp * kG + 2 * t] = l[0], lsum[warp * kG + 2 * t + 1] = l[1];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = kvh * kG + 2 * t + j;
    float* out = part + (static_cast<int64_t>(h) * sp.n_splits + s) * (D + 2);  // row t = 0 of [S, Hq, splits]
    if (warp == 0 && g == 0) {
      float lt = 0.f;
      for (int w = 0; w < kWarps; ++w) lt += lsum[w * kG + 2 * t + j];
      out[0] = m[j];
      out[1] = lt;
    }
#pragma unroll
    for (int i = 0; i < kMt; ++i) {
      const int md = warp * kDimsPerWarp + 16 * i;
      out[2 + md + g] = o[i][j];
      out[2 + md + g + 8] = o[i][2 + j];
    }
  }
}

template <int D>
void launch_decode_tc(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                      const bf16* kc, const bf16* vc, float* part, const int32_t* dpos) {
  constexpr size_t smem = DecodeTcLayout<D>::kSmemBytes;
  static const bool raised = [] {
    LILY_CUDA_CHECK(cudaFuncSetAttribute(attn_decode_tc_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    return true;
  }();
  (void)raised;
  const dim3 grid(static_cast<unsigned>(p.S), static_cast<unsigned>(p.n_kv_heads), static_cast<unsigned>(sp.n_splits));
  launch_pdl(attn_decode_tc_kernel<D>, grid, dim3(kThreads), smem, st, p, sp, q, kc, vc, part, dpos);
}

}  // namespace

bool attention_decode_tc_supported(const kp::AttentionParams& p) {
  return p.S >= 1 && p.S <= kMaxQueryRows && p.n_kv_heads > 0 && p.n_heads == kG * p.n_kv_heads &&
         (p.head_dim == 128 || p.head_dim == 256);
}

void attention_decode_tc(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                         const bf16* kc, const bf16* vc, float* part, const int32_t* dpos) {
  if (!attention_decode_tc_supported(p))
    throw std::invalid_argument("[lily] cuda attention_decode_tc: needs 1 to 8 query rows, 8 query heads per KV head "
                                "and head_dim 128 or 256");
  if (p.head_dim == 256) launch_decode_tc<256>(st, p, sp, q, kc, vc, part, dpos);
  else launch_decode_tc<128>(st, p, sp, q, kc, vc, part, dpos);
}

}  // namespace lily::cuda
