// Linear layers (gemm.cuh): the dispatch, the one-row GEMV and the wmma fallback GEMM (the mma.sync GEMM is
// gemm_mma.cu, the wgmma GEMM gemm_wgmma.cu).
#include <mma.h>

#include "cuda/gemm.cuh"

namespace lily::cuda {
namespace {

constexpr int kGemvWarps = 8;
constexpr int BM = kGemmBM, BN = 64, BK = 64;
constexpr int LDS = BK + 8;  // bf16 row stride of the A/B tiles (pad against bank conflicts; wmma needs %8)
constexpr int LDC = BN + 4;  // fp32 row stride of the epilogue tile

// Partial dots of NR consecutive weight rows [row0, row0 + NR) of expert e with xs (bf16 [in], shared memory),
// one lane's share each (reduce over the warp afterwards). Quantized rows: each lane reads one 16-byte chunk
// per row per step (32 4-bit or 16 8-bit codes), NR rows at once so 16*NR bytes are in flight per lane.
// Codes become floats without I2F: (code << shift) | 0x3F800000 is the float 1 + code/2^bits, and
//   sum_i (s q_i + b) x_i = s 2^bits sum_i (1 + q_i/2^bits) x_i + (b - s 2^bits) sum_i x_i.
template <int NR, int BITS>
__device__ __forceinline__ void quant_rows(const DLinear& W, int64_t e, int64_t row0, const bf16* xs, int lane,
                                           float acc[NR]) {
  constexpr int VPC = 128 / BITS, VPW = 32 / BITS;  // values per chunk, per word
  constexpr float SCALE = static_cast<float>(1 << BITS);
  constexpr uint32_t MASK = ((1u << BITS) - 1u) << (23 - BITS);
  const kp::LinearParams& p = W.p;
  const int64_t cpr = p.in / VPC, gpr = p.in / p.group;
  const int cpg = p.group / VPC;
  const uint4* base = reinterpret_cast<const uint4*>(W.codes + e * p.expert_words);
  const uint16_t* sc = W.scales + e * p.expert_groups;
  const uint16_t* bi = W.biases + e * p.expert_groups;
  int64_t rows[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) rows[i] = min64(row0 + i, p.out - 1);
  for (int64_t ch = lane; ch < cpr; ch += 32) {
    uint4 q[NR];
    float s[NR], b[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      q[i] = __ldg(base + rows[i] * cpr + ch);
      const int64_t g = rows[i] * gpr + ch / cpg;
      s[i] = bf2f(sc[g]);
      b[i] = bf2f(bi[g]);
    }
    float x[VPC];
    float sx = 0.f;
#pragma unroll
    for (int u = 0; u < VPC / 8; ++u) {
      const uint4 xv = reinterpret_cast<const uint4*>(xs + ch * VPC)[u];
      const uint32_t w4[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[8 * u + 2 * j] = __uint_as_float(w4[j] << 16);
        x[8 * u + 2 * j + 1] = __uint_as_float(w4[j] & 0xFFFF0000u);
        sx += x[8 * u + 2 * j] + x[8 * u + 2 * j + 1];
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const uint32_t qw[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
      float d = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < VPW; ++j) {
          const int sh = (23 - BITS) - BITS * j;  // moves code j to the top mantissa bits
          const uint32_t m = (sh >= 0 ? qw[w] << sh : qw[w] >> -sh) & MASK;
          d += __uint_as_float(m | 0x3F800000u) * x[w * VPW + j];
        }
      acc[i] += s[i] * SCALE * d + (b[i] - SCALE * s[i]) * sx;
    }
  }
}

template <int NR>
__device__ __forceinline__ void warp_rows(const DLinear& W, int64_t e, int64_t row0, const bf16* xs, int lane,
                                          float acc[NR]) {
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.f;
  const kp::LinearParams& p = W.p;
  if (p.kind == 0) {
    if (p.bits == 4) quant_rows<NR, 4>(W, e, row0, xs, lane, acc);
    else quant_rows<NR, 8>(W, e, row0, xs, lane, acc);
    return;
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int64_t row = min64(row0 + i, p.out - 1);
    if (p.kind == 1) {
      const uint16_t* d = static_cast<const uint16_t*>(W.dense) + e * p.expert_elems + row * p.in;
      for (int64_t k = lane; k < p.in; k += 32) acc[i] += bf2f(d[k]) * bf2f(xs[k]);
    } else {
      const float* d = static_cast<const float*>(W.dense) + e * p.expert_elems + row * p.in;
      for (int64_t k = lane; k < p.in; k += 32) acc[i] += d[k] * bf2f(xs[k]);
    }
  }
}

// One activation row per blockIdx.y (slot j: the token, or the j-th routed expert of a token);
// each warp computes NR consecutive output rows. DUAL: yb = bf16(silu(x W0^T) * (x W1^T)); else yb (when set) =
// bf16(scale x W0^T), or y (=|+=) scale x W0^T.
template <int NR, bool DUAL>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(DLinear W0, DLinear W1, const bf16* x, int64_t x_step, const int32_t* ids, float* y, bf16* yb,
                int64_t y_step, const float* scale, int accumulate) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* xs = reinterpret_cast<bf16*>(smem_raw);
  const int j = blockIdx.y;
  const int64_t in = W0.p.in, out = W0.p.out;
  const bf16* xj = x + j * x_step;
  for (int64_t i = threadIdx.x; i < in; i += blockDim.x) xs[i] = xj[i];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * NR;
  if (row0 >= out) return;
  const int64_t e = ids ? ids[j] : 0;
  float a0[NR], a1[NR];
  warp_rows<NR>(W0, e, row0, xs, lane, a0);
  if constexpr (DUAL) warp_rows<NR>(W1, e, row0, xs, lane, a1);
  const float sc = scale ? scale[j] : 1.f;
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const float r0 = warp_sum(a0[i]);
    const int64_t row = row0 + i;
    if constexpr (DUAL) {
      const float r1 = warp_sum(a1[i]);
      if (lane == 0 && row < out) yb[j * y_step + row] = __float2bfloat16(siluf_(r0) * r1);
    } else if (lane == 0 && row < out) {
      if (yb) {
        yb[j * y_step + row] = __float2bfloat16(r0 * sc);
      } else {
        float* o = y + j * y_step + row;
        *o = accumulate ? *o + r0 * sc : r0 * sc;
      }
    }
  }
}

template <int NR, bool DUAL>
void launch_gemv_nr(cudaStream_t st, const DLinear& W0, const DLinear& W1, const bf16* x, int64_t x_step,
                    const int32_t* ids, int slots, float* y, bf16* yb, int64_t y_step, const float* scale,
                    bool accumulate) {
  const int64_t blocks = (W0.p.out + kGemvWarps * NR - 1) / (kGemvWarps * NR);
  const size_t smem = (W0.p.in * sizeof(bf16) + 15) / 16 * 16;
  gemv_kernel<NR, DUAL><<<dim3(static_cast<unsigned>(blocks), slots), kGemvWarps * 32, smem, st>>>(
      W0, W1, x, x_step, ids, y, yb, y_step, scale, accumulate ? 1 : 0);
  LILY_LAUNCH_CHECK();
}

template <bool DUAL>
void launch_gemv(cudaStream_t st, const DLinear& W0, const DLinear& W1, const bf16* x, int64_t x_step,
                 const int32_t* ids, int slots, float* y, bf16* yb, int64_t y_step, const float* scale,
                 bool accumulate) {
  // More rows per warp only where there are warps to spare: each warp then keeps more loads in flight.
  const int64_t rows = W0.p.out * slots;
  if (rows >= (1 << 16))
    launch_gemv_nr<4, DUAL>(st, W0, W1, x, x_step, ids, slots, y, yb, y_step, scale, accumulate);
  else if (rows >= (1 << 14))
    launch_gemv_nr<2, DUAL>(st, W0, W1, x, x_step, ids, slots, y, yb, y_step, scale, accumulate);
  else
    launch_gemv_nr<1, DUAL>(st, W0, W1, x, x_step, ids, slots, y, yb, y_step, scale, accumulate);
}

using namespace nvcuda;

// Tensor-core GEMM over a 64x64 output tile, 4 warps (each 32x32 = 2x2 wmma fragments of 16x16x16 bf16).
// The weight tile is dequantized into shared memory as bf16; A rows may be gathered (MoE pairs).
template <bool DUAL>
__global__ void __launch_bounds__(128)
    gemm_kernel(DLinear W0, DLinear W1, kp::GemmParams gp, GroupMap g, const bf16* A, float* y, bf16* yb) {
  constexpr int kTileBytes = BM * LDS * 2;
  constexpr int kMainBytes = kTileBytes * (DUAL ? 3 : 2);
  constexpr int kEpiBytes = BM * LDC * 4 * (DUAL ? 2 : 1);
  __shared__ __align__(128) unsigned char smem[kMainBytes > kEpiBytes ? kMainBytes : kEpiBytes];
  bf16* As = reinterpret_cast<bf16*>(smem);
  bf16* Bs0 = As + BM * LDS;
  bf16* Bs1 = Bs0 + BN * LDS;
  float* Cs = reinterpret_cast<float*>(smem);

  const int tid = threadIdx.x, warp = tid / 32, wm = warp / 2, wn = warp % 2;
  int64_t r0, e;
  int nrows;
  if (!gemm_tile_rows(gp, g, BM, r0, e, nrows)) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN, N = W0.p.out, K = W0.p.in;
  const bool vec_a = gp.lda % 8 == 0 && reinterpret_cast<uintptr_t>(A) % 16 == 0;
  const int c = tid % 8;  // 8-element column chunk this thread loads
  int64_t arow[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = tid / 8 + 16 * i;
    arow[i] = m < nrows ? (gp.grouped && g.a_rows ? g.a_rows[r0 + m] : r0 + m) : -1;
  }

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc0[2][2], acc1[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc0[i][j], 0.f);
      if constexpr (DUAL) wmma::fill_fragment(acc1[i][j], 0.f);
    }

  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    const int64_t kk = k0 + c * 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = tid / 8 + 16 * i;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (arow[i] >= 0 && kk < K) {
        const bf16* src = A + arow[i] * gp.lda + kk;
        if (vec_a && kk + 8 <= K) {
          v = *reinterpret_cast<const uint4*>(src);
        } else {
          bf16* vb = reinterpret_cast<bf16*>(&v);
          for (int j = 0; j < 8; ++j) vb[j] = kk + j < K ? src[j] : __float2bfloat16(0.f);
        }
      }
      *reinterpret_cast<uint4*>(As + m * LDS + c * 8) = v;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = tid / 8 + 16 * i;
      const bool ok = n0 + n < N && kk < K;
      float w[8];
      __nv_bfloat162 packed[4];
      if (ok) load_w8(W0, e, n0 + n, kk, w);
#pragma unroll
      for (int j = 0; j < 4; ++j) packed[j] = ok ? __floats2bfloat162_rn(w[2 * j], w[2 * j + 1]) : __nv_bfloat162{};
      *reinterpret_cast<uint4*>(Bs0 + n * LDS + c * 8) = *reinterpret_cast<uint4*>(packed);
      if constexpr (DUAL) {
        if (ok) load_w8(W1, e, n0 + n, kk, w);
#pragma unroll
        for (int j = 0; j < 4; ++j) packed[j] = ok ? __floats2bfloat162_rn(w[2 * j], w[2 * j + 1]) : __nv_bfloat162{};
        *reinterpret_cast<uint4*>(Bs1 + n * LDS + c * 8) = *reinterpret_cast<uint4*>(packed);
      }
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * LDS + ks, LDS);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], Bs0 + (wn * 32 + j * 16) * LDS + ks, LDS);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc0[i][j], a[i], b[j], acc0[i][j]);
      if constexpr (DUAL) {
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], Bs1 + (wn * 32 + j * 16) * LDS + ks, LDS);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc1[i][j], a[i], b[j], acc1[i][j]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc0[i][j], LDC, wmma::mem_row_major);
      if constexpr (DUAL)
        wmma::store_matrix_sync(Cs + BM * LDC + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc1[i][j], LDC,
                                wmma::mem_row_major);
    }
  __syncthreads();
  for (int idx = tid; idx < BM * BN; idx += 128) {
    const int m = idx / BN, n = idx % BN;
    if (m >= nrows || n0 + n >= N) continue;
    const int64_t pr = r0 + m;
    const int64_t orow = gp.grouped && g.y_rows ? g.y_rows[pr] : pr;
    const float v = Cs[m * LDC + n];
    if constexpr (DUAL) {
      yb[orow * gp.ldy + n0 + n] = __float2bfloat16(siluf_(v) * Cs[BM * LDC + m * LDC + n]);
    } else {
      const float r = v * (gp.grouped && g.scale ? g.scale[pr] : 1.f);
      if (yb) {  // the bf16 store
        yb[orow * gp.ldy + n0 + n] = __float2bfloat16(r);
        continue;
      }
      float* o = y + orow * gp.ldy + n0 + n;
      *o = gp.accumulate ? *o + r : r;
    }
  }
}

template <bool DUAL>
void launch_gemm(cudaStream_t st, const DLinear& W0, const DLinear& W1, const kp::GemmParams& gp, const GroupMap& g,
                 const bf16* A, float* y, bf16* yb) {
  const int64_t tiles = gp.grouped ? g.max_tiles : (gp.M + BM - 1) / BM;
  if (tiles == 0) return;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((W0.p.out + BN - 1) / BN));
  gemm_kernel<DUAL><<<grid, 128, 0, st>>>(W0, W1, gp, g, A, y, yb);
  LILY_LAUNCH_CHECK();
}

// Rows per tile of the mma GEMM for expert tiles of up to tile_rows pairs.
int expert_tile_bm(int tile_rows) {
  for (int bm = 16; bm <= 128; bm *= 2)
    if (tile_rows <= bm) return bm;
  throw std::invalid_argument("[lily] cuda grouped GEMM: tile_rows must be 1..128");
}

void check_wmma_tile(int tile_rows) {
  if (tile_rows > kGemmBM) throw std::invalid_argument("[lily] cuda grouped GEMM: the wmma path holds <= 64 rows per tile");
}

bool force_wmma = false;  // check programs only (force_gemm_fallback)

// The mma GEMM takes the product unless its format or alignment needs the wmma fallback.
bool mma_takes(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda) {
  return !force_wmma && gemm_mma_supported(W0, W1, A, lda);
}

// The wgmma GEMM takes products of `rows` rows per tile (plain M or expert tile rows) from 64 up; plain products
// when its tiles (64/128 rows x 128 outputs at least) reach a quarter of the SMs, or when the product has at most
// 64 outputs. The mma GEMM shrinks its row tiles to fill the GPU, which pays for wide products (A/B on the H200,
// compare_builds_chunk_h200.json: half the SMs sent the 512-output k/v and shared gate/up at 2,048 rows (64 CTAs)
// back to the mma GEMM, 28 -> 37 us each, 0.95x on a 4K prefill), but each of its 16-row tiles still runs a full
// K pass: the 32-output DeltaNet b and a took 173-177 us at 4,096 rows there (256 CTAs, SM 11%, H200 ncu) where
// the wgmma GEMM's 128-row tiles took 35 us at 2,048 rows (16 CTAs).
bool wgmma_takes(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda, int64_t rows, bool plain) {
  if (force_wmma || rows < 64 || !gemm_wgmma_supported(W0, W1, A, lda)) return false;
  const int64_t tiles = (rows + (rows >= 128 ? 127 : 63)) / (rows >= 128 ? 128 : 64);
  return !plain || W0.p.out <= 64 || tiles * ((W0.p.out + 127) / 128) * 4 >= device_sm_count();
}
}  // namespace

void force_gemm_fallback(bool on) { force_wmma = on; }

int pick_expert_tile(int64_t pairs, int n_experts) {
  // Average pairs per expert; routing is uneven, so round down (a half-empty big tile wastes more than the
  // extra weight reads of two small ones).
  const int64_t avg = pairs / (n_experts > 0 ? n_experts : 1);
  if (avg >= 96) return 128;
  if (avg >= 40) return 64;
  if (avg >= 20) return 32;
  return 16;
}

int64_t grouped_max_tiles(int64_t pairs, int n_experts, int tile_rows) {
  return (pairs + tile_rows - 1) / tile_rows + n_experts;
}

void linear(cudaStream_t st, const DLinear& W, const bf16* x, int64_t ldx, int64_t S, float* y, int64_t ldy,
            bool accumulate) {
  if (S == 1) return launch_gemv<false>(st, W, W, x, 0, nullptr, 1, y, nullptr, 0, nullptr, accumulate);
  if (!force_wmma && one_output_supported(W, x, ldx)) return linear_one_output(st, W, x, ldx, S, y, ldy, accumulate);
  kp::GemmParams gp{S, ldx, ldy, 0, accumulate ? 1 : 0};
  if (wgmma_takes(W, nullptr, x, ldx, S, true))
    return gemm_wgmma(st, GemmMmaArgs{W, W, gp, GroupMap{}, x, y, nullptr}, false, S >= 128 ? 128 : 64);
  if (mma_takes(W, nullptr, x, ldx))
    return gemm_mma(st, GemmMmaArgs{W, W, gp, GroupMap{}, x, y, nullptr}, false, gemm_mma_plain_rows(S, W.p.out, false));
  launch_gemm<false>(st, W, W, gp, GroupMap{}, x, y, nullptr);
}

void linear_concat(cudaStream_t st, const DLinear& concat, const DLinear* parts, int n_parts, const bf16* x,
                    int64_t ldx, int64_t S, float* const* y, const int64_t* ldy) {
  if (n_parts < 1 || n_parts > kMaxConcat) throw std::invalid_argument("[lily] cuda linear_concat: 1 to 4 parts");
  const bool wgmma = concat.codes != nullptr && S > 1 && wgmma_takes(concat, nullptr, x, ldx, S, true);
  if (wgmma || (concat.codes != nullptr && S > 1 && mma_takes(concat, nullptr, x, ldx))) {
    ConcatOut so;
    so.parts = n_parts;
    for (int i = 0; i < n_parts; ++i) {
      so.begin[i + 1] = so.begin[i] + parts[i].p.out;
      so.y[i] = y[i];
      so.ldy[i] = ldy[i];
    }
    for (int i = n_parts + 1; i <= kMaxConcat; ++i) so.begin[i] = INT64_MAX;  // the kernel's part search stops here
    if (so.begin[n_parts] != concat.p.out)
      throw std::invalid_argument("[lily] cuda linear_concat: the parts' rows do not add up to the concatenation's");
    kp::GemmParams gp{S, ldx, 0, 0, 0};
    GemmMmaArgs a{concat, concat, gp, GroupMap{}, x, nullptr, nullptr};
    a.so = so;
    if (wgmma) return gemm_wgmma(st, a, false, S >= 128 ? 128 : 64);
    return gemm_mma(st, a, false, gemm_mma_plain_rows(S, concat.p.out, false));
  }
  for (int i = 0; i < n_parts; ++i) linear(st, parts[i], x, ldx, S, y[i], ldy[i], false);
}

void linear_silu_mul(cudaStream_t st, const DLinear& W0, const DLinear& W1, const bf16* x, int64_t ldx, int64_t S,
                     bf16* y, int64_t ldy) {
  if (S == 1) return launch_gemv<true>(st, W0, W1, x, 0, nullptr, 1, nullptr, y, 0, nullptr, false);
  kp::GemmParams gp{S, ldx, ldy, 0, 0};
  if (wgmma_takes(W0, &W1, x, ldx, S, true))
    return gemm_wgmma(st, GemmMmaArgs{W0, W1, gp, GroupMap{}, x, nullptr, y}, true, S >= 128 ? 128 : 64);
  if (mma_takes(W0, &W1, x, ldx))
    return gemm_mma(st, GemmMmaArgs{W0, W1, gp, GroupMap{}, x, nullptr, y}, true, gemm_mma_plain_rows(S, W0.p.out, true));
  launch_gemm<true>(st, W0, W1, gp, GroupMap{}, x, nullptr, y);
}

void experts_gate_up(cudaStream_t st, const DLinear& W0, const DLinear& W1, const int32_t* ids, int k, const bf16* x,
                     bf16* act) {
  launch_gemv<true>(st, W0, W1, x, 0, ids, k, nullptr, act, W0.p.out, nullptr, false);
}

void experts_down(cudaStream_t st, const DLinear& W2, const int32_t* ids, const float* w, int k, const bf16* act,
                  bf16* d) {
  launch_gemv<false>(st, W2, W2, act, W2.p.in, ids, k, nullptr, d, W2.p.out, w, false);
}

void grouped_gate_up(cudaStream_t st, const DLinear& W0, const DLinear& W1, const GroupMap& g, const bf16* h,
                     int64_t ldh, bf16* act, int tile_rows) {
  GroupMap m = g;
  m.y_rows = nullptr;
  m.scale = nullptr;
  kp::GemmParams gp{0, ldh, W0.p.out, 1, 0};
  if (wgmma_takes(W0, &W1, h, ldh, expert_tile_bm(tile_rows), false))
    return gemm_wgmma(st, GemmMmaArgs{W0, W1, gp, m, h, nullptr, act}, true, expert_tile_bm(tile_rows));
  if (mma_takes(W0, &W1, h, ldh))
    return gemm_mma(st, GemmMmaArgs{W0, W1, gp, m, h, nullptr, act}, true, expert_tile_bm(tile_rows));
  check_wmma_tile(tile_rows);
  launch_gemm<true>(st, W0, W1, gp, m, h, nullptr, act);
}

void grouped_down(cudaStream_t st, const DLinear& W2, const GroupMap& g, const bf16* act, bf16* d,
                  int tile_rows) {
  GroupMap m = g;
  m.a_rows = nullptr;
  kp::GemmParams gp{0, W2.p.in, W2.p.out, 1, 0};
  if (wgmma_takes(W2, nullptr, act, W2.p.in, expert_tile_bm(tile_rows), false))
    return gemm_wgmma(st, GemmMmaArgs{W2, W2, gp, m, act, nullptr, d}, false, expert_tile_bm(tile_rows));
  if (mma_takes(W2, nullptr, act, W2.p.in))
    return gemm_mma(st, GemmMmaArgs{W2, W2, gp, m, act, nullptr, d}, false, expert_tile_bm(tile_rows));
  check_wmma_tile(tile_rows);
  launch_gemm<false>(st, W2, W2, gp, m, act, nullptr, d);
}

}  // namespace lily::cuda
