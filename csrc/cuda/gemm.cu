// Linear layers (gemm.cuh): the dispatch, the one-row GEMV and the wmma fallback GEMM, then the mma.sync GEMM.
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
// each warp computes NR consecutive output rows. DUAL: y = bf16(silu(x W0^T) * (x W1^T)).
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
      float* o = y + j * y_step + row;
      *o = accumulate ? *o + r0 * sc : r0 * sc;
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
                  float* d) {
  launch_gemv<false>(st, W2, W2, act, W2.p.in, ids, k, d, nullptr, W2.p.out, w, false);
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

void grouped_down(cudaStream_t st, const DLinear& W2, const GroupMap& g, const bf16* act, float* d,
                  int tile_rows) {
  GroupMap m = g;
  m.a_rows = nullptr;
  kp::GemmParams gp{0, W2.p.in, W2.p.out, 1, 0};
  if (wgmma_takes(W2, nullptr, act, W2.p.in, expert_tile_bm(tile_rows), false))
    return gemm_wgmma(st, GemmMmaArgs{W2, W2, gp, m, act, d, nullptr}, false, expert_tile_bm(tile_rows));
  if (mma_takes(W2, nullptr, act, W2.p.in))
    return gemm_mma(st, GemmMmaArgs{W2, W2, gp, m, act, d, nullptr}, false, expert_tile_bm(tile_rows));
  check_wmma_tile(tile_rows);
  launch_gemm<false>(st, W2, W2, gp, m, act, d, nullptr);
}

// ==== the mma.sync GEMM (gemm_mma_* entry points; the dispatch above takes it wherever supported) ====
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kBK = 64;        // k per stage = quant group: one scale/bias per weight row per stage
constexpr int kBN = 128;       // weight rows per block (dual: 64 rows of W0, then the same 64 rows of W1)
constexpr int kStages = 4;

// Block tile BM x kBN x kBK over 8 warps. Each dequantized B fragment serves every m16 fragment of its warp
// (ALU cost per mma falls with rows per warp), each A fragment every n8 fragment (shared-memory bytes per
// mma fall with columns per warp): 2 x 4 warps from 64 rows up, 1 x 8 below.
//   shared stage: A [BM][64] bf16 (16-byte chunk c of row r stored at c ^ (r & 1): conflict-free LDS.128),
//                 codes [kBN][64*BITS/8 bytes], scales [kBN] bf16, biases [kBN] bf16.
template <int BM, int BITS>
struct MmaTile {
  static constexpr int kWarpsM = BM >= 64 ? 2 : 1;
  static constexpr int kWarpsN = 8 / kWarpsM;
  static constexpr int kWarpRows = BM / kWarpsM;
  static constexpr int kMF = kWarpRows / 16;        // m16 fragments per warp
  static constexpr int kNF = kBN / kWarpsN / 8;     // n8 fragments per warp
  static constexpr int kCodeRowBytes = kBK * BITS / 8;
  static constexpr int kABytes = BM * kBK * 2;
  static constexpr int kCodeBytes = kBN * kCodeRowBytes;
  static constexpr int kStageBytes = kABytes + kCodeBytes + 2 * kBN * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// c += a b for one m16n8k16 tile: a = A rows (g, g+8) x k pairs (lo, hi), b = the B k pairs (lo, hi).
__device__ __forceinline__ void mma_16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Bytes 2p, 2p+1 of an 8-bit word as bf16x2 s*q + b: 8-bit codes do not fit the bf16 mantissa, so the
// codes go through fp32 ((q | 0x4B000000) is the float 2^23 + q) and the fp32 fma rounds to bf16.
__device__ __forceinline__ uint32_t dequant8_pair(uint32_t w, int p, float s, float b) {
  const uint32_t sel0 = (2 * p) | 0x7440u, sel1 = (2 * p + 1) | 0x7440u;
  const float q0 = __uint_as_float(__byte_perm(w, 0x4B000000u, sel0)) - 8388608.f;
  const float q1 = __uint_as_float(__byte_perm(w, 0x4B000000u, sel1)) - 8388608.f;
  const __nv_bfloat162 r = __floats2bfloat162_rn(fmaf(s, q0, b), fmaf(s, q1, b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// K order inside a stage: mma reduces over k, so any permutation applied to both A and B is free. Thread t
// (lane % 4) of a warp owns stage columns [16t, 16t+16) (two 4-bit words, four 8-bit words of its weight
// row); mma step s (k16) takes physical columns 16t + 4s + {0,1} as its "lo" pair and +{2,3} as "hi".
// A loads become one LDS.128 per row per two steps; B needs no shuffles.
template <int BM, int BITS, bool DUAL>
__global__ void __launch_bounds__(kThreads, BM == 128 ? 1 : 2)
    gemm_mma_kernel(const GemmMmaArgs args) {
  using T = MmaTile<BM, BITS>;
  constexpr int kMF = T::kMF, kNF = T::kNF, kHalfNF = kNF / 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const kp::GemmParams& gp = args.gp;
  const GroupMap& g = args.g;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / T::kWarpsN, wn = warp % T::kWarpsN;
  const int gid = lane / 4, tig = lane % 4;

  int64_t r0, e;
  int nrows;
  if (!gemm_tile_rows(gp, g, BM, r0, e, nrows)) return;
  if (nrows <= 0) return;
  const int64_t N = args.W0.p.out, K = args.W0.p.in;
  const int KT = static_cast<int>(K / kBK);
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (DUAL ? kBN / 2 : kBN);
  const int64_t wpr = K * BITS / 32, gpr = K / kBK;  // u32 code words, groups per weight row
  const int64_t e_words = e * args.W0.p.expert_words, e_groups = e * args.W0.p.expert_groups;

  // Global sources of this thread's cp.async copies: fixed rows, advanced by one stage per k tile.
  // Rows past the tile or past N are clamped to valid ones; their results are never stored.
  constexpr int kAIters = (BM * 8 + kThreads - 1) / kThreads;
  const bool a_on = BM * 8 >= kThreads || tid < BM * 8;
  // Sources as 32-bit row indices / byte offsets inside one expert (bases stay in the parameter space):
  // fewer live registers, so the 64-row tiles fit two blocks per SM.
  uint32_t a_src[kAIters], a_dst[kAIters];
#pragma unroll
  for (int i = 0; i < kAIters; ++i) {
    const int idx = tid + i * kThreads, row = idx / 8, c = idx % 8;
    const int m = min(row, nrows - 1);
    const int64_t src_row = gp.grouped && g.a_rows ? g.a_rows[r0 + m] : r0 + m;
    a_src[i] = static_cast<uint32_t>(src_row);
    a_dst[i] = row * (kBK * 2) + ((c ^ (row & 1)) * 16);
  }
  constexpr int kCodeChunks = T::kCodeRowBytes / 16;
  constexpr int kBIters = kBN * kCodeChunks / kThreads;
  uint32_t b_src[kBIters], b_dst[kBIters];
#pragma unroll
  for (int i = 0; i < kBIters; ++i) {
    const int idx = tid + i * kThreads, row = idx / kCodeChunks, c = idx % kCodeChunks;
    const bool w1 = DUAL && row >= kBN / 2;
    const int64_t n = min64(n0 + (DUAL ? row % (kBN / 2) : row), N - 1);
    b_src[i] = static_cast<uint32_t>(n * wpr * 4 + c * 16) | (w1 ? 1u : 0u);
    b_dst[i] = T::kABytes + row * T::kCodeRowBytes + c * 16;
  }
  // Threads 0..127 load the scale of B row tid, threads 128..255 the bias of row tid - 128. A bf16 is below
  // cp.async's 4-byte minimum (and a 4-byte window could leave the tensor), so it goes through a register:
  // loaded when its stage's copies are issued, stored to shared memory after that iteration's mma work.
  const uint16_t* sb_src;
  {
    const int row = tid % kBN;
    const bool w1 = DUAL && row >= kBN / 2;
    const int64_t n = min64(n0 + (DUAL ? row % (kBN / 2) : row), N - 1);
    const uint16_t* base = tid < kBN ? (w1 ? args.W1.scales : args.W0.scales) : (w1 ? args.W1.biases : args.W0.biases);
    sb_src = base + e_groups + n * gpr;
  }
  const uint32_t sb_dst = T::kABytes + T::kCodeBytes + tid * 2;

  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto load_stage = [&](int kt, int slot) {
    const uint32_t st = smem_base + slot * T::kStageBytes;
#pragma unroll
    for (int i = 0; i < kAIters; ++i)
      if (a_on) cp_async16(st + a_dst[i], args.A + a_src[i] * gp.lda + (tid % 8) * 8 + kt * kBK);
#pragma unroll
    for (int i = 0; i < kBIters; ++i) {
      const unsigned char* codes =
          reinterpret_cast<const unsigned char*>((DUAL && (b_src[i] & 1u) ? args.W1.codes : args.W0.codes) + e_words);
      cp_async16(st + b_dst[i], codes + (b_src[i] & ~1u) + kt * T::kCodeRowBytes);
    }
  };
  auto store_sb = [&](int slot, uint16_t v) {
    *reinterpret_cast<uint16_t*>(smem + slot * T::kStageBytes + sb_dst) = v;
  };

  // B tile row read by this thread for fragment j (its weight row is the thread's mma column gid).
  int b_row[kNF];
#pragma unroll
  for (int j = 0; j < kNF; ++j)
    b_row[j] = DUAL ? (j >= kHalfNF ? kBN / 2 : 0) + (wn * kHalfNF + j % kHalfNF) * 8 + gid : (wn * kNF + j) * 8 + gid;

  float acc[kMF][kNF][4];
#pragma unroll
  for (int i = 0; i < kMF; ++i)
#pragma unroll
    for (int j = 0; j < kNF; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) {
      load_stage(s, s);
      store_sb(s, __ldg(sb_src + s));
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    // The slot refilled here was read in iteration kt - 1, which every thread has finished.
    const int nk = kt + kStages - 1;
    uint16_t sb_next = 0;
    if (nk < KT) {
      load_stage(nk, nk % kStages);
      sb_next = __ldg(sb_src + nk);
    }
    cp_async_commit();

    const unsigned char* st = smem + (kt % kStages) * T::kStageBytes;
    const uint16_t* s_sb = reinterpret_cast<const uint16_t*>(st + T::kABytes + T::kCodeBytes);
    uint32_t r_s[kNF], r_b[kNF];  // this row's scale and bias as bf16x2 (both halves)
#pragma unroll
    for (int j = 0; j < kNF; ++j) {
      r_s[j] = __byte_perm(s_sb[b_row[j]], 0u, 0x1010u);
      r_b[j] = __byte_perm(s_sb[kBN + b_row[j]], 0u, 0x1010u);
    }
    uint32_t r_q[kNF][BITS / 2];  // this thread's code words of stage columns [16 tig, 16 tig + 16)
#pragma unroll
    for (int j = 0; j < kNF; ++j) {
      const unsigned char* q = st + T::kABytes + b_row[j] * T::kCodeRowBytes + tig * (BITS * 2);
      if constexpr (BITS == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(q);
        r_q[j][0] = v.x, r_q[j][1] = v.y;
      } else {
        const uint4 v = *reinterpret_cast<const uint4*>(q);
        r_q[j][0] = v.x, r_q[j][1] = v.y, r_q[j][2] = v.z, r_q[j][3] = v.w;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint4 r_a[kMF][2];  // rows (g, g+8) of each m16 fragment, physical columns 16 tig + 8h + [0, 8)
#pragma unroll
      for (int i = 0; i < kMF; ++i)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = wm * T::kWarpRows + 16 * i + 8 * rr + gid;
          r_a[i][rr] = *reinterpret_cast<const uint4*>(st + row * (kBK * 2) + (((2 * tig + h) ^ (row & 1)) * 16));
        }
#pragma unroll
      for (int ss = 0; ss < 2; ++ss) {
        uint32_t r_w[kNF][2];
#pragma unroll
        for (int j = 0; j < kNF; ++j) {
          if constexpr (BITS == 4) {
            const uint32_t w = r_q[j][h];
            r_w[j][0] = dequant4_pair(w, w >> 4, 2 * ss, r_s[j], r_b[j]);
            r_w[j][1] = dequant4_pair(w, w >> 4, 2 * ss + 1, r_s[j], r_b[j]);
          } else {
            const uint32_t w = r_q[j][2 * h + ss];
            const float sf = __uint_as_float(r_s[j] << 16), bf = __uint_as_float(r_b[j] << 16);
            r_w[j][0] = dequant8_pair(w, 0, sf, bf);
            r_w[j][1] = dequant8_pair(w, 1, sf, bf);
          }
        }
#pragma unroll
        for (int i = 0; i < kMF; ++i) {
          const uint32_t lo0 = ss ? r_a[i][0].z : r_a[i][0].x, hi0 = ss ? r_a[i][0].w : r_a[i][0].y;
          const uint32_t lo1 = ss ? r_a[i][1].z : r_a[i][1].x, hi1 = ss ? r_a[i][1].w : r_a[i][1].y;
#pragma unroll
          for (int j = 0; j < kNF; ++j) mma_16816(acc[i][j], lo0, lo1, hi0, hi1, r_w[j][0], r_w[j][1]);
        }
      }
    }
    // Slot nk was last read in iteration kt - 1; the next barrier publishes the value before iteration nk.
    if (nk < KT) store_sb(nk % kStages, sb_next);
  }
  cp_async_wait<0>();

  // Epilogue from registers: thread holds columns (2 tig, 2 tig + 1) of rows g and g + 8 per fragment.
  const int64_t ldy = gp.ldy;
  const bool vec = ldy % 2 == 0 && (DUAL ? reinterpret_cast<uintptr_t>(args.yb) % 4 == 0
                                         : reinterpret_cast<uintptr_t>(args.y) % 8 == 0);
#pragma unroll
  for (int i = 0; i < kMF; ++i)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int m = wm * T::kWarpRows + 16 * i + 8 * rr + gid;
      if (m >= nrows) continue;
      const int64_t pr = r0 + m;
      const int64_t orow = gp.grouped && g.y_rows ? g.y_rows[pr] : pr;
      if constexpr (DUAL) {
#pragma unroll
        for (int j = 0; j < kHalfNF; ++j) {
          const int64_t col = n0 + (wn * kHalfNF + j) * 8 + 2 * tig;
          const float o0 = siluf_(acc[i][j][2 * rr]) * acc[i][j + kHalfNF][2 * rr];
          const float o1 = siluf_(acc[i][j][2 * rr + 1]) * acc[i][j + kHalfNF][2 * rr + 1];
          bf16* dst = args.yb + orow * ldy + col;
          if (vec && col + 1 < N) {
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(o0, o1);
          } else {
            if (col < N) dst[0] = __float2bfloat16(o0);
            if (col + 1 < N) dst[1] = __float2bfloat16(o1);
          }
        }
      } else {
        const float sc = gp.grouped && g.scale ? g.scale[pr] : 1.f;
#pragma unroll
        for (int j = 0; j < kNF; ++j) {
          const int64_t col = n0 + (wn * kNF + j) * 8 + 2 * tig;
          float o0 = acc[i][j][2 * rr] * sc, o1 = acc[i][j][2 * rr + 1] * sc;
          if (args.so.parts > 0) {  // a concatenation's parts (plain store): each column to its part, parts meet anywhere
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const int64_t n = col + x;
              if (n >= N) continue;
              const int q = args.so.part(n);
              args.so.y[q][orow * args.so.ldy[q] + n - args.so.begin[q]] = x ? o1 : o0;
            }
            continue;
          }
          float* dst = args.y + orow * ldy + col;
          if (vec && col + 1 < N) {
            float2* d2 = reinterpret_cast<float2*>(dst);
            if (gp.accumulate) {
              const float2 old = *d2;
              o0 += old.x, o1 += old.y;
            }
            *d2 = make_float2(o0, o1);
          } else {
            if (col < N) dst[0] = gp.accumulate ? dst[0] + o0 : o0;
            if (col + 1 < N) dst[1] = gp.accumulate ? dst[1] + o1 : o1;
          }
        }
      }
    }
}

template <int BM, int BITS, bool DUAL>
void launch_mma(cudaStream_t st, const GemmMmaArgs& a) {
  using T = MmaTile<BM, BITS>;
  auto* kernel = gemm_mma_kernel<BM, BITS, DUAL>;
  static const bool attr_set = [kernel] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes),
          "gemm_mma smem attribute");
    return true;
  }();
  (void)attr_set;
  const int64_t tiles = a.gp.grouped ? a.g.max_tiles : (a.gp.M + BM - 1) / BM;
  const int64_t cols = DUAL ? kBN / 2 : kBN;
  const int64_t nblocks = (a.W0.p.out + cols - 1) / cols;
  if (tiles <= 0 || nblocks <= 0) return;
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(nblocks)), kThreads, T::kSmemBytes, st>>>(a);
  LILY_LAUNCH_CHECK();
}

template <int BITS, bool DUAL>
void launch_bm(cudaStream_t st, const GemmMmaArgs& a, int bm) {
  switch (bm) {
    case 16: return launch_mma<16, BITS, DUAL>(st, a);
    case 32: return launch_mma<32, BITS, DUAL>(st, a);
    case 64: return launch_mma<64, BITS, DUAL>(st, a);
    case 128: return launch_mma<128, BITS, DUAL>(st, a);
    default: throw std::invalid_argument("[lily] gemm_mma: rows per tile must be 16, 32, 64 or 128");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int device_sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 132;
    return v;
  }();
  return n;
}

bool gemm_mma_supported(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda) {
  const kp::LinearParams& p = W0.p;
  if (p.kind != 0 || p.group != kBK || (p.bits != 4 && p.bits != 8) || p.in <= 0 || p.in % kBK != 0 || p.out <= 0)
    return false;
  if (!aligned16(W0.codes) || (p.expert_words * 4) % 16 != 0 || lda % 8 != 0 || !aligned16(A)) return false;
  if (p.out * p.in / 8 * p.bits >= (int64_t{1} << 32)) return false;  // 32-bit code offsets inside one expert
  if (W1) {
    const kp::LinearParams& q = W1->p;
    if (q.kind != p.kind || q.bits != p.bits || q.group != p.group || q.in != p.in || q.out != p.out ||
        q.expert_words != p.expert_words || q.expert_groups != p.expert_groups || !aligned16(W1->codes))
      return false;
  }
  return true;
}

int gemm_mma_plain_rows(int64_t M, int64_t cols, bool dual) {
  // Smaller row tiles when M is small (less wasted mma work) or the grid would not fill the GPU once.
  const int64_t nblocks = (cols + (dual ? kBN / 2 : kBN) - 1) / (dual ? kBN / 2 : kBN);
  int bm = 128;
  while (bm > 16 && (M <= bm / 2 || (M + bm - 1) / bm * nblocks < device_sm_count())) bm /= 2;
  return bm;
}

void gemm_mma(cudaStream_t st, const GemmMmaArgs& a, bool dual, int bm) {
  if (a.W0.p.bits == 4) {
    if (dual) return launch_bm<4, true>(st, a, bm);
    return launch_bm<4, false>(st, a, bm);
  }
  if (dual) return launch_bm<8, true>(st, a, bm);
  return launch_bm<8, false>(st, a, bm);
}

}  // namespace lily::cuda
