// build: csrc/cuda/attention.cu csrc/cuda/attention_prefill.cu csrc/cuda/attention_prefill_wgmma.cu csrc/cuda/attention_decode.cu
// Attention timing (attention.cuh) at the real heads (Hq 16, Hkv 2, D 256): prefill chunks on the wgmma kernel and its
// mma.sync twin (causal FLOPs against the measured 790 TFLOP/s), one decode row on the CUDA-core kernel and the
// tensor-core decode kernel (K/V bytes against the bandwidth). Input sets rotate so the L2 does not hold them.
// Correctness: tests/kernels/test_cuda_attention.py.  Usage: time_attention [--once]
#include <cmath>

#include "cuda/attention.cuh"
#include "timing.cuh"

using namespace timing;
namespace kp = lily::kp;
namespace lc = lily::cuda;

namespace {

int g_sm_count = 0;

struct Shape {
  int D, Hq, Hkv;
  int64_t S, pos0;
};

kp::AttentionParams params_of(const Shape& s) {
  kp::AttentionParams p{};
  p.n_heads = s.Hq, p.n_kv_heads = s.Hkv, p.head_dim = s.D, p.rotary_dim = std::min(64, s.D);
  p.rope_theta = 1e7f, p.eps = 1e-6f, p.scale = 1.f / std::sqrt(static_cast<float>(s.D));
  p.pos0 = s.pos0, p.S = s.S;
  return p;
}

// One input set: q fp32 [S, Hq, D] in +-4, qg [S, Hq, 2D] in +-3, bf16 caches [pos0 + S, Hkv*D] (k in +-sqrt(3), v in
// +-1: scores ~ N(0, 2.3), a softmax neither flat nor one-hot).
struct Inputs {
  float *q, *qg;
  bf16 *k, *v;
  Inputs(const Shape& s, uint64_t seed) {
    const int64_t kv = (s.pos0 + s.S) * s.Hkv * s.D;
    q = drandom<float>(s.S * s.Hq * s.D, seed + 1, -4.f, 4.f);
    qg = drandom<float>(s.S * s.Hq * 2 * s.D, seed + 2, -3.f, 3.f);
    k = drandom<bf16>(kv, seed + 3, -1.7320508f, 1.7320508f);
    v = drandom<bf16>(kv, seed + 4);
  }
  void release() { cudaFree(q), cudaFree(qg), cudaFree(k), cudaFree(v); }
};

double time_impl(const Shape& s, std::vector<Inputs>& sets, bool tc_decode, bool wgmma) {
  const kp::AttentionParams p = params_of(s);
  const kp::AttnSplitParams sp = lc::attention_plan(p, g_sm_count);
  float* part = dalloc<float>(static_cast<size_t>(s.S) * s.Hq * sp.n_splits * (s.D + 2));
  bf16* o = dalloc<bf16>(s.S * s.Hq * s.D);
  const double ms = median_ms([&](int i) {
    const Inputs& in = sets[i % sets.size()];
    lc::attention(nullptr, p, sp, in.q, in.qg, in.k, in.v, part, o, nullptr, tc_decode, wgmma);
  }, 15, 2);
  cudaFree(part), cudaFree(o);
  return ms;
}

bool has_wgmma(const Shape& s) { return s.S > 1 && lc::attention_wgmma_supported(params_of(s)); }

void time_prefill(const Shape& s) {
  std::vector<Inputs> sets;
  for (int i = 0; i < 3; ++i) sets.emplace_back(s, 100 * i);
  // causal FLOPs: QK^T and PV, 2 FLOP a multiply-add each, over sum_t (pos0 + t + 1) keys
  const double flops = 4.0 * s.D * s.Hq * (static_cast<double>(s.S) * s.pos0 + 0.5 * s.S * (s.S + 1.0));
  for (const bool wgmma : {true, false}) {
    if (!wgmma && !has_wgmma(s)) break;  // the mma.sync kernel was the first row
    const double t = time_impl(s, sets, false, wgmma);
    const char* impl = has_wgmma(s) && wgmma ? "wgmma" : "mma";
    if (g_once) std::printf("ONCE attention %s S=%lld pos0=%lld\n", impl, (long long)s.S, (long long)s.pos0);
    else
      std::printf("TIME attention %s D=%d Hq=%d Hkv=%d S=%lld pos0=%lld: %.3f ms %.1f TFLOP/s (%.1f%% of 790)\n", impl,
                  s.D, s.Hq, s.Hkv, (long long)s.S, (long long)s.pos0, t, flops / t * 1e-9, flops / t * 1e-9 / 7.9);
  }
  for (auto& in : sets) in.release();
}

// One decode step's attention (S = 1) at a long context: a stream of the K/V cache, reported as bandwidth; the
// CUDA-core kernel (the gqa_pack = 0 ablation's path) and the tensor-core decode kernel (the decode step's).
void time_decode(const Shape& s) {
  std::vector<Inputs> sets;
  for (int i = 0; i < 3; ++i) sets.emplace_back(s, 100 * i);
  const double bytes = static_cast<double>(s.pos0 + 1) * s.Hkv * s.D * 2.0 * 2.0;  // K and V, bf16
  const double cc = time_impl(s, sets, false, true), tc = time_impl(s, sets, true, true);
  if (g_once) std::printf("ONCE decode attention keys=%lld\n", (long long)(s.pos0 + 1));
  else
    std::printf("TIME decode attention D=%d Hq=%d Hkv=%d keys=%lld: CUDA cores %.1f us %.2f TB/s | tensor cores "
                "%.1f us %.2f TB/s (%.2fx)\n", s.D, s.Hq, s.Hkv, (long long)(s.pos0 + 1), cc * 1e3, bytes / cc * 1e-9,
                tc * 1e3, bytes / tc * 1e-9, cc / tc);
  for (auto& in : sets) in.release();
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_attention");
  CK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, 0));
  time_prefill({256, 16, 2, 2048, 0});
  time_prefill({256, 16, 2, 4096, 0});  // a 4K prompt's attention layer
  time_prefill({256, 16, 2, 2048, 14336});
  time_prefill({256, 16, 2, 2048, 129024});
  time_prefill({256, 16, 2, 8192, 122880});  // the last 8,192-row chunk of a 128K prompt
  time_prefill({256, 16, 2, 16, 129024});  // a short last chunk at 128K: the split path
  time_decode({256, 16, 2, 1, 4095});
  time_decode({256, 16, 2, 1, 32767});
  time_decode({256, 16, 2, 1, 131071});
  return 0;
}
