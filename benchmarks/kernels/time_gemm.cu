// build: csrc/cuda/gemm.cu csrc/cuda/gemm_mma.cu csrc/cuda/gemm_wgmma.cu csrc/cuda/gemm_one.cu
// Prefill GEMM timing (gemm.cuh) at the model's sizes: the engine's dispatch (wgmma / mma.sync) against the wmma
// fallback (cuda::force_gemm_fallback), the concatenated DeltaNet in-projection against its four parts, and the grouped
// MoE products over a skewed routing at every expert tile. Weights rotate over several copies so the L2 does not hold
// them. Correctness: tests/kernels/test_cuda_linear.py.  Usage: time_gemm [--once]
#include <cmath>
#include <random>
#include <string>

#include "cuda/gemm.cuh"
#include "timing.cuh"

using namespace timing;
namespace lc = lily::cuda;

namespace {

constexpr double kPeakTflops = 790.0;

void print_time(const std::string& name, double ms, double flop, double ms_old) {
  if (g_once) return (void)std::printf("ONCE %s\n", name.c_str());
  const double tf = flop / (ms * 1e-3) / 1e12;
  std::printf("TIME %-44s %8.1f us %7.1f TFLOP/s (%4.1f%% of %.0f)", name.c_str(), ms * 1e3, tf, 100 * tf / kPeakTflops,
              kPeakTflops);
  if (ms_old > 0) std::printf("  x%.2f vs the first", ms_old / ms);
  std::printf("\n");
}

enum Mode { kStore, kAcc, kDual };
const char* kModeName[] = {"store", "acc", "dual"};

void time_plain(const char* name, int bits, int64_t M, int64_t N, int64_t K, Mode mode) {
  constexpr int kSets = 4;
  const bool dual = mode == kDual;
  DevWeight w0[kSets], w1[kSets];
  bf16* A[kSets];
  for (int s = 0; s < kSets; ++s) {
    w0[s].make(bits, 1, N, K, 100 + 10 * s);
    if (dual) w1[s].make(bits, 1, N, K, 105 + 10 * s);
    A[s] = drandom<bf16>(M * K, 7 + s);
  }
  float* y = drandom<float>(M * N, 1);
  bf16* yb = dalloc<bf16>(M * N);
  double ms[2];
  for (int impl = 0; impl < 2; ++impl) {  // 0: the wmma fallback, 1: the engine's dispatch
    lc::force_gemm_fallback(impl == 0);
    ms[impl] = median_ms([&](int i) {
      const int s = i % kSets;
      if (dual) lc::linear_silu_mul(nullptr, w0[s].d, w1[s].d, A[s], K, M, yb, N);
      else lc::linear(nullptr, w0[s].d, A[s], K, M, y, N, mode == kAcc);
    });
  }
  lc::force_gemm_fallback(false);
  const double flop = 2.0 * M * N * K * (dual ? 2 : 1);
  char nm[160];
  std::snprintf(nm, sizeof nm, "%s q%d %s %lldx%lldx%lld", name, bits, kModeName[mode], (long long)M, (long long)N,
                (long long)K);
  print_time(std::string("wmma/") + nm, ms[0], flop, 0);
  print_time(std::string("engine/") + nm, ms[1], flop, ms[0]);
  for (int s = 0; s < kSets; ++s) {
    w0[s].free_all(), cudaFree(A[s]);
    if (dual) w1[s].free_all();
  }
  cudaFree(y), cudaFree(yb);
}

// Row view [row0, row0 + n) of a one-expert weight (the concatenation's parts).
lc::DLinear row_view(lc::DLinear d, int64_t row0, int64_t n) {
  const int64_t wpr = d.p.in * d.p.bits / 32, gpr = d.p.in / 64;
  d.p.out = n, d.p.expert_words = n * wpr, d.p.expert_groups = n * gpr, d.p.expert_elems = n * d.p.in;
  d.codes += row0 * wpr, d.scales += row0 * gpr, d.biases += row0 * gpr;
  return d;
}

// The DeltaNet in-projection (qkv 8192, z 4096, b 32, a 32 rows) at M rows: one concatenated GEMM against the four.
void time_concat(int64_t M) {
  constexpr int kSets = 4;
  const int64_t ns[4] = {8192, 4096, 32, 32}, N = 12352, K = 2048;
  DevWeight w[kSets];
  bf16* A[kSets];
  std::vector<lc::DLinear> parts[kSets];
  for (int s = 0; s < kSets; ++s) {
    w[s].make(4, 1, N, K, 300 + 10 * s);
    A[s] = drandom<bf16>(M * K, 17 + s);
    for (int64_t i = 0, row0 = 0; i < 4; row0 += ns[i], ++i) parts[s].push_back(row_view(w[s].d, row0, ns[i]));
  }
  std::vector<float*> ys;
  for (int64_t n : ns) ys.push_back(dalloc<float>(M * n));
  double ms[2];
  for (int form = 0; form < 2; ++form)  // 0: the parts alone, 1: concatenated
    ms[form] = median_ms([&](int i) {
      const int s = i % kSets;
      lc::linear_concat(nullptr, form ? w[s].d : lc::DLinear{}, parts[s].data(), 4, A[s], K, M, ys.data(), ns);
    });
  char nm[160];
  std::snprintf(nm, sizeof nm, "deltanet_in q4 %lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
  print_time(std::string("parts/") + nm, ms[0], 2.0 * M * N * K, 0);
  print_time(std::string("concat/") + nm, ms[1], 2.0 * M * N * K, ms[0]);
  for (int s = 0; s < kSets; ++s) w[s].free_all(), cudaFree(A[s]);
  for (float* y : ys) cudaFree(y);
}

// Top-8 of 256 skewed experts per token (Gumbel top-k over log-normal popularity), like real routing: pairs sorted by
// expert (counts), their token rows (a_rows) and output rows (y_rows), routing weights (scale).
struct Routing {
  std::vector<int> counts;
  std::vector<int32_t> a_rows, y_rows;
  std::vector<float> scale;
};
Routing routing_skewed(std::mt19937_64& rng, int64_t S, int E, int k) {
  std::normal_distribution<double> nd(0.0, 1.2);
  std::uniform_real_distribution<double> ud(1e-300, 1.0);
  std::vector<double> logp(E);
  for (auto& v : logp) v = nd(rng);
  std::vector<std::vector<int32_t>> tok(E);
  std::vector<std::pair<double, int>> key(E);
  for (int64_t s = 0; s < S; ++s) {
    for (int e = 0; e < E; ++e) key[e] = {logp[e] - std::log(-std::log(ud(rng))), e};
    std::partial_sort(key.begin(), key.begin() + k, key.end(), std::greater<>());
    for (int j = 0; j < k; ++j) tok[key[j].second].push_back(static_cast<int32_t>(s * k + j));
  }
  Routing R;
  for (int e = 0; e < E; ++e) {
    R.counts.push_back(static_cast<int>(tok[e].size()));
    for (int32_t id : tok[e]) R.a_rows.push_back(id / k), R.y_rows.push_back(id), R.scale.push_back(0.125f);
  }
  return R;
}

// The tile map moe_sort builds for `tile` rows per tile (per expert, consecutive tiles), on the device.
lc::GroupMap upload_map(const std::vector<int>& counts, int tile, const int32_t* a_rows, const int32_t* y_rows,
                        const float* scale, std::vector<void*>& owned) {
  std::vector<int32_t> te, t0, tr;
  int off = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int r = 0; r < counts[e]; r += tile)
      te.push_back(static_cast<int32_t>(e)), t0.push_back(off + r), tr.push_back(std::min(tile, counts[e] - r));
    off += counts[e];
  }
  // the grid bound the engine launches (the tile count is on the device): the capacity, unused entries never read
  const int64_t cap = lc::grouped_max_tiles(off, static_cast<int>(counts.size()), tile);
  const int32_t n = static_cast<int32_t>(te.size());
  te.resize(cap, 0), t0.resize(cap, 0), tr.resize(cap, 0);
  lc::GroupMap g;
  int32_t* p[4] = {dupload(std::vector<int32_t>{n}), dupload(te), dupload(t0), dupload(tr)};
  owned.insert(owned.end(), p, p + 4);
  g.n_tiles = p[0], g.tile_expert = p[1], g.tile_row0 = p[2], g.tile_rows = p[3];
  g.a_rows = a_rows, g.y_rows = y_rows, g.scale = scale;
  g.max_tiles = cap;
  return g;
}

// Real MoE sizes: S tokens x top-8 over 256 experts, gate/up 2048 -> 2 x 512, down 512 -> 2048, at every tile.
void time_grouped(std::mt19937_64& rng, int64_t S) {
  constexpr int kSets = 3, E = 256, k = 8;
  constexpr int64_t H = 2048, I = 512;
  const Routing R = routing_skewed(rng, S, E, k);
  const int64_t P = S * k;
  const int auto_tile = lc::pick_expert_tile(P, E);
  std::printf("INFO grouped: pairs=%lld experts=%d max_rows=%d empty=%d engine tile=%d\n", (long long)P, E,
              *std::max_element(R.counts.begin(), R.counts.end()),
              static_cast<int>(std::count(R.counts.begin(), R.counts.end(), 0)), auto_tile);
  DevWeight wg[kSets], wu[kSets], wd[kSets];
  bf16 *h[kSets], *act_in[kSets];
  for (int s = 0; s < kSets; ++s) {
    wg[s].make(4, E, I, H, 200 + 10 * s), wu[s].make(4, E, I, H, 203 + 10 * s), wd[s].make(4, E, H, I, 206 + 10 * s);
    h[s] = drandom<bf16>(S * H, 300 + s), act_in[s] = drandom<bf16>(P * I, 400 + s);
  }
  int32_t *da = dupload(R.a_rows), *dy = dupload(R.y_rows);
  float* dsc = dupload(R.scale);
  bf16 *act = dalloc<bf16>(P * I), *d = dalloc<bf16>(P * H);
  double first_gu = 0, first_dn = 0;
  for (int tile : {64, 16, 32, 128})
    for (int impl = 0; impl < 2; ++impl) {  // 0: the wmma fallback (tiles <= 64), 1: the engine's dispatch
      if (impl == 0 && tile > lc::kGemmBM) continue;
      std::vector<void*> owned;
      const lc::GroupMap g = upload_map(R.counts, tile, da, dy, dsc, owned);
      lc::force_gemm_fallback(impl == 0);
      const double gu = median_ms([&](int i) { lc::grouped_gate_up(nullptr, wg[i % kSets].d, wu[i % kSets].d, g,
                                                                   h[i % kSets], H, act, tile); });
      const double dn = median_ms([&](int i) { lc::grouped_down(nullptr, wd[i % kSets].d, g, act_in[i % kSets], d,
                                                                tile); });
      lc::force_gemm_fallback(false);
      if (first_gu == 0) first_gu = gu, first_dn = dn;
      const std::string tag = std::string(impl ? "engine/" : "wmma/") + "moe_%s q4 tile=" + std::to_string(tile) +
                              (tile == auto_tile ? " (engine's)" : "");
      char nm[160];
      std::snprintf(nm, sizeof nm, tag.c_str(), "gate_up_dual");
      print_time(nm, gu, 2.0 * P * 2 * I * H, first_gu);
      std::snprintf(nm, sizeof nm, tag.c_str(), "down");
      print_time(nm, dn, 2.0 * P * H * I, first_dn);
      for (void* p : owned) cudaFree(p);
    }
  for (int s = 0; s < kSets; ++s)
    wg[s].free_all(), wu[s].free_all(), wd[s].free_all(), cudaFree(h[s]), cudaFree(act_in[s]);
  cudaFree(da), cudaFree(dy), cudaFree(dsc), cudaFree(act), cudaFree(d);
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_gemm");
  std::mt19937_64 rng(7);
  time_plain("deltanet_qkv", 4, 2048, 8192, 2048, kStore);
  time_plain("deltanet_out", 4, 2048, 2048, 4096, kAcc);
  time_plain("attn_kv", 4, 2048, 512, 2048, kStore);
  time_plain("router", 8, 2048, 256, 2048, kStore);
  time_plain("shared_gate_up", 4, 2048, 512, 2048, kDual);
  time_concat(2048);
  time_concat(4096);
  time_grouped(rng, 2048);
  time_grouped(rng, 4096);  // the 4K prefill's tile map (128-row tiles)
  return 0;
}
