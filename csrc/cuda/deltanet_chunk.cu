// Gated DeltaNet prefill, chunked form (docs/model.md §4.3 step 7; chunk_prep_kernel, chunk_state_kernel,
// chunk_out_kernel): the chunked WY/UT form (Gated DeltaNet paper; fla chunk_gated_delta_rule's split), chunk C = 64,
// its matrix products on TF32 mma.sync (fragments of k-contiguous tiles through ldmatrix, which moves 32-bit words
// as they are, see ldsm_x4; tiles read [k][n] by scalar or, n-tiles interleaved, vector loads).
// deltanet_scan (deltanet.cu) picks it over the sequential form (deltanet_seq.cu) for long prompts;
// tests/kernels/test_cuda_deltanet.py compares both with an fp64 recurrence.
//
// Chunked math (MLX layout: state S[dv, dk], read m = S k). Inside a chunk with incoming state S0, token i
// (0-based) has lg_i = sum_{j<=i} log g_j and gamma_i = exp(lg_i). Unrolling the recurrence gives
//   delta_i = beta_i (v_i - gamma_i S0 k_i - sum_{j<i} (gamma_i/gamma_j)(k_i.k_j) delta_j)
// so (I + A) Delta = beta V - diag(beta gamma) K S0^T with A[i,j] = beta_i (gamma_i/gamma_j)(k_i.k_j), j < i.
// With T = (I + A)^-1:  W = T diag(beta gamma) K  [C, Dk],  U = T diag(beta) V  [C, Dv],  Delta = U - W S0^T,
//   O[i]  = gamma_i S0 q_i + sum_{j<=i} P[i,j] delta_j,   P[i,j] = (gamma_i/gamma_j)(q_i.k_j) (j <= i),
//   S_end = gamma_last S0 + sum_j (gamma_last/gamma_j) delta_j k_j^T.
// Every ratio is exp(lg_i - lg_j) with lg_i <= lg_j, so nothing overflows and tiny decays underflow to 0
// instead of producing 0/0. Only Delta and S_end depend on the previous chunk, so the work splits three ways:
//   1. prep (all chunks in parallel): lg, A, T, then W and U as two mma products, to scratch;
//   2. state (the chunks in order, one block per value head and 32 state rows, the state in registers): S_n
//      to scratch, Delta = U - W S_n^T (over U), the state update; the next chunk's tiles load meanwhile;
//   3. out (all chunks in parallel): P from Q and K, then O = gamma Q S_n^T + P Delta (then the gated norm, fused).
// The sequential kernel does two 64x32x128 products per chunk and nothing else (before, it also formed
// Q S^T and P Delta and waited on its own loads each chunk: ~8 us per chunk at the real shape, H200).
#include "cuda/deltanet_chunk_tiles.cuh"
#include "cuda/deltanet_scan.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda {
namespace {

using namespace dn_scan;
using namespace dn_chunk;  // kChunk, the tile loads and fragment helpers (deltanet_chunk_tiles.cuh)
constexpr int kStateRows = 32;    // state rows (dv) per block of chunk_state_kernel
constexpr int kStateThreads = 512;  // chunk_state_kernel: 16 warps, so each holds a short share of the chain

// Scratch of the chunked form, per (value head h, chunk n), index hn = h * n_chunks + n.
struct ChunkScratch {
  float* w;   // [Hv, NC, C, Dk]  W = T diag(beta gamma) K, TF32-rounded (kernel 1)
  float* ud;  // [Hv, NC, C, Dv]  U = T diag(beta) V (kernel 1), overwritten by Delta = U - W S_n^T (kernel 2)
  float* lg;  // [Hv, NC, C]      cumulative log decay inside the chunk (constant over padded rows)
  float* hs;  // [Hv, NC, Dv, Dk] the state at the chunk's start, S_n (kernel 2, read by kernel 3)
};


// ---------------------------------------------------------------------------------------------------------
// Chunked form, kernel 1 of 3 (all chunks in parallel, one block per (chunk, value head)): lg, the Gram A, the
// inverse T = (I + A)^-1 by forward substitution (4 lanes per column), then W = T diag(beta gamma) K and
// U = T diag(beta) V on TF32 mma. K and the first V slab are copied in at the start, so the products wait on no
// load (an earlier version streamed [C][32] column blocks and waited on each: ~30 us per block under ncu).
template <int DKP>
struct PrepLayout {
  static constexpr int kVSlab = 128;           // V columns per pass of the U product
  // K rows: the Gram's A and B(n, k) by ldmatrix (4 mod 32), then W's B(k, n) (2-way there, scalar or vector)
  static constexpr int kKStride = DKP + 4;
  static constexpr int kVStride = kVSlab + 8;  // V rows: B(k, n), 128-bit loads conflict-free (8 mod 32)
  static constexpr int kTStride = kChunk + 4;  // A, Tw, Tu rows: Tw, Tu A operands by ldmatrix (4 mod 32)
  static constexpr int kK = 0, kV = kChunk * kKStride, kA = kV + kChunk * kVStride;  // A (rows kTStride), later Tw
  static constexpr int kTu = kA + kChunk * kTStride, kLg = kTu + kChunk * kTStride, kBeta = kLg + kChunk;
  static constexpr size_t kSmemBytes = (kBeta + kChunk) * sizeof(float);
};

struct ChunkArgs {
  ScanArgs s;
  ChunkScratch x;
  int n_chunks;
};

// dst[i][col0 + n] = tf32(T' B)[i][n] (dst rows of `cols` floats) for the [C][N8 * 16] product: warp w owns rows
// 16 (w % 4) .. and the 8 N8 columns from 8 N8 (w / 4) of B; T' is lower triangular, so the k-steps stop at the
// m-tile's end. B is read [k][n], so its n-tiles go in interleaved groups of kGroup (load_b_kn_interleaved): one
// 128-bit (64-bit when N8 = 2 or 6) load per row and group instead of kGroup scalar ones, and a lane's kGroup results
// of a row land adjacent in dst, one vector store (vec4: dst and cols 16-byte aligned).
template <int N8>
__device__ __forceinline__ void tri_product(float* dst, int cols, int col0, const float* sT, int t_ld, const float* sB,
                                           int b_ld, bool vec4, int warp, int lane) {
  constexpr int kGroup = N8 % 4 == 0 ? 4 : 2;
  const int g = lane / 4, t = lane % 4, mt = warp % 4, nt0 = N8 * (warp / 4);
  float acc[N8][4] = {};
#pragma unroll 2
  for (int k0 = 0; k0 < 16 * (mt + 1); k0 += 8) {
    uint32_t a[4];
    ldsm_a(a, sT, t_ld, 16 * mt, k0, lane);
#pragma unroll
    for (int j0 = 0; j0 < N8; j0 += kGroup) {
      uint32_t b[kGroup][2];
      load_b_kn_interleaved<kGroup, true>(b, sB, b_ld, 8 * (nt0 + j0), k0, g, t);
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) mma_tf32(acc[j0 + jj], a, b[jj]);
    }
  }
#pragma unroll
  for (int j0 = 0; j0 < N8; j0 += kGroup)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // acc[j0 + jj][e] is column col + jj of row i
      const int i = 16 * mt + g + 8 * (e / 2), col = col0 + 8 * (nt0 + j0) + kGroup * (2 * t + e % 2);
      float r[kGroup];
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) r[jj] = tf32_round(acc[j0 + jj][e]);  // the state kernel's operands
      float* o = dst + static_cast<int64_t>(i) * cols + col;  // (32-bit index arithmetic kept the stores scalar)
      if (vec4) {
        if (col < cols) store_vec<kGroup>(o, r);  // col and cols are multiples of kGroup
      } else {
#pragma unroll
        for (int jj = 0; jj < kGroup; ++jj)
          if (col + jj < cols) o[jj] = r[jj];
      }
    }
}

// The lower triangle of X Y^T for two TF32-rounded [C][DKP] shared tiles (the Gram K K^T of kernel 1, Q K^T of
// kernel 3): warp w owns rows 16 (w / 2) .. and columns 32 (w % 2) ..; a block wholly above the diagonal is left 0.
// acc[j][e] is entry (16 (w / 2) + g + 8 (e / 2), 8 (4 (w % 2) + j) + 2 t + e % 2). Per k-step 3 ldmatrix for 4 mma.
template <int DKP>
__device__ __forceinline__ void causal_gram(float (&acc)[4][4], const float* sX, const float* sY, int ld, int warp,
                                            int lane) {
  const int mi = warp / 2, nj0 = 4 * (warp % 2);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  if (8 * nj0 >= 16 * (mi + 1)) return;
#pragma unroll 2
  for (int k0 = 0; k0 < DKP; k0 += 8) {
    uint32_t a[4], b[4][2];
    ldsm_a(a, sX, ld, 16 * mi, k0, lane);
    ldsm_b_nk_n16(b, sY, ld, 8 * nj0, k0, lane);
    ldsm_b_nk_n16(b + 2, sY, ld, 8 * (nj0 + 2), k0, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) mma_tf32(acc[j], a, b[j]);
  }
}

template <int DKP>
__global__ void __launch_bounds__(kThreads, 2) chunk_prep_kernel(ChunkArgs args) {
  using L = PrepLayout<DKP>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const kp::DeltaNetParams& p = args.s.p;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int n = blockIdx.x, h = blockIdx.y;
  const int Dk = p.k_dim, Dv = p.v_dim, Hv = p.v_heads, kh = h / (p.v_heads / p.k_heads);
  const int64_t C = p.conv_dim, key_dim = static_cast<int64_t>(p.k_heads) * Dk, t0 = static_cast<int64_t>(n) * kChunk;
  const int len = static_cast<int>(min64(kChunk, p.S - t0));
  const int64_t hn = static_cast<int64_t>(h) * args.n_chunks + n;
  const bool vec4 = args.s.vec4;
  float* sK = smem + L::kK;
  float* sV = smem + L::kV;
  float* sA = smem + L::kA;  // A[i][j] (rows kTStride), zero for j >= i; then T diag(beta gamma)
  float* sTw = sA;
  float* sTu = smem + L::kTu;  // T diag(beta)
  float* sLg = smem + L::kLg;
  float* sBeta = smem + L::kBeta;

  const float* kg = args.s.u + t0 * C + key_dim + static_cast<int64_t>(kh) * Dk;  // rows past len, cols past Dk: 0
  const float* vg = args.s.u + t0 * C + 2 * key_dim + static_cast<int64_t>(h) * Dv;
  load_tile_async<DKP>(sK, L::kKStride, kg, C, len, Dk, vec4);
  cp_async_commit();
  load_tile_async<L::kVSlab>(sV, L::kVStride, vg, C, len, Dv, vec4);
  cp_async_commit();
  if (tid < kChunk) {  // log g = -exp(A_log) softplus(a + dt_bias); padded rows: g = 1, beta = 0
    const bool in = tid < len;
    const float araw = in ? args.s.a[(t0 + tid) * Hv + h] : 0.f, braw = in ? args.s.b[(t0 + tid) * Hv + h] : 0.f;
    sLg[tid] = in ? -expf(args.s.a_log[h]) * softplusf_(araw + args.s.dt_bias[h]) : 0.f;
    sBeta[tid] = in ? 1.f / (1.f + expf(-braw)) : 0.f;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive prefix sum of the 64 log decays: lane l holds 2l, 2l + 1
    const float a0 = sLg[2 * lane], a1 = sLg[2 * lane + 1];
    float s = a0 + a1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    sLg[2 * lane] = s - a1;
    sLg[2 * lane + 1] = s;
  }
  cp_async_wait<1>();  // K landed (V may still be in flight)
  __syncthreads();
  if (tid < kChunk) args.x.lg[hn * kChunk + tid] = sLg[tid];
  round_tile<DKP>(sK, L::kKStride);  // both operands of the Gram and W's B
  __syncthreads();

  {  // A = beta_i (gamma_i / gamma_j) k_i.k_j (j < i); a lane's two columns 2 t, 2 t + 1 of a row in one 64-bit
    // store (lanes g, t at bank 4 g + 2 t: 2-way; as A^T, scalar, it was 4-way)
    float kk[4][4];
    causal_gram<DKP>(kk, sK, sK, L::kKStride, warp, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = 16 * (warp / 2) + g + 8 * h2, j0 = 8 * (4 * (warp % 2) + j) + 2 * t;
        float a[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jj = j0 + e;
          a[e] = jj < i ? sBeta[i] * expf(sLg[i] - sLg[jj]) * kk[j][2 * h2 + e] : 0.f;
        }
        store_vec<2>(sA + i * L::kTStride + j0, a);
      }
  }
  __syncthreads();

  {  // T = (I + A)^-1, unit lower triangular: (I + A) T = I column by column, lanes 4c .. 4c + 3 own column c,
    // lane r holds rows 4 m + r. Right-looking: once x_j is final (it lives on lane j % 4 of the group) every row
    // i > j subtracts A[i][j] x_j; rows i <= j read A = 0 there, so no guards are needed.
    // Steps j = 4 p .. 4 p + 3 share m >= p, so row 4 m + r's A[.][4 p .. 4 p + 3] is one LDS.128 (136 in all; one
    // scalar load per (j, m) was 543), each feeding one x[m]'s own chain. Rows kTStride apart (4 mod 32) put a
    // quad's 4 lanes on distinct bank quads. (A stored transposed, read as float4 over m, spilled: ptxas defers
    // the non-critical rows' fmaf, and a vector that feeds several rows stays live for all of them.) x_j comes by a
    // width-4 shuffle, whose lane index is an immediate: the 4 index registers of (lane & ~3) | k had cost a spill.
    const int c = tid / 4, r = tid % 4;
    float x[kChunk / 4];
#pragma unroll
    for (int m = 0; m < kChunk / 4; ++m) x[m] = 4 * m + r == c ? 1.f : 0.f;
#pragma unroll
    for (int p = 0; p < kChunk / 4; ++p) {
      float a[kChunk / 4][4];
#pragma unroll
      for (int m = p; m < kChunk / 4; ++m) load_vec<4>(a[m], sA + (4 * m + r) * L::kTStride + 4 * p);
#pragma unroll
      for (int k = 0; k < 4 && 4 * p + k < kChunk - 1; ++k) {  // j = 4 p + k: the same fmaf per x[m], in j order
        const float xj = __shfl_sync(0xffffffffu, x[p], k, 4);  // lane 4 c + k
#pragma unroll
        for (int m = p; m < kChunk / 4; ++m) x[m] = fmaf(-a[m][k], xj, x[m]);
      }
    }
    const float bw = sBeta[c] * expf(sLg[c]), bu = sBeta[c];
    cp_async_wait<0>();  // V landed
    __syncthreads();     // every lane is done reading A: Tw takes its place
#pragma unroll
    for (int m = 0; m < kChunk / 4; ++m) {
      sTw[(4 * m + r) * L::kTStride + c] = tf32_round(x[m] * bw);
      sTu[(4 * m + r) * L::kTStride + c] = tf32_round(x[m] * bu);
    }
  }
  round_tile<L::kVSlab>(sV, L::kVStride);
  __syncthreads();

  tri_product<DKP / 16>(args.x.w + hn * kChunk * Dk, Dk, 0, sTw, L::kTStride, sK, L::kKStride, vec4, warp, lane);
  float* ud = args.x.ud + hn * kChunk * Dv;
  for (int v0 = 0; v0 < Dv; v0 += L::kVSlab) {
    if (v0 > 0) {  // value heads wider than one slab (not this model's)
      __syncthreads();
      load_tile_async<L::kVSlab>(sV, L::kVStride, vg + v0, C, len, Dv - v0, vec4);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      round_tile<L::kVSlab>(sV, L::kVStride);
      __syncthreads();
    }
    tri_product<L::kVSlab / 16>(ud, Dv, v0, sTu, L::kTStride, sV, L::kVStride, vec4, warp, lane);
  }
}

// Kernel 2 of 3: one block per (32 state rows, value head) walks the chunks in order, the only sequential part
// (16 warps: with 8 each warp's ~1,700 instructions per chunk ran at ~6 cycles apiece, H200 ncu):
//   S_n is stored (kernel 3's S0), Delta = U - W S^T overwrites U, S <- gamma_last S + (Delta gamma_last/gamma)^T K.
// Chunk n + 1's W, K, U and lg are copied by cp.async into the other buffer during chunk n, so no load latency
// sits on the chain. TF32 operands (cvt.rna), fp32 accumulators; the state itself stays fp32 in registers:
// each product carries ~2^-11 relative rounding, sums of 64..128 products land near 3e-4 rel RMS on Delta and O,
// and the per-chunk state rounding is contracted by later decays instead of accumulating, so y and the state stay
// inside the check's 4e-3 rel RMS; y is rounded to bf16 (2^-9) right after the gated norm anyway.
template <int DKP>
struct StateLayout {
  static_assert(DKP == 64 || DKP == 128, "the state kernel runs Dk padded to 64 or 128");
  // W, S (A and B(n, k) by ldmatrix) and Dd^T (A by ldmatrix) rows 4 mod 32; K rows (B(k, n)) 8 mod 32
  static constexpr int kWStride = DKP + 4, kKStride = DKP + 8, kSStride = DKP + 4, kDtStride = kChunk + 4;
  static constexpr int kNPerWarp = DKP / 64;  // state n-tiles (8 columns each) per warp in the update
  static constexpr int kW = 0, kK = kChunk * kWStride, kU = kK + kChunk * kKStride, kLg = kU + kChunk * kStateRows;
  static constexpr int kBuf = kLg + kChunk;  // one chunk's W | K | U | lg
  static constexpr int kS = 2 * kBuf, kDdT = kS + kStateRows * kSStride;
  static constexpr size_t kSmemBytes = (kDdT + kStateRows * kDtStride) * sizeof(float);
};

template <int DKP>
__global__ void __launch_bounds__(kStateThreads, 1) chunk_state_kernel(ChunkArgs args) {
  using L = StateLayout<DKP>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const kp::DeltaNetParams& p = args.s.p;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, dv0 = blockIdx.x * kStateRows;
  const int Dk = p.k_dim, Dv = p.v_dim, kh = h / (p.v_heads / p.k_heads);
  const int64_t C = p.conv_dim, key_dim = static_cast<int64_t>(p.k_heads) * Dk;
  const bool vec4 = args.s.vec4;
  float* sS = smem + L::kS;    // [32][kSStride] the state slice S[v][d], TF32-rounded copy of acc
  // [32][kDtStride] (Delta * gamma_last / gamma_c)^T, written transposed so step 2 reads its A by ldmatrix
  float* sDdT = smem + L::kDdT;

  // State accumulators of the update: m-tile mv (rows v = 16 mv + ...), the kNPerWarp n-tiles of the 8 kNPerWarp
  // columns from 8 nd0, interleaved (load_b_kn_interleaved): acc[i][e] is row 16 mv + g + 8 (e / 2), column
  // dcol + kNPerWarp (e % 2) + i. So step 2 reads a lane's K values of both tiles in one load, and a lane's
  // kRowVals entries of a state row are adjacent, one vector store (row_vals lists them in column order).
  constexpr int kRowVals = 2 * L::kNPerWarp;
  const int mv = warp % 2, nd0 = (warp / 2) * L::kNPerWarp, dcol = 8 * nd0 + kRowVals * t;
  float acc[L::kNPerWarp][4];
  auto row_vals = [&](int half, float (&r)[kRowVals]) {  // tf32(acc) of row 16 mv + g + 8 half, columns dcol ..
#pragma unroll
    for (int x = 0; x < kRowVals; ++x) r[x] = tf32_round(acc[x % L::kNPerWarp][2 * half + x / L::kNPerWarp]);
  };
  auto store_state = [&] {  // sS <- tf32(acc), step 1's B operand
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float r[kRowVals];
      row_vals(half, r);
      store_vec<kRowVals>(sS + (16 * mv + g + 8 * half) * L::kSStride + dcol, r);
    }
  };
  const float* ssm_h = args.s.ssm + static_cast<int64_t>(h) * Dv * Dk;
#pragma unroll
  for (int i = 0; i < L::kNPerWarp; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = 16 * mv + g + 8 * (e / 2), d = dcol + L::kNPerWarp * (e % 2) + i;
      acc[i][e] = dv0 + v < Dv && d < Dk ? ssm_h[static_cast<int64_t>(dv0 + v) * Dk + d] : 0.f;
    }
  store_state();
  // Step 1 tile: m-tile mc (chunk rows 16 mc ..), n-tile nv (state rows 8 nv ..).
  const int mc = warp / 4, nv = warp % 4;

  auto issue = [&](int n) {  // the tile copies by the first 256 threads (the loaders' block), lg by the first 64
    float* buf = smem + (n & 1) * L::kBuf;
    const int64_t t0 = static_cast<int64_t>(n) * kChunk, hn = static_cast<int64_t>(h) * args.n_chunks + n;
    const int len = static_cast<int>(min64(kChunk, p.S - t0));
    if (tid < kThreads) {
      load_tile_async<DKP>(buf + L::kW, L::kWStride, args.x.w + hn * kChunk * Dk, Dk, kChunk, Dk, vec4);
      load_tile_async<DKP>(buf + L::kK, L::kKStride, args.s.u + t0 * C + key_dim + static_cast<int64_t>(kh) * Dk, C,
                           len, Dk, vec4);
      load_tile_async<kStateRows>(buf + L::kU, kStateRows, args.x.ud + hn * kChunk * Dv + dv0, Dv, kChunk,
                                  Dv - dv0, vec4);
    }
    if (tid < kChunk) cp_async4(buf + L::kLg + tid, args.x.lg + hn * kChunk + tid);
    cp_async_commit();
  };
  issue(0);

  for (int n = 0; n < args.n_chunks; ++n) {
    const int64_t hn = static_cast<int64_t>(h) * args.n_chunks + n;
    cp_async_wait<0>();
    __syncthreads();  // chunk n landed; sS holds S_n; chunk n - 1 is done with the other buffer
    if (n + 1 < args.n_chunks) issue(n + 1);
    const float* buf = smem + (n & 1) * L::kBuf;
    const float* sW = buf + L::kW;
    const float* sK = buf + L::kK;
    const float* sU = buf + L::kU;
    const float* sLg = buf + L::kLg;

    float* hs = args.x.hs + (hn * Dv + dv0) * Dk;  // S_n for kernel 3 (fp32, from the accumulators)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int v = 16 * mv + g + 8 * half;
      if (dv0 + v >= Dv) continue;
      float r[kRowVals];
      row_vals(half, r);  // kernel 3's operand, rounded
      float* o = hs + static_cast<int64_t>(v) * Dk + dcol;
      if (vec4) {
        if (dcol < Dk) store_vec<kRowVals>(o, r);  // dcol and Dk multiples of kRowVals, hs 16-byte aligned
      } else {
#pragma unroll
        for (int x = 0; x < kRowVals; ++x)
          if (dcol + x < Dk) o[x] = r[x];
      }
    }

    // Step 1: Delta = U - W S^T, [C][32], this warp's 16x8 tile; W and sS are stored TF32-rounded. Four k-phases
    // accumulate apart: four independent mma chains of DKP / 32. 6 ldmatrix per 4 mma (scalar loads: 24).
    float ws[4][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < DKP; k0 += 32) {
      uint32_t aw[4][4], b[4][2];
#pragma unroll
      for (int q = 0; q < 4; ++q) ldsm_a(aw[q], sW, L::kWStride, 16 * mc, k0 + 8 * q, lane);
      ldsm_b_nk_k16(b, sS, L::kSStride, 8 * nv, k0, lane);
      ldsm_b_nk_k16(b + 2, sS, L::kSStride, 8 * nv, k0 + 16, lane);
#pragma unroll
      for (int q = 0; q < 4; ++q) mma_tf32(ws[q], aw[q], b[q]);
    }
    const float lg_last = sLg[kChunk - 1];
    float* ud = args.x.ud + hn * kChunk * Dv + dv0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 16 * mc + g + 8 * (e / 2), v = 8 * nv + 2 * t + e % 2;
      const float delta = sU[c * kStateRows + v] - ((ws[0][e] + ws[1][e]) + (ws[2][e] + ws[3][e]));
      if (dv0 + v < Dv) ud[static_cast<int64_t>(c) * Dv + v] = tf32_round(delta);  // kernel 3's operand
      sDdT[v * L::kDtStride + c] = tf32_round(delta * expf(lg_last - sLg[c]));  // conflict-free: bank 8 t + g + ..
    }
    __syncthreads();  // sDdT complete; every warp is done reading sS

    // Step 2: S = gamma_last S + Dd^T K; A = Dd^T (v, c) by ldmatrix, B = K (c, d) read [k][n].
    const float gl = expf(lg_last);
#pragma unroll
    for (int i = 0; i < L::kNPerWarp; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] *= gl;
#pragma unroll 2
    for (int k0 = 0; k0 < kChunk; k0 += 8) {
      uint32_t a[4], b[L::kNPerWarp][2];
      ldsm_a(a, sDdT, L::kDtStride, 16 * mv, k0, lane);
      load_b_kn_interleaved<L::kNPerWarp>(b, sK, L::kKStride, 8 * nd0, k0, g, t);  // K is plain fp32: cvt.rna
#pragma unroll
      for (int i = 0; i < L::kNPerWarp; ++i) mma_tf32(acc[i], a, b[i]);
    }
    store_state();
  }
#pragma unroll
  for (int i = 0; i < L::kNPerWarp; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = 16 * mv + g + 8 * (e / 2), d = dcol + L::kNPerWarp * (e % 2) + i;
      if (dv0 + v < Dv && d < Dk) args.s.ssm[(static_cast<int64_t>(h) * Dv + dv0 + v) * Dk + d] = acc[i][e];
    }
}

// Kernel 3 of 3 (all chunks in parallel, one block per (chunk, value head)): O = gamma (Q S_n^T) + P Delta with
// P[i][j] = (gamma_i / gamma_j) q_i.k_j (j <= i), in value slices of 64 (S_n's slice reuses K's tile).
// kNorm (Dv <= kScanNormMaxDv): deltanet_gated_norm in the epilogue, both slices' O kept in registers, so y's DRAM
// write and re-read and the norm's launch are gone; out = bf16(RMSNorm(O; w) * silu(z)) is written instead of y.
template <int DKP>
struct OutLayout {
  static constexpr int kVSlice = kChunk;       // value columns per pass (= the tile loader's 64 rows)
  static constexpr int kQStride = DKP + 4;     // Q, K, S rows: A and B(n, k) operands by ldmatrix (4 mod 32)
  // P rows: A operand by ldmatrix, which reads columns < kChunk; the padding columns kChunk, kChunk + 1 hold the
  // fused norm's per-row partial sums (no other access touches them: no barrier before the writes, no extra bytes)
  static constexpr int kPStride = kChunk + 4;
  static_assert(kPStride >= kChunk + 2);
  static constexpr int kDStride = kVSlice + 8;  // Delta [C][64]: B(k, n) operand (8 mod 32)
  static constexpr int kQ = 0, kK = kChunk * kQStride, kP = kK + kChunk * kQStride, kD = kP + kChunk * kPStride;
  static constexpr int kLg = kD + kChunk * kDStride;
  static constexpr size_t kSmemBytes = (kLg + kChunk) * sizeof(float);
};

struct NormArgs {  // the fused gated norm's operands (chunk_out_kernel<DKP, true>); out == nullptr: not fused
  const float* z;  // [S, Hv*Dv] fp32, the gate
  const float* w;  // [Dv] fp32, the norm weight
  bf16* out;       // [S, Hv*Dv] bf16
  bool vec2;       // Dv even, z and w 8-byte, out 4-byte aligned: a lane's columns 2 t, 2 t + 1 as float2 / bf16x2
};
constexpr int kNormSlices = kScanNormMaxDv / kChunk;  // value slices a fused block keeps in registers

template <int DKP, bool kNorm>
__global__ void __launch_bounds__(kThreads, 2) chunk_out_kernel(ChunkArgs args, NormArgs nrm) {
  using L = OutLayout<DKP>;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const kp::DeltaNetParams& p = args.s.p;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int n = blockIdx.x, h = blockIdx.y;
  const int Dk = p.k_dim, Dv = p.v_dim, Hv = p.v_heads, kh = h / (p.v_heads / p.k_heads);
  const int64_t C = p.conv_dim, key_dim = static_cast<int64_t>(p.k_heads) * Dk, t0 = static_cast<int64_t>(n) * kChunk;
  const int len = static_cast<int>(min64(kChunk, p.S - t0));
  const int64_t hn = static_cast<int64_t>(h) * args.n_chunks + n;
  const bool vec4 = args.s.vec4;
  float* sQ = smem + L::kQ;
  float* sK = smem + L::kK;  // K, then one S_n slice [64 v][DKP]
  float* sP = smem + L::kP;
  float* sD = smem + L::kD;
  float* sLg = smem + L::kLg;

  const float* qg = args.s.u + t0 * C + static_cast<int64_t>(kh) * Dk;
  load_tile_async<DKP>(sQ, L::kQStride, qg, C, len, Dk, vec4);
  load_tile_async<DKP>(sK, L::kQStride, qg + key_dim, C, len, Dk, vec4);
  if (tid < kChunk) cp_async4(sLg + tid, args.x.lg + hn * kChunk + tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  round_tile<DKP>(sQ, L::kQStride);  // Q feeds P and Q S^T, K feeds P: rounded once
  round_tile<DKP>(sK, L::kQStride);
  __syncthreads();

  {  // P = (gamma_i / gamma_j) q_i.k_j (j <= i)
    float qk[4][4];
    causal_gram<DKP>(qk, sQ, sK, L::kQStride, warp, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * (warp / 2) + g + 8 * (e / 2), jj = 8 * (4 * (warp % 2) + j) + 2 * t + e % 2;
        sP[i * L::kPStride + jj] = jj <= i ? tf32_round(expf(sLg[i] - sLg[jj]) * qk[j][e]) : 0.f;
      }
  }

  const int mc = warp / 2, nq0 = 4 * (warp % 2);  // rows 16 mc .., value n-tiles nq0 .. nq0 + 3 of the slice
  // o += this warp's tile of the value slice at v0: o[j][e] is row 16 mc + g + 8 (e / 2), column v0 + 8 (nq0 + j)
  // + 2 t + e % 2. Block-wide (it syncs): every thread calls it for the same v0.
  auto slice = [&](int v0, float (&o)[4][4]) {
    __syncthreads();  // K (first pass) or the previous slice is no longer read
    load_tile_async<DKP>(sK, L::kQStride, args.x.hs + (hn * Dv + v0) * Dk, Dk, Dv - v0, Dk, vec4);
    load_tile_async<L::kVSlice>(sD, L::kDStride, args.x.ud + hn * kChunk * Dv + v0, Dv, kChunk, Dv - v0, vec4);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll 2
    for (int k0 = 0; k0 < DKP; k0 += 8) {
      uint32_t aq[4], b[4][2];
      ldsm_a(aq, sQ, L::kQStride, 16 * mc, k0, lane);
      ldsm_b_nk_n16(b, sK, L::kQStride, 8 * nq0, k0, lane);  // S_n, stored rounded by kernel 2
      ldsm_b_nk_n16(b + 2, sK, L::kQStride, 8 * (nq0 + 2), k0, lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_tf32(o[j], aq, b[j]);
    }
    const float gam0 = expf(sLg[16 * mc + g]), gam1 = expf(sLg[16 * mc + g + 8]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o[j][0] *= gam0;
      o[j][1] *= gam0;
      o[j][2] *= gam1;
      o[j][3] *= gam1;
    }
    // P Delta: B = Delta (stored rounded by kernel 2) read [k][n], scalar. Interleaving its n-tiles
    // (load_b_kn_interleaved) would interleave Q S^T's too (the same accumulators), rows 4 apart in its ldmatrix.
#pragma unroll 2
    for (int k0 = 0; k0 < 16 * (mc + 1); k0 += 8) {
      uint32_t ap[4];
      ldsm_a(ap, sP, L::kPStride, 16 * mc, k0, lane);  // P, stored rounded
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[2];
        load_b_kn<true>(b, sD, L::kDStride, 8 * (nq0 + j), k0, g, t);
        mma_tf32(o[j], ap, b);
      }
    }
  };
  const int64_t head0 = (t0 * Hv + h) * static_cast<int64_t>(Dv), row_stride = static_cast<int64_t>(Hv) * Dv;
  if constexpr (!kNorm) {
    for (int v0 = 0; v0 < Dv; v0 += L::kVSlice) {
      float o[4][4] = {};
      slice(v0, o);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 16 * mc + g + 8 * (e / 2), v = v0 + 8 * (nq0 + j) + 2 * t + e % 2;
          if (c < len && v < Dv) args.s.y[head0 + c * row_stride + v] = o[j][e];
        }
    }
  } else {  // this lane's row c0 + 8 hf holds o[s][j][2 hf + x] at column v = 64 s + 8 (nq0 + j) + 2 t + x, x < 2
    const int c0 = 16 * mc + g;
    float o[kNormSlices][4][4] = {};  // a slice past Dv stays 0
#pragma unroll
    for (int s = 0; s < kNormSlices; ++s)
      if (L::kVSlice * s < Dv) slice(L::kVSlice * s, o[s]);  // Dv is block-uniform, so are slice's barriers
    // The gate loads go out first, overlapping the sums and the barrier (ptxas does not move a load past the stores
    // to out); the weight (Dv floats, L1-resident) is read at its use (13 registers fewer). ld2: columns v < Dv and
    // v + 1 (vec2: v and Dv even, so v + 1 < Dv; otherwise column Dv reads 0).
    auto ld2 = [&](const float* src, int64_t i, int v) {
      if (nrm.vec2) return *reinterpret_cast<const float2*>(src + i);
      return make_float2(src[i], v + 1 < Dv ? src[i + 1] : 0.f);
    };
    float2 zz[kNormSlices][4][2];
    float ss[2] = {0.f, 0.f};  // the row's sum of squares over this lane's columns < Dv
#pragma unroll
    for (int s = 0; s < kNormSlices; ++s)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int v = L::kVSlice * s + 8 * (nq0 + j) + 2 * t;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int c = c0 + 8 * hf;
          zz[s][j][hf] = c < len && v < Dv ? ld2(nrm.z, head0 + c * row_stride + v, v) : make_float2(0.f, 0.f);
          const float o0 = o[s][j][2 * hf], o1 = o[s][j][2 * hf + 1];
          ss[hf] += (v < Dv ? o0 * o0 : 0.f) + (v + 1 < Dv ? o1 * o1 : 0.f);
        }
      }
    // Over the row's 4 t-lanes, then the pair's other warp (2 mc + 1 - warp % 2: the other 32 columns of each slice)
    // through P's padding column kChunk + warp % 2 (OutLayout), at named barrier 1 + mc (0 is __syncthreads').
    float* red = sP + kChunk;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      ss[hf] += __shfl_xor_sync(0xffffffffu, ss[hf], 1);
      ss[hf] += __shfl_xor_sync(0xffffffffu, ss[hf], 2);
      if (t == 0) red[(c0 + 8 * hf) * L::kPStride + warp % 2] = ss[hf];
    }
    asm volatile("bar.sync %0, 64;" ::"r"(1 + mc) : "memory");
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int c = c0 + 8 * hf;
      const float* r = red + c * L::kPStride;
      const float inv = 1.f / sqrtf((r[0] + r[1]) / static_cast<float>(Dv) + p.norm_eps);
#pragma unroll
      for (int s = 0; s < kNormSlices; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = L::kVSlice * s + 8 * (nq0 + j) + 2 * t;
          if (c >= len || v >= Dv) continue;
          const float2 w2 = ld2(nrm.w, v, v);
          const float r0 = gated_out(o[s][j][2 * hf], inv, w2.x, zz[s][j][hf].x);
          const float r1 = gated_out(o[s][j][2 * hf + 1], inv, w2.y, zz[s][j][hf].y);
          bf16* out = nrm.out + head0 + c * row_stride + v;
          if (nrm.vec2) *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(r0, r1);
          else out[0] = __float2bfloat16(r0);
          if (!nrm.vec2 && v + 1 < Dv) out[1] = __float2bfloat16(r1);
        }
    }
  }
}

template <int DKP>
void launch_chunked(cudaStream_t st, const ScanArgs& s, const ChunkScratch& x, int n_chunks, const NormArgs& nrm) {
  const ChunkArgs args{s, x, n_chunks};
  const dim3 chunk_grid(n_chunks, s.p.v_heads);
  set_smem(chunk_prep_kernel<DKP>, PrepLayout<DKP>::kSmemBytes);
  chunk_prep_kernel<DKP><<<chunk_grid, kThreads, PrepLayout<DKP>::kSmemBytes, st>>>(args);
  LILY_LAUNCH_CHECK();
  const dim3 state_grid(static_cast<unsigned>((s.p.v_dim + kStateRows - 1) / kStateRows), s.p.v_heads);
  constexpr int kSDKP = DKP <= 64 ? 64 : 128;  // the state kernel's 16 warps split 64 or 128 key columns evenly
  set_smem(chunk_state_kernel<kSDKP>, StateLayout<kSDKP>::kSmemBytes);
  chunk_state_kernel<kSDKP><<<state_grid, kStateThreads, StateLayout<kSDKP>::kSmemBytes, st>>>(args);
  LILY_LAUNCH_CHECK();
  auto out = [&](auto kernel) {  // chunk_out_kernel<DKP, fused or not>
    set_smem(kernel, OutLayout<DKP>::kSmemBytes);
    kernel<<<chunk_grid, kThreads, OutLayout<DKP>::kSmemBytes, st>>>(args, nrm);
    LILY_LAUNCH_CHECK();
  };
  if (nrm.out != nullptr) out(chunk_out_kernel<DKP, true>);
  else out(chunk_out_kernel<DKP, false>);
}

}  // namespace

size_t deltanet_chunk_scratch_bytes(const kp::DeltaNetParams& p) {
  const int64_t n_chunks = (p.S + kChunk - 1) / kChunk;
  const int64_t per = static_cast<int64_t>(kChunk) * (p.k_dim + p.v_dim + 1) + static_cast<int64_t>(p.v_dim) * p.k_dim;
  return static_cast<size_t>(p.v_heads * n_chunks * per) * sizeof(float);
}

// Both entry points: y (nrm.out == nullptr) or nrm.out receives the output.
static void run_chunked(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, float* y, float* scratch,
                        const NormArgs& nrm) {
  check_shape(p, "deltanet_scan_chunked");
  if (p.S <= 0) return;
  const int n_chunks = static_cast<int>((p.S + kChunk - 1) / kChunk);
  const int64_t hn = static_cast<int64_t>(p.v_heads) * n_chunks;
  ChunkScratch x;
  x.w = scratch;
  x.ud = x.w + hn * kChunk * p.k_dim;
  x.lg = x.ud + hn * kChunk * p.v_dim;
  x.hs = x.lg + hn * kChunk;
  const bool vec4 = p.k_dim % 4 == 0 && p.v_dim % 4 == 0 && p.conv_dim % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(u) % 16 == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0;
  const ScanArgs args{p, u, b, a, dt_bias, a_log, ssm, y, vec4};
  switch ((p.k_dim + 31) / 32) {
    case 1: return launch_chunked<32>(st, args, x, n_chunks, nrm);
    case 2: return launch_chunked<64>(st, args, x, n_chunks, nrm);
    case 3: return launch_chunked<96>(st, args, x, n_chunks, nrm);
    default: return launch_chunked<128>(st, args, x, n_chunks, nrm);
  }
}

void deltanet_scan_chunked(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b,
                           const float* a, const float* dt_bias, const float* a_log, float* ssm, float* y,
                           float* scratch) {
  run_chunked(st, p, u, b, a, dt_bias, a_log, ssm, y, scratch, NormArgs{});
}

void deltanet_scan_chunked_norm(cudaStream_t st, const kp::DeltaNetParams& p, const float* u, const float* b,
                                const float* a, const float* dt_bias, const float* a_log, float* ssm, const float* z,
                                const float* norm_w, bf16* out, float* scratch) {
  if (p.v_dim > kScanNormMaxDv)
    throw std::invalid_argument("[lily] cuda deltanet_scan_chunked_norm: needs Dv <= kScanNormMaxDv (128)");
  const bool vec2 = p.v_dim % 2 == 0 && reinterpret_cast<uintptr_t>(z) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(norm_w) % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0;
  run_chunked(st, p, u, b, a, dt_bias, a_log, ssm, nullptr, scratch, NormArgs{z, norm_w, out, vec2});
}

}  // namespace lily::cuda
