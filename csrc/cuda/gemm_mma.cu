// The mma.sync GEMM (gemm.cuh: gemm_mma_*): the prefill GEMM for 8-bit weights, small tiles and narrow products,
// and on GPUs without warpgroup MMA; gemm.cu's dispatch takes it wherever gemm_mma_supported.
#include "cuda/gemm.cuh"

namespace lily::cuda {
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
  const bool vec = ldy % 2 == 0 && (DUAL || args.yb ? reinterpret_cast<uintptr_t>(args.yb) % 4 == 0
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
          store_bf16_pair(args.yb + orow * ldy + col, o0, o1, vec, col, N);
        }
      } else {
        const float sc = gp.grouped && g.scale ? g.scale[pr] : 1.f;
#pragma unroll
        for (int j = 0; j < kNF; ++j) {
          const int64_t col = n0 + (wn * kNF + j) * 8 + 2 * tig;
          float o0 = acc[i][j][2 * rr] * sc, o1 = acc[i][j][2 * rr + 1] * sc;
          if (args.yb) {  // the bf16 store
            store_bf16_pair(args.yb + orow * ldy + col, o0, o1, vec, col, N);
            continue;
          }
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
  check_bf16_store(a, dual, "gemm_mma");
  if (a.W0.p.bits == 4) {
    if (dual) return launch_bm<4, true>(st, a, bm);
    return launch_bm<4, false>(st, a, bm);
  }
  if (dual) return launch_bm<8, true>(st, a, bm);
  return launch_bm<8, false>(st, a, bm);
}

}  // namespace lily::cuda
