// Causal flash attention for prefill chunks on Hopper warpgroup MMA (sm_90a; attention_prefill.cu's mma.sync kernel
// is the twin every other GPU runs, and the check program times both): FlashAttention-3's structure without its
// ping-pong scheduling.
//   * CTA = 128 flat rows (attention_prefill.cu's packing: flat row f of KV head g is token f / G, query head
//     g G + f % G) x one KV head x one key split; one producer warpgroup and two consumer warpgroups of 64 rows;
//   * the producer only issues cp.async: K and V tiles of 64 keys into 128-byte-swizzled shared memory, two stages,
//     K and V of a stage signalled apart (the consumers start Q K^T while V lands), zero fill past the block's last
//     key (the cache rows there may hold NaN);
//   * each consumer warpgroup rounds its Q rows to bf16 into shared memory once, then per tile: S = Q K^T
//     (wgmma m64n64k16, both operands from shared memory), the online softmax in registers (log2 domain), P packed
//     to bf16 straight into wgmma's A registers (the accumulator and A fragment layouts coincide), O += P V (wgmma
//     m64nDk16 from registers, V read N-major through the descriptor: no transposed copy). O stays in registers
//     (D / 2 floats per thread), so D = 256 needs the 224 registers setmaxnreg moves to the consumers
//     (56 x 128 + 224 x 256 = 168 x 384, what the launch allocates: ptxas compiles each role to its count);
//   * the two consumer warpgroups run unsynchronised on the same tiles, so one's softmax overlaps the other's MMAs.
// The online-softmax step and the epilogue are attention_prefill.cu's (attention_prefill.cuh): one split applies the
// sigmoid gate and writes bf16 o, several write the (m, l, o) partials attn_combine_kernel merges.
#include "cuda/attention_prefill.cuh"
#include "cuda/wgmma.cuh"

namespace lily::cuda {
namespace {

using namespace wg;  // mbarriers, cp.async arrival, swizzle, descriptors, wgmma (wgmma.cuh)

constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kRows = 128;     // flat rows per CTA (attention_mma_plan's row tile)
constexpr int kKeys = 64;      // keys per tile
constexpr int kStages = 2;
constexpr int kChunkBytes = 64 * 128;  // one 64-column swizzle block of 64 rows (Q of a warpgroup, or a K / V tile)

template <int D>
struct WgAttnTile {
  static constexpr int kQBytes = kRows * D * 2;   // [2 warpgroups][D / 64 blocks][64 rows][128 B]
  static constexpr int kKVBytes = kKeys * D * 2;  // one K or V tile: [D / 64 blocks][64 keys][128 B]
  static constexpr int kSmem = kQBytes + kStages * 2 * kKVBytes + 1024;  // + 1024-byte alignment slack
};

// Byte offset of the 16-byte unit c (8 columns, c < D / 8) of row r (< 64) in a [D / 64][64][128 B] tile.
__device__ __forceinline__ uint32_t tile_off(int r, int c) { return (c / 8) * kChunkBytes + swz(r, c % 8); }

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <int D>
__global__ void __launch_bounds__(kThreads, 1) attn_wgmma_kernel(const __grid_constant__ AttnPrefillArgs a) {
#ifdef LILY_WGMMA
  using T = WgAttnTile<D>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t kfull[kStages], vfull[kStages], empty[kStages];
  const uint32_t sbase = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t kv0 = sbase + T::kQBytes;  // stage s: K at kv0 + 2 s kKVBytes, V right after it
  const kp::AttentionParams& p = a.p;
  const int G = p.n_heads / p.n_kv_heads;
  const int64_t n_flat = p.S * G;
  const int64_t f0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kRows;  // latest (heaviest) rows first
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int64_t split0 = static_cast<int64_t>(split) * a.sp.split_len, split_end = split0 + a.sp.split_len;
  const int64_t t_last = (min64(f0 + kRows, n_flat) - 1) / G;
  const int64_t block_end = min64(split_end, p.pos0 + t_last + 1);  // exclusive; keys past it are zero-filled
  const int64_t n_tiles = block_end > split0 ? (block_end - split0 + kKeys - 1) / kKeys : 0;
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&kfull[s], 128);  // every producer thread's cp.async arrival
      bar_init(&vfull[s], 128);
      bar_init(&empty[s], 8);    // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ---- producer: K and V tiles by cp.async ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int64_t kv_stride = static_cast<int64_t>(p.n_kv_heads) * D;
    const bf16* kbase = a.kc + static_cast<int64_t>(kvh) * D;
    const bf16* vbase = a.vc + static_cast<int64_t>(kvh) * D;
    for (int64_t i = 0; i < n_tiles; ++i) {
      const int s = static_cast<int>(i % kStages);
      if (i >= kStages) bar_wait(&empty[s], static_cast<uint32_t>((i / kStages - 1) & 1));
      const int64_t k0 = split0 + i * kKeys;
      const uint32_t ks = kv0 + s * 2 * T::kKVBytes, vs = ks + T::kKVBytes;
      auto load_tile = [&](uint32_t dst, const bf16* base) {  // keys k0 .. k0 + 63 of one KV head's K or V
#pragma unroll 4
        for (int u = t; u < kKeys * D / 8; u += 128) {
          const int r = u / (D / 8), c = u % (D / 8);
          const bool valid = k0 + r < block_end;
          mma::cp_async16(dst + tile_off(r, c), base + (valid ? k0 + r : 0) * kv_stride + c * 8, valid);
        }
      };
      load_tile(ks, kbase);
      cp_bar_arrive(&kfull[s]);
      load_tile(vs, vbase);
      cp_bar_arrive(&vfull[s]);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---- consumers: warpgroup cw owns flat rows f0 + 64 cw .. + 63; warp w of it rows 16 w .. 16 w + 15 ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int cw = wg - 1, warp = t / 32, lane = t % 32, gid = lane / 4, tig = lane % 4;
  const int64_t wf0 = f0 + 64 * cw;
  const bool wg_active = wf0 < n_flat;
  const uint32_t qs = sbase + cw * (64 * D * 2);
  // Q (fp32) -> bf16, swizzled; rows past S G are zero (their scores are finite and never written).
  for (int u = t; u < 64 * D / 8; u += 128) {
    const int r = u / (D / 8), c = u % (D / 8);
    const int64_t f = wf0 + r;
    float4 v0 = make_float4(0.f, 0.f, 0.f, 0.f), v1 = v0;
    if (f < n_flat) {
      const float* src = a.q + ((f / G) * p.n_heads + static_cast<int64_t>(kvh) * G + f % G) * D + c * 8;
      v0 = *reinterpret_cast<const float4*>(src);
      v1 = *reinterpret_cast<const float4*>(src + 4);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(qs + tile_off(r, c)),
                 "r"(mma::pack_bf16x2(v0.x, v0.y)), "r"(mma::pack_bf16x2(v0.z, v0.w)),
                 "r"(mma::pack_bf16x2(v1.x, v1.y)), "r"(mma::pack_bf16x2(v1.z, v1.w))
                 : "memory");
  }
  fence_proxy_async();  // the generic-proxy stores -> wgmma's async proxy
  if (cw == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
  else asm volatile("bar.sync 2, 128;" ::: "memory");

  // Key limits (exclusive) of this thread's rows (16 warp + gid, + 8) and the warpgroup's smallest and largest.
  auto row_limit = [&](int64_t f) { return f < n_flat ? min64(split_end, p.pos0 + f / G + 1) : split_end; };
  const int64_t lim0 = row_limit(wf0 + 16 * warp + gid), lim1 = row_limit(wf0 + 16 * warp + gid + 8);
  const int64_t wg_lo = row_limit(wf0), wg_hi = row_limit(min64(wf0 + 63, n_flat - 1));
  const float sl2 = p.scale * kAttnLog2e;  // scores in log2 units: exp2f(s * sl2 - m)

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // l: this thread's columns only (quad-summed at the end)

  for (int64_t i = 0; i < n_tiles; ++i) {
    const int s = static_cast<int>(i % kStages);
    const uint32_t ph = static_cast<uint32_t>((i / kStages) & 1);
    const int64_t k0 = split0 + i * kKeys;
    const bool active = wg_active && k0 < wg_hi;  // uniform over the warpgroup
    const uint32_t ks = kv0 + s * 2 * T::kKVBytes, vs = ks + T::kKVBytes;
    uint32_t pa[kKeys / 16][4];
    bar_wait(&kfull[s], ph);
    // S accumulators: n8 block n = i / 4, element e = i % 4 (row gid + 8 (e / 2)); the first wgmma overwrites them
    float sc[kKeys / 2];
    if (active) {
      fence_proxy_async();
      wgmma_fence();
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd)
        wgmma_ss(sc, desc(qs + (kd / 4) * kChunkBytes + (kd % 4) * 32),
                 desc(ks + (kd / 4) * kChunkBytes + (kd % 4) * 32), kd > 0);
      wgmma_commit();
      wgmma_wait<0>();
      keep(sc);
      // Only tiles that cross the warpgroup's smallest limit need the mask.
      float mu0, mu1, corr0, corr1;
      softmax_max(sc, sl2, k0 + kKeys > wg_lo, k0, tig, lim0, lim1, m0, m1, mu0, mu1, corr0, corr1);
      // Rescaling O costs D / 2 multiplies; late in a long row the max rarely moves, so skip it when no row of
      // the warp changed (corr == 1 exactly). No wgmma is in flight here: O is plain registers.
      if (__any_sync(0xffffffffu, corr0 != 1.f || corr1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < D / 2; ++j) o[j] *= (j & 2) ? corr1 : corr0;
      }
      softmax_exp(sc, mu0, mu1, corr0, corr1, l0, l1);
      // The accumulators of n8 blocks 2 kk and 2 kk + 1 are exactly the A fragment of keys 16 kk .. 16 kk + 15.
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        pa[kk][0] = mma::pack_bf16x2(sc[8 * kk], sc[8 * kk + 1]);
        pa[kk][1] = mma::pack_bf16x2(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = mma::pack_bf16x2(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = mma::pack_bf16x2(sc[8 * kk + 6], sc[8 * kk + 7]);
      }
    }
    bar_wait(&vfull[s], ph);
    if (active) {
      fence_proxy_async();
      wgmma_fence();
      // O += P V: V [keys x D] is N-major for this product: 64-column blocks kChunkBytes apart, 8-key groups 1024.
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) wgmma_rs<1>(o, pa[kk], desc(vs + kk * 16 * 128, kChunkBytes, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      keep(o);
    }
    __syncwarp();
    if (lane == 0) bar_arrive(&empty[s]);  // this warp is done with stage s
  }
  if (!wg_active) return;

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t f = wf0 + 16 * warp + gid + 8 * half;
    if (f < n_flat) prefill_store_row<D>(a, f, G, kvh, split, half, tig, half ? m1 : m0, half ? l1 : l0, o);
  }
#else
  __trap();  // built without sm_90a: attention_wgmma_supported() is false there
#endif
}

template <int D>
void launch(cudaStream_t st, const AttnPrefillArgs& a) {
  using T = WgAttnTile<D>;
  static const bool attr = [] {
    check(cudaFuncSetAttribute(attn_wgmma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem),
          "attn_wgmma smem attribute");
    return true;
  }();
  (void)attr;
  const int G = a.p.n_heads / a.p.n_kv_heads;
  const int64_t row_tiles = (a.p.S * G + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(row_tiles), a.p.n_kv_heads, a.sp.n_splits);
  attn_wgmma_kernel<D><<<grid, kThreads, T::kSmem, st>>>(a);
  LILY_LAUNCH_CHECK();
}

}  // namespace

bool attention_wgmma_supported(const kp::AttentionParams& p) {
  const int D = p.head_dim;
  return device_is_sm90() && (D == 64 || D == 128 || D == 256) && p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0;
}

void attention_wgmma(cudaStream_t st, const AttnPrefillArgs& a) {
  switch (a.p.head_dim) {
    case 64: launch<64>(st, a); break;
    case 128: launch<128>(st, a); break;
    case 256: launch<256>(st, a); break;
    default: throw std::invalid_argument("[lily] cuda attention_wgmma: head_dim must be 64, 128 or 256");
  }
}

}  // namespace lily::cuda
