// The prefill GEMM on Hopper warpgroup MMA (gemm.cuh: gemm_wgmma_*), for MLX affine 4-bit weights (group 64).
//
// The problem is computed transposed, D[weight rows x tokens] = W[rows x K] . X[tokens x K]^T, so the weights are
// wgmma's *register* operand (Machete's structure) and the activations its shared-memory operand:
//   * each consumer thread dequantises exactly its own A fragment (rows gid, gid + 8 of its warp's 16; k pairs
//     2c, 2c+1 and 2c+8, 2c+9 of each k16 step = byte c of each 4-bit word of those rows) straight into the
//     registers wgmma reads (gemm.cuh's dequant4_pair: shift, PRMT, LOP3, two bf16x2 FMAs per pair, the mma.sync
//     GEMM's own function), one step ahead of the tensor pipe (one wgmma group in flight, two fragment buffers);
//   * one producer warpgroup only issues cp.async (activation rows into the 128-byte-swizzled tile wgmma reads,
//     the raw code rows, the scale / bias words) and signals each stage with cp.async.mbarrier.arrive.noinc: it
//     never waits on a load, only on the consumers' release of a slot;
//   * CTA tile 128 MB weight rows (2 consumer warpgroups x MB m64 blocks) x TN tokens x 64 k, kStages stages;
//     setmaxnreg moves registers from the producer (72: its persistent loop spilled at 64 in the dual tiles) to the
//     consumers (216): 128 x 72 + 256 x 216 = 384 x 168, exactly what the launch allocated (168 per thread). The
//     first version asked 80 / 216 = 65,536 > 64,512: the consumers' setmaxnreg.inc waited forever for registers
//     the pool never had (it hung on the H200, 2026-12-02);
//   * persistent (below): one CTA per SM slot walks the work items, the stage ring running on across them, so
//     the producer fills the next item's stages during this item's epilogue. On the H200 (check_gemm, 2,048
//     tokens): the MoE down 312 -> 284 us, the shared gate/up 48.6 -> 43.9, the DeltaNet out-projection 152 ->
//     158 (its accumulate reads); a 4K prefill 1.024x (dev/compare_builds.py, seventh session).
// Measured on the H200 (the lab's v4: git show 92ce5fc:dev/gemm_lab/gemm_wgmma.cu; M = 4096): 470 TFLOP/s on the
// DeltaNet in-projection and
// the attention q/k/v (48% of 990), 2.4x the mma.sync GEMM's shape of kernel that dequantised into a shared tile
// (whose ncu showed the L1/shared pipe at 90%, the tensor pipe idle).
// Plain rows (tokens) or grouped tiles (MoE experts: one expert per token tile, rows gathered through a_rows,
// outputs scattered through y_rows and scaled); fp32 store / accumulate, bf16 store, or the dual gate/up epilogue (block 0 of
// each warpgroup holds W0's rows, block 1 the same rows of W1: silu(gate) * up in registers, bf16 out).
#include "cuda/gemm.cuh"
#include "cuda/wgmma.cuh"

namespace lily::cuda {
namespace {

using namespace wg;  // mbarriers, cp.async, the swizzle and descriptor (wgmma.cuh)

constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kBK = 64;        // k per stage = one quantisation group
constexpr int kStages = 6;

template <int TN, int MB>
struct WgTile {
  static constexpr int kRows = 128 * MB;          // weight rows per CTA
  static constexpr int kXBytes = TN * kBK * 2;    // activation tile (TN x 64 bf16, swizzled)
  static constexpr int kCBytes = kRows * 32;      // code rows (32 bytes = 64 4-bit codes each)
  static constexpr int kSBytes = kRows * 8;       // the scale word and the bias word of each row
  static constexpr int kSmem = kStages * (kXBytes + kCBytes + kSBytes) + 1024;  // + 1024-byte alignment slack
};

// Weight row of tile row r (0 .. 128 MB - 1): plain rows n0 + r; dual: warpgroup half r / 128, block (r / 64) % 2
// picks W0 / W1, the feature n0 + 64 (r / 128) + r % 64.
template <bool DUAL>
__device__ __forceinline__ int64_t tile_feature(int64_t n0, int r, bool& w1) {
  w1 = DUAL && ((r / 64) & 1);
  return DUAL ? n0 + 64 * (r / 128) + r % 64 : n0 + r;
}

// Persistent: a CTA runs work items blockIdx.x, + gridDim.x, ... (item w: token tile w % tiles of weight-row block
// w / tiles), the stage ring running on across items, so the producer fills the next item's stages while the
// consumers run this item's epilogue. Grouped, `tiles` is the device's tile count (read once; the launch knows only
// its bound, and mapping items over the bound left each CTA a share of skipped items, one dependent load each); an
// item of no rows is skipped by both roles alike (they read the same map). Each role keeps its own per-item table
// behind a named barrier of its own: the producer the activation rows (barrier 1), the consumers the output rows
// and scales (barrier 2, after the k loop: only the epilogue reads them).
template <int TN, int MB, bool DUAL>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ GemmMmaArgs args, int max_tiles, int nblocks) {
#ifdef LILY_WGMMA
  using T = WgTile<TN, MB>;
  static_assert(!DUAL || MB == 2, "dual tiles hold W0's and W1's rows of 128 features");
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  __shared__ int64_t a_off[TN], y_row[TN];  // per tile token: A element offset, output row (-1: none)
  __shared__ float y_scale[TN];
  const kp::GemmParams& gp = args.gp;
  const GroupMap& g = args.g;
  const uint32_t sbase = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t xs0 = sbase, cs0 = xs0 + kStages * T::kXBytes, ss0 = cs0 + kStages * T::kCBytes;
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const int64_t N = args.W0.p.out, K = args.W0.p.in;
  const int ktiles = static_cast<int>(K / kBK);
  const int64_t wpr = K / 8, gpr = K / kBK;  // u32 code words, groups per weight row
  const int64_t cols = DUAL ? 128 : T::kRows;
  const int tiles = gp.grouped ? max(0, min(max_tiles, *g.n_tiles)) : max_tiles, items = tiles * nblocks;
  auto item = [&](int w, int64_t& n0, int64_t& r0, int64_t& e, int& nrows) {
    n0 = static_cast<int64_t>(w / tiles) * cols;
    return gemm_tile_rows(gp, g, TN, r0, e, nrows, w % tiles) && nrows > 0;
  };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&full[s], 128);  // every producer thread's cp.async arrival
      bar_init(&empty[s], 8);   // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ---- producer: cp.async only ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n" ::: "memory");
    const int xc = t % 8, xr = t / 8;  // activations: chunk xc of tile tokens xr + 16 i
    const int ch = t % 2, cr = t / 2;  // codes: half ch of tile rows cr + 64 i
    int it = 0;                        // k-tiles issued by this CTA: the ring position
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
      int64_t n0, r0, e;
      int nrows;
      if (!item(w, n0, r0, e, nrows)) continue;
      const int64_t e_words = e * args.W0.p.expert_words, e_groups = e * args.W0.p.expert_groups;
      asm volatile("bar.sync 1, 128;" ::: "memory");  // every producer thread has issued the previous item
      if (t < TN) {
        const int64_t pr = r0 + min(t, nrows - 1);  // rows past the tile repeat its last row; never stored
        a_off[t] = (gp.grouped && g.a_rows ? g.a_rows[pr] : pr) * gp.lda;
      }
      asm volatile("bar.sync 1, 128;" ::: "memory");
      for (int kt = 0; kt < ktiles; ++kt, ++it) {
        const int s = it % kStages;
        if (it >= kStages) bar_wait(&empty[s], ((it / kStages) - 1) & 1);
        const uint32_t xs = xs0 + s * T::kXBytes, cs = cs0 + s * T::kCBytes, ss = ss0 + s * T::kSBytes;
#pragma unroll
        for (int i = 0; i < TN / 16; ++i) {
          const int r = xr + 16 * i;
          cp16(xs + swz(r, xc), args.A + a_off[r] + kt * kBK + xc * 8);
        }
#pragma unroll
        for (int i = 0; i < 2 * MB; ++i) {
          const int r = cr + 64 * i;
          bool w1;
          const int64_t n = min64(tile_feature<DUAL>(n0, r, w1), N - 1);
          const uint32_t* codes = (w1 ? args.W1.codes : args.W0.codes) + e_words + n * wpr + kt * 8 + ch * 4;
          cp16(cs + r * 32 + ((ch ^ ((r >> 2) & 1)) << 4), codes);  // halves swapped on rows with bit 2: no conflicts
        }
#pragma unroll
        for (int i = 0; i < MB; ++i) {
          const int r = t + 128 * i;
          bool w1;
          const int64_t gi = e_groups + min64(tile_feature<DUAL>(n0, r, w1), N - 1) * gpr + kt;
          cp4(ss + r * 8, word_of((w1 ? args.W1.scales : args.W0.scales) + gi));
          cp4(ss + r * 8 + 4, word_of((w1 ? args.W1.biases : args.W0.biases) + gi));
        }
        cp_bar_arrive(&full[s]);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {  // ---- consumers: warpgroup cw owns tile rows 64 MB cw .. + 64 MB - 1 as MB m64 blocks ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
    const int cw = wg - 1, warp = t / 32, lane = t % 32, gid = lane / 4, c = lane % 4;
    // fragment row (j, rr) is tile row rb + 64 j + 8 rr; bit 2 of it (the code tile's half swap) is gid's
    const int rb = 64 * MB * cw + 16 * warp + gid, swap = (gid >> 2) & 1;
    int it = 0;  // k-tiles consumed by this CTA: the ring position
    for (int w = blockIdx.x; w < items; w += gridDim.x) {
      int64_t n0, r0, e;
      int nrows;
      if (!item(w, n0, r0, e, nrows)) continue;
      const int64_t e_groups = e * args.W0.p.expert_groups;
      // This thread's entry of the item's output table, loaded now and stored after the k loop: the epilogue is
      // its only reader, so the gathers' latency hides behind the item's MMAs.
      int64_t my_row = -1;
      float my_scale = 1.f;
      if (tid - 128 < TN) {
        const int m = tid - 128;
        const int64_t pr = r0 + min(m, nrows - 1);
        my_row = m < nrows ? (gp.grouped && g.y_rows ? g.y_rows[pr] : pr) : -1;
        my_scale = gp.grouped && g.scale ? g.scale[pr] : 1.f;
      }
      uint32_t half0 = 0;  // bit 2 (2j + rr) + {0: scale, 1: bias}: the half of k-tile 0's word holding the bf16
#pragma unroll
      for (int j = 0; j < MB; ++j)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          bool w1;
          const int64_t gi = e_groups + min64(tile_feature<DUAL>(n0, rb + 64 * j + 8 * rr, w1), N - 1) * gpr;
          half0 |= half_bit((w1 ? args.W1.scales : args.W0.scales) + gi) << (2 * (2 * j + rr));
          half0 |= half_bit((w1 ? args.W1.biases : args.W0.biases) + gi) << (2 * (2 * j + rr) + 1);
        }
      float d[MB][TN / 2];
#pragma unroll
      for (int j = 0; j < MB; ++j)
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) d[j][i] = 0.f;
      uint32_t fr[2][MB][4];  // [buffer][m64 block][a0..a3]
      uint32_t s2[MB][2], b2[MB][2];
      const int it0 = it;
      auto load_sb = [&](int kt) {  // this stage's scale and bias of the fragment rows, the bf16 in both halves
        const uint32_t ss = ss0 + ((it0 + kt) % kStages) * T::kSBytes + rb * 8;
#pragma unroll
        for (int j = 0; j < MB; ++j)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const uint32_t a = ss + (64 * j + 8 * rr) * 8, h = half0 >> (2 * (2 * j + rr));
            s2[j][rr] = __byte_perm(ld_s32(a), 0u, ((h ^ kt) & 1) ? 0x3232u : 0x1010u);
            b2[j][rr] = __byte_perm(ld_s32(a + 4), 0u, (((h >> 1) ^ kt) & 1) ? 0x3232u : 0x1010u);
          }
      };
      auto load_frag = [&](int kt, int step, uint32_t (&f)[MB][4]) {  // words 2 step, 2 step + 1 of each row
        const uint32_t cs =
            cs0 + ((it0 + kt) % kStages) * T::kCBytes + rb * 32 + (((step >> 1) ^ swap) << 4) + (step & 1) * 8;
#pragma unroll
        for (int j = 0; j < MB; ++j)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            uint32_t v0, v1;
            asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v0), "=r"(v1) : "r"(cs + (64 * j + 8 * rr) * 32) : "memory");
            f[j][rr] = dequant4_pair(v0, v0 >> 4, c, s2[j][rr], b2[j][rr]);      // a0 / a1: k 2c, 2c+1
            f[j][2 + rr] = dequant4_pair(v1, v1 >> 4, c, s2[j][rr], b2[j][rr]);  // a2 / a3: k 2c+8, 2c+9
          }
      };
      bar_wait(&full[it0 % kStages], (it0 / kStages) & 1);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async's writes -> wgmma's async proxy
      load_sb(0);
      load_frag(0, 0, fr[0]);
      for (int kt = 0; kt < ktiles; ++kt) {
        const uint32_t xs = xs0 + ((it0 + kt) % kStages) * T::kXBytes;
#pragma unroll
        for (int step = 0; step < kBK / 16; ++step) {
          const int b = step & 1;
          wgmma_fence();
#pragma unroll
          for (int j = 0; j < MB; ++j) wgmma_rs<0>(d[j], fr[b][j], desc(xs + step * 32));
          wgmma_commit();
          wgmma_wait<1>();  // the previous step's group is done
#pragma unroll
          for (int j = 0; j < MB; ++j) keep(fr[b ^ 1][j]);
          if (step == 0 && kt > 0 && lane == 0) bar_arrive(&empty[(it0 + kt - 1) % kStages]);
          if (step + 1 < kBK / 16) {
            load_frag(kt, step + 1, fr[b ^ 1]);
          } else if (kt + 1 < ktiles) {
            const int nx = it0 + kt + 1;
            bar_wait(&full[nx % kStages], (nx / kStages) & 1);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            load_sb(kt + 1);
            load_frag(kt + 1, 0, fr[b ^ 1]);
          }
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < MB; ++j) keep(d[j]);
      if (lane == 0) bar_arrive(&empty[(it0 + ktiles - 1) % kStages]);  // the item's last stage, for the next item
      it = it0 + ktiles;
      asm volatile("bar.sync 2, 256;" ::: "memory");  // the previous item's epilogue has read the table
      if (tid - 128 < TN) y_row[tid - 128] = my_row, y_scale[tid - 128] = my_scale;
      asm volatile("bar.sync 2, 256;" ::: "memory");
      // accumulator i of block j: tile row rb + 64 j + 8 ((i / 2) % 2), tile token (i / 4) 8 + 2 c + i % 2
      const int64_t ldy = gp.ldy;
      n0 = static_cast<int64_t>(w / tiles) * cols;  // recomputed: not held in a register across the k loop
      auto tok = [&](int i) { return (i / 4) * 8 + 2 * c + (i % 2); };
      auto out_at = [&](int i, int j) -> float* {  // plain output element of accumulator (j, i); null: none
        const int64_t orow = y_row[tok(i)];
        const int64_t n = n0 + rb + 64 * j + 8 * ((i / 2) % 2);
        return orow < 0 || n >= N ? nullptr : args.y + orow * ldy + n;
      };
      if constexpr (DUAL) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) {
          const int64_t orow = y_row[tok(i)];
          bool w1;
          const int64_t n = tile_feature<true>(n0, rb + 8 * ((i / 2) % 2), w1);
          if (orow >= 0 && n < N) args.yb[orow * ldy + n] = __float2bfloat16(siluf_(d[0][i]) * d[1][i]);
        }
      } else if (gp.accumulate) {
        // The read-modify-write in groups of kAccGroup accumulators, every load of a group issued before its
        // stores: one load -> add -> store chain per accumulator (the stores may alias the next loads, so the
        // compiler keeps them in order) took the accumulating out-projections 306 us against 177 for the same
        // FLOPs stored plainly (a 4K prefill on the H200, dev/prefill_trace.py).
        constexpr int kAccGroup = 16;
#pragma unroll
        for (int i0 = 0; i0 < TN / 2; i0 += kAccGroup) {
          float old[MB][kAccGroup];
#pragma unroll
          for (int q = 0; q < kAccGroup; ++q)
#pragma unroll
            for (int j = 0; j < MB; ++j) {
              const float* src = out_at(i0 + q, j);
              old[j][q] = src ? *src : 0.f;
            }
#pragma unroll
          for (int q = 0; q < kAccGroup; ++q)
#pragma unroll
            for (int j = 0; j < MB; ++j)
              if (float* dst = out_at(i0 + q, j)) *dst = old[j][q] + d[j][i0 + q] * y_scale[tok(i0 + q)];
        }
      } else if (args.yb) {
        // The bf16 store (the MoE down's d): accumulators i, i + 1 are tokens tok(i), tok(i) + 1 of one feature, and
        // lane ^ 4 (gid ^ 1) holds the neighbouring feature, so one shuffle per pair gives the even-gid lane both
        // features of token tok(i) and the odd-gid lane both of tok(i) + 1: one bf16x2 store each, half the stores.
        const bool odd = gid & 1, vec = ldy % 2 == 0 && reinterpret_cast<uintptr_t>(args.yb) % 4 == 0;
#pragma unroll
        for (int i = 0; i < TN / 2; i += 2)
#pragma unroll
          for (int j = 0; j < MB; ++j) {
            const float keep = odd ? d[j][i + 1] : d[j][i];
            const float got = __shfl_xor_sync(0xFFFFFFFFu, odd ? d[j][i] : d[j][i + 1], 4);
            const float lo = odd ? got : keep, hi = odd ? keep : got;  // features n, n + 1
            const int tk = tok(i) + odd;
            const int64_t orow = y_row[tk], n = n0 + rb - odd + 64 * j + 8 * ((i / 2) % 2);
            if (orow < 0 || n >= N) continue;
            store_bf16_pair(args.yb + orow * ldy + n, lo * y_scale[tk], hi * y_scale[tk], vec, n, N);
          }
      } else {
        // Output column base and row stride of fragment rows (j, rr): y's, or those of the concatenation's part holding
        // the feature (parts meet at any row, so the part is found per fragment row, not per tile).
        float* ybase[MB][2];
        int64_t yld[MB][2];
#pragma unroll
        for (int j = 0; j < MB; ++j)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int64_t n = n0 + rb + 64 * j + 8 * rr;
            const ConcatOut& so = args.so;
            if (so.parts > 0) {
              const int q = so.part(n);
              ybase[j][rr] = n < N ? so.y[q] + (n - so.begin[q]) : nullptr;
              yld[j][rr] = so.ldy[q];
            } else {
              ybase[j][rr] = n < N ? args.y + n : nullptr;
              yld[j][rr] = ldy;
            }
          }
#pragma unroll
        for (int i = 0; i < TN / 2; ++i)
#pragma unroll
          for (int j = 0; j < MB; ++j) {
            const int64_t orow = y_row[tok(i)];
            float* base = ybase[j][(i / 2) % 2];
            if (orow >= 0 && base) base[orow * yld[j][(i / 2) % 2]] = d[j][i] * y_scale[tok(i)];
          }
      }
    }
  }
#else
  __trap();  // built without sm_90a: gemm_wgmma_supported() is false there
#endif
}

template <int TN, int MB, bool DUAL>
void launch(cudaStream_t st, const GemmMmaArgs& a) {
  using T = WgTile<TN, MB>;
  auto* kernel = gemm_wgmma_kernel<TN, MB, DUAL>;
  static const int per_sm = [kernel] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem), "gemm_wgmma smem attribute");
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, T::kSmem), "gemm_wgmma occupancy");
    return n < 1 ? 1 : n;
  }();
  const int64_t tiles = a.gp.grouped ? a.g.max_tiles : (a.gp.M + TN - 1) / TN;
  const int64_t cols = DUAL ? 128 : T::kRows;
  const int64_t nblocks = (a.W0.p.out + cols - 1) / cols;
  if (tiles <= 0 || nblocks <= 0) return;
  const int64_t items = tiles * nblocks;  // grouped: an upper bound (the kernel maps the device's tile count)
  if (items > INT32_MAX) throw std::invalid_argument("[lily] gemm_wgmma: more than 2^31 work items");
  const int64_t grid = std::min<int64_t>(items, static_cast<int64_t>(device_sm_count()) * per_sm);
  kernel<<<static_cast<unsigned>(grid), kThreads, T::kSmem, st>>>(a, static_cast<int>(tiles), static_cast<int>(nblocks));
  LILY_LAUNCH_CHECK();
}

}  // namespace

bool gemm_wgmma_supported(const DLinear& W0, const DLinear* W1, const bf16* A, int64_t lda) {
  // the mma GEMM's format and alignment conditions (group 64, in % 64, 16-byte codes and A rows), 4-bit only
  return device_is_sm90() && W0.p.bits == 4 && gemm_mma_supported(W0, W1, A, lda);
}

void gemm_wgmma(cudaStream_t st, const GemmMmaArgs& a, bool dual, int tokens) {
  if (tokens != 64 && tokens != 128) throw std::invalid_argument("[lily] gemm_wgmma: tokens per tile must be 64 or 128");
  check_bf16_store(a, dual, "gemm_wgmma");
  if (dual) return tokens == 128 ? launch<128, 2, true>(st, a) : launch<64, 2, true>(st, a);
  // 256 weight rows per CTA unless that leaves less than one work item per SM (the grid is persistent, so one wave
  // of items suffices; two, as before, sent the 2,048-output projections of a 4K prefill (256 items) to 128-row
  // tiles: 1.007x on a 4K prefill with this threshold, compare_builds_concat_h200.json)
  const int64_t tiles = a.gp.grouped ? a.g.max_tiles : (a.gp.M + tokens - 1) / tokens;
  const bool wide = tiles * ((a.W0.p.out + 255) / 256) >= device_sm_count();
  if (tokens == 128) return wide ? launch<128, 2, false>(st, a) : launch<128, 1, false>(st, a);
  return wide ? launch<64, 2, false>(st, a) : launch<64, 1, false>(st, a);
}

}  // namespace lily::cuda
