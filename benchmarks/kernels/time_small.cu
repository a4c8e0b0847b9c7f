// build: csrc/cuda/embed_norm.cu csrc/cuda/moe.cu csrc/cuda/deltanet.cu csrc/cuda/deltanet_seq.cu csrc/cuda/deltanet_chunk.cu csrc/cuda/gemm.cu csrc/cuda/gemm_mma.cu csrc/cuda/gemm_wgmma.cu csrc/cuda/gemm_one.cu
// Timing of the small prefill kernels at a 4K chunk of the real model: RMSNorm (hidden 2,048), the MoE pair sort
// (4,096 and 16,384 tokens x top-8 of 256, skewed), the combine, the DeltaNet conv (C 8,192, K 4), each against the
// bytes it must move. Correctness: tests/kernels/test_cuda_norm.py, test_cuda_moe.py, test_cuda_deltanet.py.
// Usage: time_small [--once]
#include <random>

#include "cuda/deltanet.cuh"
#include "cuda/embed_norm.cuh"
#include "cuda/gemm.cuh"
#include "cuda/moe.cuh"
#include "timing.cuh"

using namespace timing;
namespace kp = lily::kp;
namespace lc = lily::cuda;

namespace {

void report(const char* what, double ms, double bytes) {
  if (g_once) std::printf("ONCE %s\n", what);
  else std::printf("TIME %-40s %8.1f us (%.2f TB/s)\n", what, ms * 1e3, bytes / (ms * 1e9));
}

void time_rms_norm(int64_t rows, int64_t n) {
  float *x = drandom<float>(rows * n, 1), *w = drandom<float>(n, 2, 0.2f, 2.f);
  bf16* y = dalloc<bf16>(rows * n);
  report("rms_norm 4096 x 2048", median_ms([&](int) { lc::rms_norm(nullptr, x, w, 1e-6f, rows, n, y); }),
         6.0 * rows * n + 4.0 * n);
  cudaFree(x), cudaFree(w), cudaFree(y);
}

// k distinct experts a token, ~70% of the picks on 4 experts (several tiles an expert, most experts empty).
void time_sort(int64_t S, int E, int k, int tile) {
  std::mt19937_64 rng(S);
  std::vector<int32_t> idx(S * k);
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        e = rng() % 10 < 7 ? static_cast<int>(rng() % 4) : static_cast<int>(rng() % E);
        dup = false;
        for (int i = 0; i < j; ++i) dup |= idx[s * k + i] == e;
      } while (dup);
      idx[s * k + j] = e;
    }
  kp::MoeParams p{2048, E, k, 512, 512, 1, S};
  const int64_t P = S * k, mt = lc::grouped_max_tiles(P, E, tile);
  int32_t* di = dupload(idx);
  float* dw = drandom<float>(P, 3, 0.f, 1.f);
  lc::SortBuffers b;
  b.pair_row = dalloc<int32_t>(P), b.pair_id = dalloc<int32_t>(P), b.pair_w = dalloc<float>(P);
  b.n_tiles = dalloc<int32_t>(1), b.tile_expert = dalloc<int32_t>(mt), b.tile_row0 = dalloc<int32_t>(mt);
  b.tile_rows = dalloc<int32_t>(mt), b.block_base = dalloc<int32_t>(lc::moe_sort_scratch(P, E));
  char what[64];
  std::snprintf(what, sizeof what, "moe_sort S=%lld E=%d k=%d skewed", (long long)S, E, k);
  report(what, median_ms([&](int) { lc::moe_sort(nullptr, p, di, dw, tile, b); }), 8.0 * P * 3);
  for (void* q : {static_cast<void*>(di), static_cast<void*>(dw), static_cast<void*>(b.pair_row),
                  static_cast<void*>(b.pair_id), static_cast<void*>(b.pair_w), static_cast<void*>(b.n_tiles),
                  static_cast<void*>(b.tile_expert), static_cast<void*>(b.tile_row0), static_cast<void*>(b.tile_rows),
                  static_cast<void*>(b.block_base)})
    cudaFree(q);
}

void time_combine(int64_t S, int64_t H, int k) {
  kp::MoeParams p{static_cast<int32_t>(H), 256, k, 512, 512, 1, S};
  float *sh = drandom<float>(S * H, 4), *gate = drandom<float>(S, 5, -8.f, 8.f), *x = drandom<float>(S * H, 6);
  bf16* d = drandom<bf16>(S * k * H, 7, -0.3f, 0.3f);
  report("moe_combine 4096 x 2048, top-8", median_ms([&](int) { lc::moe_combine(nullptr, p, sh, gate, d, x); }),
         4.0 * S * H * 3 + 2.0 * S * H * k);
  cudaFree(sh), cudaFree(gate), cudaFree(x), cudaFree(d);
}

void time_conv(int64_t S) {
  const kp::DeltaNetParams p{16, 32, 128, 128, 4, 8192, 1e-6f, 1e-6f, S};
  const int64_t C = p.conv_dim;
  float *qkv = drandom<float>(S * C, 8), *w = drandom<float>(C * 4, 9, -0.6f, 0.6f);
  float *st = drandom<float>(3 * C, 10), *u = dalloc<float>(S * C);
  report("deltanet_conv 4096 x 8192, K 4", median_ms([&](int) { lc::deltanet_conv(nullptr, p, qkv, w, st, u); }),
         4.0 * (2 * S * C + 2 * 3 * C + C * 4));
  cudaFree(qkv), cudaFree(w), cudaFree(st), cudaFree(u);
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_small");
  time_rms_norm(4096, 2048);
  time_sort(4096, 256, 8, 128);
  time_sort(16384, 256, 8, 64);
  time_combine(4096, 2048, 8);
  time_conv(4096);
  return 0;
}
