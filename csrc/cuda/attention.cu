#include "cuda/attention.cuh"
#include "cuda/mma_bf16.cuh"

namespace lily::cuda {
namespace {

constexpr int kKeyTile = 32;  // keys per shared-memory tile: one key per lane when scoring

// One warp per (row, head) of Hq query heads + Hkv key heads: RMSNorm, partial RoPE (angles in double,
// as the CPU twin), then q to fp32 scratch and k, v to the bf16 cache.
constexpr int kRopePerLane = 4;  // rotary pairs per lane: rotary_dim <= 256 (attention_prep checks it)
__global__ void prep_kernel(kp::AttentionParams p, const float* qg, const float* k, const float* v, const float* qn,
                            const float* kn, float* q, bf16* kc, bf16* vc, const int32_t* dpos) {
  extern __shared__ float prep_smem[];
  pdl_trigger();
  // The rotation depends on the position alone (decode: the control block's, written before the step), so its
  // double-precision pow / cos / sin run before the PDL wait instead of after the previous kernel (this kernel's
  // marginal time in the step at 4K: 5.58 -> 4.06 us, dev/decode_trace.py; benchmarks/results/decode_in_situ_h200.md).
  if (dpos) p.pos0 = *dpos;  // decode graphs: the position lives on the device
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = p.head_dim, nh = p.n_heads + p.n_kv_heads;
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  const int64_t t = wid / nh;
  const int half = p.rotary_dim / 2;
  float cs[kRopePerLane], sn[kRopePerLane];
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j) {
    const int i = lane + 32 * j;
    cs[j] = 1.f, sn[j] = 0.f;
    if (i < half && wid < p.S * nh) {
      const double inv_freq = pow(static_cast<double>(p.rope_theta), -2.0 * i / p.rotary_dim);
      const double ang = static_cast<double>(p.pos0 + t) * inv_freq;
      cs[j] = static_cast<float>(cos(ang)), sn[j] = static_cast<float>(sin(ang));
    }
  }
  pdl_wait();  // PDL launch (common.cuh): inputs are the previous kernel's
  if (wid >= p.S * nh) return;
  float* row = prep_smem + warp * D;
  const int64_t kv_row = static_cast<int64_t>(p.n_kv_heads) * D;
  const int hh = static_cast<int>(wid % nh);
  const bool is_q = hh < p.n_heads;
  const float* src = is_q ? qg + (t * p.n_heads + hh) * 2 * D : k + t * kv_row + static_cast<int64_t>(hh - p.n_heads) * D;
  const float* w = is_q ? qn : kn;
  float ss = 0.f;
  for (int i = lane; i < D; i += 32) {
    row[i] = src[i];
    ss += row[i] * row[i];
  }
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / static_cast<float>(D) + p.eps);
  for (int i = lane; i < D; i += 32) row[i] = row[i] * inv * w[i];
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kRopePerLane; ++j) {
    const int i = lane + 32 * j;
    if (i < half) {
      const float a = row[i], b = row[i + half];
      row[i] = a * cs[j] - b * sn[j];
      row[i + half] = b * cs[j] + a * sn[j];
    }
  }
  __syncwarp();
  if (is_q) {
    for (int i = lane; i < D; i += 32) q[(t * p.n_heads + hh) * D + i] = row[i];
  } else {
    const int64_t off = (p.pos0 + t) * kv_row + static_cast<int64_t>(hh - p.n_heads) * D;
    const float* vs = v + t * kv_row + static_cast<int64_t>(hh - p.n_heads) * D;
    for (int i = lane; i < D; i += 32) {
      kc[off + i] = __float2bfloat16(row[i]);
      vc[off + i] = __float2bfloat16(vs[i]);
    }
  }
}

// Block = (tile of R query rows, KV head g, key split s); one warp per (row, query head of g's group), so
// the G heads of a KV head share every K/V tile load (GQA packing). Scores: one key per lane against q in
// shared memory; online softmax per warp; output dims lane + 32 i per lane. Writes (m, l, o[D]) partials.
// K/V tiles arrive by 16-byte cp.async into two buffers: tile i+1 is in flight while tile i is scored (the decode
// step at long context is a stream of the cache; one synchronous load round trip per tile left the H200 ~4x under
// its bandwidth there).
using mma::cp_async16;  // mma_bf16.cuh

template <int D>
__global__ void attn_kernel(kp::AttentionParams p, kp::AttnSplitParams sp, const float* q, const bf16* kc,
                            const bf16* vc, float* part, const int32_t* dpos) {
  pdl_trigger();
  pdl_wait();  // PDL launch (common.cuh): inputs are the previous kernel's
  if (dpos) {  // decode graphs: position on the device, n_splits fixed, split length from the key count
    p.pos0 = *dpos;
    const int64_t keys = p.pos0 + p.S;
    sp.split_len = static_cast<int32_t>(((keys + sp.n_splits - 1) / sp.n_splits + kKeyTile - 1) / kKeyTile * kKeyTile);
  }
  // bf16 row stride: 16-byte rows for cp.async; scores read 16 bytes per lane, so the 8 lanes of a phase start
  // 4 banks apart (conflict-free).
  constexpr int LD = D + 8;
  constexpr int NO = D / 32;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* Kb = reinterpret_cast<bf16*>(attn_smem);  // [2][kKeyTile][LD]
  bf16* Vb = Kb + 2 * kKeyTile * LD;              // [2][kKeyTile][LD]
  float* qs = reinterpret_cast<float*>(Vb + 2 * kKeyTile * LD);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // GB query heads of KV head g per block: all G of them share each K/V tile load (GQA packing), or fewer
  // (heads_per_block, the ablation) so several blocks load the same tiles.
  const int G = p.n_heads / p.n_kv_heads, R = sp.rows_per_block;
  const int GB = sp.heads_per_block > 0 ? sp.heads_per_block : G;
  const int g = blockIdx.y / (G / GB), s = blockIdx.z;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * R;
  const int64_t t = t0 + warp / GB;
  const int h = g * G + (blockIdx.y % (G / GB)) * GB + warp % GB;
  const bool active = warp < R * GB && t < p.S;
  const int64_t kv_row = static_cast<int64_t>(p.n_kv_heads) * D;
  const int64_t split0 = static_cast<int64_t>(s) * sp.split_len;
  const int64_t t_last = min64(t0 + R, p.S) - 1;
  const int64_t block_end = min64(split0 + sp.split_len, p.pos0 + t_last + 1);
  const int64_t my_end = min64(split0 + sp.split_len, p.pos0 + t + 1);

  float* qw = qs + warp * D;
  if (active)
    for (int i = lane; i < D; i += 32) qw[i] = q[(t * p.n_heads + h) * D + i];
  float m = -INFINITY, l = 0.f, o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i] = 0.f;

  // Rows past block_end are never copied (nor read: scores need k0 + lane < my_end, the sum j < my_end - k0).
  const int n_tiles = block_end > split0 ? static_cast<int>((block_end - split0 + kKeyTile - 1) / kKeyTile) : 0;
  auto issue = [&](int it) {
    const int64_t k0 = split0 + static_cast<int64_t>(it) * kKeyTile;
    bf16* Kd = Kb + (it & 1) * kKeyTile * LD;
    bf16* Vd = Vb + (it & 1) * kKeyTile * LD;
    for (int u = threadIdx.x; u < kKeyTile * D / 8; u += blockDim.x) {
      const int r = u / (D / 8), c = u % (D / 8);
      if (k0 + r < block_end) {
        const int64_t off = (k0 + r) * kv_row + static_cast<int64_t>(g) * D + c * 8;
        cp_async16(Kd + r * LD + c * 8, kc + off);
        cp_async16(Vd + r * LD + c * 8, vc + off);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if (n_tiles > 0) issue(0);
  for (int it = 0; it < n_tiles; ++it) {
    const int64_t k0 = split0 + static_cast<int64_t>(it) * kKeyTile;
    if (it + 1 < n_tiles) {
      issue(it + 1);  // its buffer was released by the barrier that ended tile it - 1
      asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();  // tile it has landed for every thread (and q is staged, on the first pass)
    const bf16* Ks = Kb + (it & 1) * kKeyTile * LD;
    const bf16* Vs = Vb + (it & 1) * kKeyTile * LD;
    if (active && k0 < my_end) {
      const bool valid = k0 + lane < my_end;
      float sc = -INFINITY;
      if (valid) {
        const uint4* kr = reinterpret_cast<const uint4*>(Ks + lane * LD);
        const float2* q2 = reinterpret_cast<const float2*>(qw);
        float acc = 0.f;  // pairs in ascending order, as before the 16-byte reads
#pragma unroll 4
        for (int d8 = 0; d8 < D / 8; ++d8) {
          const uint4 k8 = kr[d8];
          const uint32_t kw[4] = {k8.x, k8.y, k8.z, k8.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kw[j]));
            const float2 qf = q2[4 * d8 + j];
            acc += qf.x * kf.x + qf.y * kf.y;
          }
        }
        sc = acc * p.scale;
      }
      const float m_new = fmaxf(m, warp_max(sc));
      const float pr = valid ? expf(sc - m_new) : 0.f;
      const float corr = expf(m - m_new);  // 0 on the first tile (m = -inf)
      l = l * corr + warp_sum(pr);
#pragma unroll
      for (int i = 0; i < NO; ++i) o[i] *= corr;
      const int nk = static_cast<int>(min64(kKeyTile, my_end - k0));
      for (int j = 0; j < nk; ++j) {
        const float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i] += pj * bf2f(Vs[j * LD + lane + 32 * i]);
      }
      m = m_new;
    }
    __syncthreads();  // every warp is done with buffer it & 1 before tile it + 2 is copied into it
  }
  if (!active) return;
  float* out = part + ((t * p.n_heads + h) * sp.n_splits + s) * (D + 2);
  if (lane == 0) out[0] = m, out[1] = l;
#pragma unroll
  for (int i = 0; i < NO; ++i) out[2 + lane + 32 * i] = o[i];
}

// One block per (row, query head, 32 output dims): warp 0 turns the split maxima into merge weights in shared
// memory, then warp w merges splits w, w + 8, ... for the block's 32 dims (a lane per dim), the 8 warps' sums are
// added, normalised, gated by the sigmoid output gate and written as bf16. (One block per (row, head) with a thread
// per dim walked all the splits serially: 10.9 us per decode launch at 4K alone under ncu, 16 blocks; this form,
// 8x the blocks and an eighth of the chain, 6.5 us, +1.2% of the decode step.)
constexpr int kCombineWarps = 8;
__global__ void __launch_bounds__(kCombineWarps * 32)
    attn_combine_kernel(kp::AttentionParams p, kp::AttnSplitParams sp, const float* part, const float* qg, bf16* o) {
  extern __shared__ float wts[];  // [n_splits]
  __shared__ float red[kCombineWarps][32];
  pdl_trigger();
  pdl_wait();  // PDL launch (common.cuh): inputs are the previous kernel's
  const int64_t wid = blockIdx.x;
  const int D = p.head_dim, ns = sp.n_splits, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int d = blockIdx.y * 32 + lane;  // D is a multiple of 32
  const float* pp = part + wid * ns * (D + 2);
  if (warp == 0) {
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, pp[s * (D + 2)]);
    M = warp_max(M);
    float L = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float ms = pp[s * (D + 2)];
      wts[s] = ms == -INFINITY ? 0.f : expf(ms - M);
      L += wts[s] * pp[s * (D + 2) + 1];
    }
    L = warp_sum(L);
    __syncwarp();
    for (int s = lane; s < ns; s += 32) wts[s] /= L;
  }
  __syncthreads();
  float acc = 0.f;
#pragma unroll 4
  for (int s = warp; s < ns; s += kCombineWarps) acc += pp[s * (D + 2) + 2 + d] * wts[s];
  red[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
    // the sum in split order groups (w, w + 8, ...) then over w: a fixed order, deterministic
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) v += red[w][lane];
    const float gate = qg[wid * 2 * D + D + d];  // row t, head h: qg[(t*Hq + h)*2D + D ..]
    o[wid * D + d] = __float2bfloat16(v * (1.f / (1.f + expf(-gate))));
  }
}

int rows_per_block(const kp::AttentionParams& p) {
  const int G = p.n_heads / p.n_kv_heads;
  return G >= 8 ? 1 : 8 / G;
}

template <int D>
void launch_attn(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
                 const bf16* kc, const bf16* vc, float* part, const int32_t* dpos) {
  const int G = p.n_heads / p.n_kv_heads, GB = sp.heads_per_block > 0 ? sp.heads_per_block : G;
  if (G % GB != 0) throw std::invalid_argument("[lily] cuda attention: heads_per_block must divide the GQA group");
  const int warps = sp.rows_per_block * GB;
  const size_t smem = 4 * kKeyTile * (D + 8) * sizeof(bf16) + warps * D * sizeof(float);  // 2 buffers of K and V
  if (smem > 48 * 1024)
    LILY_CUDA_CHECK(cudaFuncSetAttribute(attn_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((p.S + sp.rows_per_block - 1) / sp.rows_per_block),
                  static_cast<unsigned>(p.n_kv_heads * (G / GB)), sp.n_splits);
  launch_pdl(attn_kernel<D>, grid, dim3(warps * 32), smem, st, p, sp, q, kc, vc, part, dpos);
}

}  // namespace

void attention_prep(cudaStream_t st, const kp::AttentionParams& p, const float* qg, const float* k, const float* v,
                    const float* q_norm, const float* k_norm, float* q, bf16* k_cache, bf16* v_cache,
                    const int32_t* dpos) {
  const int64_t warps = p.S * (p.n_heads + p.n_kv_heads);
  if (p.rotary_dim > 2 * 32 * kRopePerLane)  // (even and <= head_dim: the config's own checks)
    throw std::invalid_argument("[lily] cuda attention: rotary_dim " + std::to_string(p.rotary_dim) +
                                ", expected at most " + std::to_string(2 * 32 * kRopePerLane));
  launch_pdl(prep_kernel, dim3(static_cast<unsigned>((warps + 7) / 8)), dim3(256), 8 * p.head_dim * sizeof(float), st,
             p, qg, k, v, q_norm, k_norm, q, k_cache, v_cache, dpos);
}

kp::AttnSplitParams attention_plan(const kp::AttentionParams& p, int sm_count) {
  if (p.S > 1 && attention_mma_supported(p)) return attention_mma_plan(p, sm_count);
  kp::AttnSplitParams sp{};
  sp.rows_per_block = rows_per_block(p);
  const int64_t keys = p.pos0 + p.S;
  const int64_t base = (p.S + sp.rows_per_block - 1) / sp.rows_per_block * p.n_kv_heads;
  // Enough blocks for two waves; a split keeps at least 64 keys so the merge stays cheap.
  int64_t n = std::clamp<int64_t>((2 * sm_count + base - 1) / base, 1, (keys + 63) / 64);
  const int64_t len = ((keys + n - 1) / n + kKeyTile - 1) / kKeyTile * kKeyTile;
  sp.split_len = static_cast<int32_t>(len);
  sp.n_splits = static_cast<int32_t>((keys + len - 1) / len);
  return sp;
}

void attention(cudaStream_t st, const kp::AttentionParams& p, const kp::AttnSplitParams& sp, const float* q,
               const float* qg, const bf16* k_cache, const bf16* v_cache, float* part, bf16* o, const int32_t* dpos,
               bool tensor_core_decode, bool wgmma_prefill) {
  if (p.S > 1 && dpos == nullptr && attention_mma_supported(p)) {
    attention_mma(st, p, sp, q, qg, k_cache, v_cache, part, o, wgmma_prefill);
    if (sp.n_splits == 1) return;  // o written, gate applied
  } else if (tensor_core_decode && attention_decode_tc_supported(p)) {
    attention_decode_tc(st, p, sp, q, k_cache, v_cache, part, dpos);
  } else {
    switch (p.head_dim) {
      case 32: launch_attn<32>(st, p, sp, q, k_cache, v_cache, part, dpos); break;
      case 64: launch_attn<64>(st, p, sp, q, k_cache, v_cache, part, dpos); break;
      case 128: launch_attn<128>(st, p, sp, q, k_cache, v_cache, part, dpos); break;
      case 256: launch_attn<256>(st, p, sp, q, k_cache, v_cache, part, dpos); break;
      default: throw std::invalid_argument("[lily] cuda attention: head_dim must be 32, 64, 128 or 256");
    }
  }
  // Rounded up to 16 bytes: the compiler may read the weights with vector loads past n_splits.
  const size_t smem = (sp.n_splits * sizeof(float) + 31) / 16 * 16;
  launch_pdl(attn_combine_kernel, dim3(static_cast<unsigned>(p.S * p.n_heads), static_cast<unsigned>(p.head_dim / 32)),
             dim3(kCombineWarps * 32), smem, st, p, sp, part, qg, o);
}

}  // namespace lily::cuda
