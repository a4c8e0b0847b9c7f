// build: csrc/cuda/deltanet.cu csrc/cuda/deltanet_seq.cu csrc/cuda/deltanet_chunk.cu
// Gated DeltaNet prefill scan timing (deltanet.cuh) at the real heads (Hk 16, Hv 32, Dk = Dv = 128) from 64 to 8,192
// rows: the sequential form (8 and 16 lanes a state row) and the chunked one (WY, chunk 64, TF32), where the chunked
// form starts to win (kScanChunkMinRows, the auto threshold), and the gated norm fused into the chunked form's output
// kernel against the scan + deltanet_gated_norm pair. Three input sets rotate (u alone is S x 32 KB a set).
// Correctness: tests/kernels/test_cuda_deltanet.py.  Usage: time_deltanet [--once] [S]
#include <cmath>
#include <string>

#include "cuda/deltanet.cuh"
#include "timing.cuh"

using namespace timing;
namespace kp = lily::kp;
namespace lc = lily::cuda;

namespace {

constexpr int Hk = 16, Hv = 32, D = 128;

kp::DeltaNetParams params_of(int64_t S) {
  return kp::DeltaNetParams{Hk, Hv, D, D, 4, 2 * Hk * D + Hv * D, 1e-6f, 1e-6f, S};
}

// q (times D^-0.5) and k l2-normalised per head, as the conv kernel leaves them: one warp per (token, head).
__global__ void normalize_qk(float* u, int64_t S, int64_t C) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= S * 2 * Hk) return;
  float* x = u + (w / (2 * Hk)) * C + (w % (2 * Hk)) * D;
  float ss = 0.f;
  for (int i = lane; i < D; i += 32) ss += x[i] * x[i];
  ss = lc::warp_sum(ss);
  const float inv = rsqrtf(ss + 1e-6f) * (w % (2 * Hk) < Hk ? rsqrtf(static_cast<float>(D)) : 1.f);
  for (int i = lane; i < D; i += 32) x[i] *= inv;
}

// Realistic ranges: v in [-1, 1]; b in [-4, 4]; a in [-3, 0.5], dt_bias in [-1, 0.5], a_log in [-1.5, 0] (g in about
// (0.27, 1)); the state in +-0.5.
struct Inputs {
  float *u, *b, *a, *dt_bias, *a_log, *ssm;
  Inputs(int64_t S, uint64_t seed) {
    const kp::DeltaNetParams p = params_of(S);
    u = drandom<float>(S * p.conv_dim, seed);
    normalize_qk<<<static_cast<unsigned>((S * 2 * Hk * 32 + 255) / 256), 256>>>(u, S, p.conv_dim);
    CK(cudaGetLastError());
    b = drandom<float>(S * Hv, seed + 1, -4.f, 4.f), a = drandom<float>(S * Hv, seed + 2, -3.f, 0.5f);
    dt_bias = drandom<float>(Hv, seed + 3, -1.f, 0.5f), a_log = drandom<float>(Hv, seed + 4, -1.5f, 0.f);
    ssm = drandom<float>(static_cast<size_t>(Hv) * D * D, seed + 5, -0.5f, 0.5f);
  }
  void release() { cudaFree(u), cudaFree(b), cudaFree(a), cudaFree(dt_bias), cudaFree(a_log), cudaFree(ssm); }
};

enum Form { kSeq8, kSeq16, kChunk, kForms };
const char* kFormName[kForms] = {"seq8", "seq16", "chunk"};

}  // namespace

int main(int argc, char** argv) {
  const char* len = parse_args(argc, argv);
  print_device("time_deltanet");
  std::printf("real heads Hk 16 Hv 32 Dk Dv 128; recurrence-equivalent work 4*Hv*Dv*Dk = %.2f MFLOP/token\n",
              4.0 * Hv * D * D / 1e6);
  std::vector<int64_t> lens = {64, 128, 256, 512, 1024, 2048, 4096, 8192};
  if (len) lens = {std::atoll(len)};
  std::vector<int64_t> chunk_wins;
  for (const int64_t S : lens) {
    const kp::DeltaNetParams p = params_of(S);
    std::vector<Inputs> sets;
    for (int i = 0; i < 3; ++i) sets.emplace_back(S, 10 * i + 1);
    float* y = dalloc<float>(S * Hv * D);
    const size_t scratch_bytes = lc::deltanet_chunk_scratch_bytes(p);
    float* scratch = dalloc<float>((scratch_bytes + 3) / 4);
    float* z = drandom<float>(S * Hv * D, 91, -3.f, 3.f);
    float* w = drandom<float>(D, 92, 0.3f, 1.5f);
    bf16* out = dalloc<bf16>(S * Hv * D);
    double ms[kForms];
    for (int f = 0; f < kForms; ++f) {
      ms[f] = median_ms([&](int i) {
        const Inputs& in = sets[i % 3];
        if (f == kChunk)
          lc::deltanet_scan(nullptr, p, in.u, in.b, in.a, in.dt_bias, in.a_log, in.ssm, y, lc::kScanChunked, scratch,
                            scratch_bytes);
        else
          lc::deltanet_scan_seq(nullptr, p, in.u, in.b, in.a, in.dt_bias, in.a_log, in.ssm, y, f == kSeq8 ? 8 : 16);
      }, 21);
      const double bytes = double(S) * (8192 + 64 + 4096) * 4 + 2.0 * Hv * D * D * 4;  // u, b, a, y, the state twice
      if (!g_once)
        std::printf("S=%5lld %-6s %10.1f us  %7.4f us/token  %6.2f TFLOP/s (rec-equiv)  %5.3f TB/s (min bytes)\n",
                    (long long)S, kFormName[f], ms[f] * 1e3, ms[f] * 1e3 / S, 4.0 * Hv * D * D * S / (ms[f] * 1e9),
                    bytes / (ms[f] * 1e9));
    }
    if (!g_once && ms[kChunk] < std::min(ms[kSeq8], ms[kSeq16])) chunk_wins.push_back(S);
    double mn[2];
    for (int fused = 0; fused < 2; ++fused)  // 0: the chunked scan, then deltanet_gated_norm; 1: the fused norm
      mn[fused] = median_ms([&](int i) {
        const Inputs& in = sets[i % 3];
        if (fused) {
          lc::deltanet_scan_norm(nullptr, p, in.u, in.b, in.a, in.dt_bias, in.a_log, in.ssm, y, z, w, out,
                                 lc::kScanChunked, scratch, scratch_bytes);
        } else {
          lc::deltanet_scan(nullptr, p, in.u, in.b, in.a, in.dt_bias, in.a_log, in.ssm, y, lc::kScanChunked, scratch,
                            scratch_bytes);
          lc::deltanet_gated_norm(nullptr, p, y, z, w, out);
        }
      }, 21);
    if (g_once) std::printf("ONCE deltanet scans S=%lld\n", (long long)S);
    else
      std::printf("S=%5lld chunk/seq8 %.2f; chunk+norm %.1f us vs chunk, gated_norm %.1f us (%.3f)\n", (long long)S,
                  ms[kChunk] / ms[kSeq8], mn[1] * 1e3, mn[0] * 1e3, mn[1] / mn[0]);
    for (auto& in : sets) in.release();
    cudaFree(y), cudaFree(scratch), cudaFree(z), cudaFree(w), cudaFree(out);
  }
  if (!g_once && !chunk_wins.empty())
    std::printf("CROSSOVER chunk faster than the best sequential form from S=%lld (kScanChunkMinRows %lld)\n",
                (long long)chunk_wins.front(), (long long)lc::kScanChunkMinRows);
  return 0;
}
