// build: csrc/cuda/embed_norm.cu csrc/cuda/moe.cu csrc/cuda/deltanet.cu csrc/cuda/deltanet_seq.cu csrc/cuda/deltanet_chunk.cu csrc/cuda/attention.cu csrc/cuda/attention_prefill.cu csrc/cuda/attention_prefill_wgmma.cu csrc/cuda/attention_decode.cu csrc/cuda/gemv.cu csrc/cuda/gemm.cu csrc/cuda/gemm_mma.cu csrc/cuda/gemm_wgmma.cu csrc/cuda/gemm_one.cu
// The small CUDA kernel families (embed_norm.cu, moe.cu, deltanet.cu conv / gated norm, attention.cu
// prep; deltanet.cuh: deltanet_step with its fused gated norm) against fp64 host twins that mirror the CPU backend (csrc/cpu/*.cpp).
// Fresh random inputs each run (seed from the clock, printed; `check_small <seed>` replays one), real model shapes
// and awkward ones, every output poisoned with 0xFF bytes (NaN / -1) before the launch so unwritten elements fail,
// one line per case, then "SUMMARY small <pass>/<total>"; exit code 1 on any failure.
//
// Tolerances (rel RMS vs the fp64 twin; bf16 outputs also element-wise):
//   fp32 outputs (embed, route weights, combine, conv+l2norm, prep q, decode scan y and state): 1e-5. Each output is a
//     short fp32 chain (a fma, a few-term sum, a <= 2048-term dot, expf / sqrtf within a few ulp) on the same fp32
//     inputs, so the expected error is ~1e-7..1e-6; 1e-5 leaves headroom without hiding an indexing/formula bug.
//   bf16 outputs (rms_norm, gated norm, k cache): rel RMS <= 2^-8 and every element within 2^-8 |ref| + 1e-5 rms(ref):
//     bf16 round-to-nearest is at most 2^-8/(1 + 2^-8) relative (expected rel RMS ~1.6e-3), the fp32 value is within
//     ~1e-6 relative of fp64, and the 1e-5 rms(ref) slack covers fp32 absolute error on nearly cancelled elements
//     (RoPE rotation, silu(z) near 0) where a relative bound alone would be flaky.
//   Integer / copied outputs (route indices, sort pairs and tile map, v cache = bf16(v), conv state): exact.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/deltanet.cuh"
#include "cuda/embed_norm.cuh"
#include "cuda/gemv.cuh"
#include "cuda/moe.cuh"

#define CHECK_FAMILY "small"
#include "check_util.cuh"
#include "tolerances.h"

using namespace lily;
namespace lc = lily::cuda;


// ---------------------------------------------------------------- helpers
static double bf2d(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static void after_launch() {
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
}

static std::vector<float> randn(size_t n, float sd = 1.f, float mean = 0.f) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
static std::vector<float> randu(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
template <class T>
static std::vector<double> to_d(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}
static std::vector<double> bf_to_d(const std::vector<uint16_t>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf2d(v[i]);
  return r;
}

// Float comparison. bf16_elem: also every element within 2^-8 |ref| + 1e-5 rms(ref) (bf16 rounding of an fp32 value).
static void report(const std::string& name, const std::vector<double>& ref, const std::vector<double>& got, double tol,
                   bool bf16_elem = false) {
  double num = 0, den = 0, mx = 0;
  int64_t nonfinite = 0, bad_elem = 0;
  for (double r : ref) den += r * r;
  const double slack = tolerances::small_bf16_elem_slack * std::sqrt(den / std::max<size_t>(ref.size(), 1));
  den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++nonfinite;
      continue;
    }
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    mx = std::max(mx, std::fabs(d));
    if (bf16_elem && std::fabs(d) > std::ldexp(std::fabs(ref[i]), -8) + slack) ++bad_elem;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  const bool ok = nonfinite == 0 && bad_elem == 0 && rel <= tol && !ref.empty();
  ++n_total;
  n_pass += ok;
  std::printf("%s %-52s rel_rms=%.2e max_abs=%.2e (tol %.1e%s)", ok ? "PASS" : "FAIL", name.c_str(), rel, mx, tol,
              bf16_elem ? ", 2^-8 per element" : "");
  if (nonfinite) std::printf(" NON-FINITE=%lld", static_cast<long long>(nonfinite));
  if (bad_elem) std::printf(" elem_over_2^-8=%lld", static_cast<long long>(bad_elem));
  std::printf("\n");
}

// Exact comparison of integer (or bit-pattern) values: every got[i] must equal ref[i].
static void report_exact(const std::string& name, const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0, den = 0, mx = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::isfinite(got[i]) ? got[i] - ref[i] : INFINITY;
    if (d != 0) ++bad;
    num += d * d;
    den += ref[i] * ref[i];
    mx = std::max(mx, std::fabs(d));
  }
  const bool ok = bad == 0 && !ref.empty();
  ++n_total;
  n_pass += ok;
  std::printf("%s %-52s rel_rms=%.2e max_abs=%.2e (exact; mismatches %lld/%zu)\n", ok ? "PASS" : "FAIL", name.c_str(),
              std::sqrt(num / std::max(den, 1e-300)), mx, static_cast<long long>(bad), ref.size());
}



static double silu_d(double x) { return x / (1.0 + std::exp(-x)); }
static double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }
static double softplus_d(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// ---------------------------------------------------------------- embed_norm.cu: embed
// E: MLX affine [V, in] (group 64), codes u32 [V, in*bits/32], scales/biases bf16 [V, in/64]; w = s*q + b.
// Scales ~ 0.01-0.03, biases ~ -2^(bits-1) s (zero-mean rows, as MLX quantisation of an embedding gives).
static void check_embed(int64_t V, int64_t in, int bits, int64_t S) {
  Dev dv;
  const int64_t wpr = in * bits / 32, gpr = in / 64;
  std::vector<uint32_t> codes(static_cast<size_t>(V * wpr));
  uint64_t x = rng();
  for (size_t i = 0; i < codes.size(); i += 2) {  // splitmix64: fast for the 64 M words of the real vocab
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    codes[i] = static_cast<uint32_t>(z);
    if (i + 1 < codes.size()) codes[i + 1] = static_cast<uint32_t>(z >> 32);
  }
  std::vector<uint16_t> sc(static_cast<size_t>(V * gpr)), bi(sc.size());
  std::uniform_real_distribution<float> us(0.01f, 0.03f), ub(0.8f, 1.2f);
  const float half = static_cast<float>(1 << (bits - 1));
  for (size_t i = 0; i < sc.size(); ++i) {
    const float s = us(rng) / (bits == 8 ? 16.f : 1.f);
    sc[i] = lc::host_bf16(s);
    bi[i] = lc::host_bf16(-half * s * ub(rng));
  }
  std::vector<int32_t> ids(S);
  for (int64_t s = 0; s < S; ++s) ids[s] = static_cast<int32_t>(rng() % V);
  ids[0] = static_cast<int32_t>(V - 1);  // last row: the largest offsets
  if (S > 1) ids[1] = 0;
  if (S > 2) ids[2] = ids[S - 1];  // a repeated id
  lc::DLinear E;
  E.p = kp::LinearParams{0, bits, 64, 0, V, in, V * wpr, V * gpr, V * in};
  E.codes = dv.put(codes);
  E.scales = dv.put(sc);
  E.biases = dv.put(bi);
  const int32_t* dids = dv.put(ids);
  float* dx = dv.alloc<float>(S * in);
  lc::embed(0, E, dids, S, dx);
  after_launch();
  const auto got = get(dx, S * in);
  std::vector<double> ref(S * in);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t k = 0; k < in; ++k) {
      const int64_t r = ids[s];
      const uint32_t w = codes[r * wpr + k * bits / 32];
      const int q = static_cast<int>((w >> (bits * (k % (32 / bits)))) & ((1u << bits) - 1));
      const int64_t g = r * gpr + k / 64;
      ref[s * in + k] = bf2d(sc[g]) * q + bf2d(bi[g]);
    }
  report(fmt("embed bits=%d V=%lld in=%lld S=%lld", bits, (long long)V, (long long)in, (long long)S), ref, to_d(got),
         tolerances::small_fp32_rel_rms);
}

// ---------------------------------------------------------------- embed_norm.cu: rms_norm (fp32 -> bf16)
// off: x starts off floats past an allocation (off % 4 != 0: not 16-byte aligned, so the loop path runs).
static void check_rms_norm(int64_t rows, int64_t n, int64_t off = 0) {
  Dev dv;
  auto x = randn(rows * n, 1.f);
  for (int64_t i = 0; i < n; ++i) x[i] *= 50.f;  // a row of large residual values (outlier channels)
  if (rows > 1)
    for (int64_t i = 0; i < n; ++i) x[n + i] *= 1e-3f;  // a row of small values (eps matters a little)
  auto w = randu(n, 0.2f, 2.f);
  const float eps = 1e-6f;
  std::vector<float> xo(off, 0.f);
  xo.insert(xo.end(), x.begin(), x.end());
  const float* dx = dv.put(xo) + off;
  const float* dw = dv.put(w);
  uint16_t* dy = dv.alloc<uint16_t>(rows * n);
  lc::rms_norm(0, dx, dw, eps, rows, n, reinterpret_cast<lc::bf16*>(dy));
  after_launch();
  std::vector<double> ref(rows * n);
  for (int64_t r = 0; r < rows; ++r) {  // CPU twin: rms_norm_row
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) ref[r * n + i] = x[r * n + i] * inv * w[i];
  }
  const std::string tag = fmt("rows=%lld n=%lld%s", (long long)rows, (long long)n, off ? " x misaligned" : "");
  report("rms_norm " + tag, ref, bf_to_d(get(dy, rows * n)), tolerances::small_bf16_rel_rms, true);
  if (rows >= 4096) {
    const double us = median_us([&] { lc::rms_norm(0, dx, dw, eps, rows, n, reinterpret_cast<lc::bf16*>(dy)); });
    std::printf("TIME rms_norm %s %.1f us (%.2f TB/s)\n", tag.c_str(), us, (6.0 * rows * n + 4.0 * n) / us * 1e-6);
  }
}

// ---------------------------------------------------------------- moe.cu: moe_route
// Logits ~ N(0, 2) quantised to multiples of 1/64: distinct logits differ by >= 1/64 (1.6% in probability, far above
// fp32 rounding) and equal logits give bit-equal fp32 probabilities, so the top-k set and order are exact in both
// the kernel and the fp64 twin; ties (frequent at this quantisation; whole tied rows added) must go to the lower index.
static void check_route(int64_t S, int E, int k, int norm) {
  Dev dv;
  std::vector<float> lg(S * E);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (auto& v : lg) v = std::round(nd(rng) * 64.f) / 64.f;
  if (S > 1)
    for (int e = 0; e < E; ++e) lg[E + e] = 1.25f;  // all experts tied
  if (S > 2) {
    for (int e = 0; e < E; ++e) lg[2 * E + e] = -20.f + (e % 7) * 0.5f;  // large negative, many ties
    lg[2 * E + E - 1] = 15.f;  // one dominant expert at the last index
  }
  kp::MoeParams p{};
  p.hidden = 2048, p.n_experts = E, p.top_k = k, p.inter = 512, p.shared_inter = 512, p.norm_topk_prob = norm, p.S = S;
  const float* dl = dv.put(lg);
  int32_t* didx = dv.alloc<int32_t>(S * k);
  float* dw = dv.alloc<float>(S * k);
  lc::moe_route(0, p, dl, didx, dw);
  after_launch();
  const auto gi = get(didx, S * k);
  const auto gw = get(dw, S * k);
  std::vector<double> ri(S * k), rw(S * k);
  std::vector<double> prob(E);
  for (int64_t s = 0; s < S; ++s) {  // CPU twin: moe_route (softmax, repeated argmax with strict >, renorm)
    const float* l = &lg[s * E];
    const double mx = *std::max_element(l, l + E);
    double den = 0;
    for (int e = 0; e < E; ++e) den += (prob[e] = std::exp(double(l[e]) - mx));
    double chosen = 0;
    std::vector<bool> used(E, false);
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!used[e] && (best < 0 || prob[e] > prob[best])) best = e;
      used[best] = true;
      ri[s * k + j] = best;
      rw[s * k + j] = prob[best] / den;
      chosen += prob[best] / den;
    }
    if (norm)
      for (int j = 0; j < k; ++j) rw[s * k + j] /= chosen;
  }
  const std::string tag = fmt("S=%lld E=%d k=%d norm=%d", (long long)S, E, k, norm);
  report_exact("moe_route idx " + tag, ri, to_d(gi));
  report("moe_route w " + tag, rw, to_d(gw), tolerances::small_fp32_rel_rms);
}

// A non-finite router row (NaN residual upstream) must not route to an expert index past E (an out-of-bounds
// weight read): every slot goes to expert 0 with a NaN weight, so the NaN reaches the output. Row 0 all NaN, row 1
// one NaN, row 2 finite (checked against the twin as usual by check_route; here only that it is unaffected).
static void check_route_nonfinite(int E, int k) {
  Dev dv;
  std::vector<float> lg(3 * E);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (auto& v : lg) v = nd(rng);
  for (int e = 0; e < E; ++e) lg[e] = NAN;
  lg[E + E / 2] = NAN;
  kp::MoeParams p{};
  p.hidden = 2048, p.n_experts = E, p.top_k = k, p.inter = 512, p.shared_inter = 512, p.norm_topk_prob = 1, p.S = 3;
  const float* dl = dv.put(lg);
  int32_t* didx = dv.alloc<int32_t>(3 * k);
  float* dw = dv.alloc<float>(3 * k);
  lc::moe_route(0, p, dl, didx, dw);
  after_launch();
  const auto gi = get(didx, 3 * k);
  const auto gw = get(dw, 3 * k);
  int bad = 0;
  for (int j = 0; j < 2 * k; ++j) bad += gi[j] != 0 || !std::isnan(gw[j]);
  for (int j = 2 * k; j < 3 * k; ++j) bad += gi[j] < 0 || gi[j] >= E || !std::isfinite(gw[j]);
  ++n_total;
  n_pass += bad == 0;
  std::printf("%s moe_route non-finite rows E=%d k=%d (expert 0, NaN weight; finite row untouched): %d bad\n",
              bad ? "FAIL" : "PASS", E, k, bad);
}

// ---------------------------------------------------------------- moe.cu: moe_sort
// top_idx: k distinct experts per row (as routing gives); skew sends ~70% of picks to 4 experts (several tiles per
// expert, most experts empty). Checks: n_tiles == sum_e ceil(count_e / tile_rows); each tile 1..tile_rows rows inside
// [0, P); tiles cover every sorted position exactly once; every position's pair belongs to its tile's expert;
// pair_id a permutation of 0..P-1; pair_row == pair_id / k; pair_w bit-equal to top_w[pair_id].
static void check_sort(int64_t S, int E, int k, int tile_rows, bool skew) {
  Dev dv;
  const int64_t P = S * k, max_tiles = (P + tile_rows - 1) / tile_rows + E;
  std::vector<int32_t> idx(P);
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        e = (skew && rng() % 10 < 7) ? static_cast<int>(rng() % std::min(E, 4)) : static_cast<int>(rng() % E);
        dup = false;
        for (int i = 0; i < j; ++i) dup |= idx[s * k + i] == e;
      } while (dup);
      idx[s * k + j] = e;
    }
  const auto w = randu(P, 0.f, 1.f);
  kp::MoeParams p{};
  p.hidden = 2048, p.n_experts = E, p.top_k = k, p.inter = 512, p.shared_inter = 512, p.norm_topk_prob = 1, p.S = S;
  const int32_t* di = dv.put(idx);
  const float* dw = dv.put(w);
  lc::SortBuffers b;
  b.pair_row = dv.alloc<int32_t>(P), b.pair_id = dv.alloc<int32_t>(P), b.pair_w = dv.alloc<float>(P);
  b.n_tiles = dv.alloc<int32_t>(1), b.tile_expert = dv.alloc<int32_t>(max_tiles);
  b.tile_row0 = dv.alloc<int32_t>(max_tiles), b.tile_rows = dv.alloc<int32_t>(max_tiles);
  b.block_base = dv.alloc<int32_t>(lc::moe_sort_scratch(P, E));
  lc::moe_sort(0, p, di, dw, tile_rows, b);
  after_launch();
  const auto g_row = get(b.pair_row, P), g_id = get(b.pair_id, P), g_nt = get(b.n_tiles, 1),
             g_te = get(b.tile_expert, max_tiles), g_r0 = get(b.tile_row0, max_tiles),
             g_rs = get(b.tile_rows, max_tiles);
  const auto g_w = get(b.pair_w, P);
  std::vector<int64_t> cnt(E, 0);
  for (auto e : idx) ++cnt[e];
  int64_t want_tiles = 0;
  for (int e = 0; e < E; ++e) want_tiles += (cnt[e] + tile_rows - 1) / tile_rows;
  std::vector<double> ref, got;
  auto cmp = [&](double r, double g) { ref.push_back(r), got.push_back(g); };
  cmp(double(want_tiles), g_nt[0]);
  const int64_t ntl = std::clamp<int64_t>(g_nt[0], 0, max_tiles);
  std::vector<int> cover(P, 0), tile_of(P, -1);
  for (int64_t t = 0; t < ntl; ++t) {
    const bool okt = g_rs[t] >= 1 && g_rs[t] <= tile_rows && g_r0[t] >= 0 && g_r0[t] + g_rs[t] <= P &&
                     g_te[t] >= 0 && g_te[t] < E;
    cmp(1, okt);
    if (!okt) continue;
    for (int64_t r = g_r0[t]; r < g_r0[t] + g_rs[t]; ++r) ++cover[r], tile_of[r] = static_cast<int>(t);
  }
  std::vector<int> seen(P, 0);
  for (int64_t i = 0; i < P; ++i) {
    cmp(1, cover[i]);
    const int32_t id = g_id[i];
    const bool idok = id >= 0 && id < P;
    if (idok) ++seen[id];
    cmp(tile_of[i] >= 0 ? g_te[tile_of[i]] : -2, idok ? idx[id] : -1);  // pair's expert == tile's expert
    cmp(idok ? id / k : -1, g_row[i]);
    cmp(idok ? fbits(w[id]) : 0.0, fbits(g_w[i]));
  }
  for (int64_t i = 0; i < P; ++i) cmp(1, seen[i]);
  report_exact(fmt("moe_sort S=%lld E=%d k=%d tile_rows=%d%s (tiles %lld)", (long long)S, E, k, tile_rows,
                   skew ? " skew" : "", (long long)want_tiles),
               ref, got);
  if (S >= 4096)
    std::printf("TIME moe_sort S=%lld E=%d k=%d%s %.1f us\n", (long long)S, E, k, skew ? " skew" : "",
                median_us([&] { lc::moe_sort(0, p, di, dw, tile_rows, b); }));
}

// ---------------------------------------------------------------- moe.cu: moe_combine
// x is read-modify-write, so it starts from random values rather than poison; every element's added term is
// nonzero, so an unwritten element fails.
static void check_combine(int64_t S, int64_t H, int k) {
  Dev dv;
  const auto sh = randn(S * H), gate = randu(S, -8.f, 8.f), d32 = randn(S * k * H, 0.3f), x0 = randn(S * H);
  std::vector<uint16_t> d(d32.size());  // d is bf16 (grouped_down's output): the twin sums the same bf16 values
  for (size_t i = 0; i < d.size(); ++i) d[i] = lc::host_bf16(d32[i]);
  kp::MoeParams p{};
  p.hidden = static_cast<int32_t>(H), p.n_experts = 256, p.top_k = k, p.inter = 512, p.shared_inter = 512;
  p.norm_topk_prob = 1, p.S = S;
  const float *dsh = dv.put(sh), *dg = dv.put(gate);
  const lc::bf16* dd = reinterpret_cast<const lc::bf16*>(dv.put(d));
  float* dx = dv.put(x0);
  lc::moe_combine(0, p, dsh, dg, dd, dx);
  after_launch();
  std::vector<double> ref(S * H);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t c = 0; c < H; ++c) {
      double acc = sigmoid_d(gate[s]) * sh[s * H + c];
      for (int j = 0; j < k; ++j) acc += bf2d(d[(s * k + j) * H + c]);
      ref[s * H + c] = x0[s * H + c] + acc;
    }
  report(fmt("moe_combine S=%lld H=%lld k=%d", (long long)S, (long long)H, k), ref, to_d(get(dx, S * H)),
         tolerances::small_fp32_rel_rms);
  if (S >= 4096) {
    const double us = median_us([&] { lc::moe_combine(0, p, dsh, dg, dd, dx); });
    std::printf("TIME moe_combine S=%lld H=%lld k=%d %.1f us (%.2f TB/s)\n", (long long)S, (long long)H, k, us,
                (4.0 * S * H * 3 + 2.0 * S * H * k) / us * 1e-6);
  }
}

// ---------------------------------------------------------------- deltanet.cu
static kp::DeltaNetParams deltanet_params(int Hk, int Hv, int Dk, int Dv, int K, int64_t S) {
  kp::DeltaNetParams p{};
  p.k_heads = Hk, p.v_heads = Hv, p.k_dim = Dk, p.v_dim = Dv, p.conv_kernel = K;
  p.conv_dim = 2 * Hk * Dk + Hv * Dv;
  p.norm_eps = 1e-6f, p.qk_eps = 1e-6f, p.S = S;
  return p;
}

// Conv + SiLU + l2 norm of q (times Dk^-0.5) and k per head; u poisoned, conv state (in place) checked bit-exact
// (it is a copy of input rows). Twin: the CPU deltanet steps 1-2 in fp64. shift 1 / 2 / 3: qkv / conv_state / u
// starts one float past an allocation (not 16-byte aligned: the channel-per-thread path runs).
static void check_dn_conv(int Hk, int Hv, int Dk, int Dv, int K, int64_t S, int shift = 0) {
  Dev dv;
  const kp::DeltaNetParams p = deltanet_params(Hk, Hv, Dk, Dv, K, S);
  const int64_t C = p.conv_dim;
  const auto qkv = randn(S * C), w = randu(C * K, -0.6f, 0.6f), cs0 = randn((K - 1) * C);
  auto shifted = [](const std::vector<float>& v, bool on) {
    std::vector<float> r(on ? 1 : 0, 0.f);
    r.insert(r.end(), v.begin(), v.end());
    return r;
  };
  const float* dq = dv.put(shifted(qkv, shift == 1)) + (shift == 1);
  const float* dw = dv.put(w);
  float* dcs = dv.put(shifted(cs0, shift == 2)) + (shift == 2);
  float* du = dv.alloc<float>(S * C + 1) + (shift == 3);
  lc::deltanet_conv(0, p, dq, dw, dcs, du);
  after_launch();
  auto X = [&](int64_t i, int64_t c) -> double { return i < K - 1 ? cs0[i * C + c] : qkv[(i - (K - 1)) * C + c]; };
  std::vector<double> ref(S * C), ref_cs((K - 1) * C);
  for (int64_t t = 0; t < S; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int j = 0; j < K; ++j) acc += double(w[c * K + j]) * X(t + j, c);
      ref[t * C + c] = silu_d(acc);
    }
  for (int64_t t = 0; t < S; ++t)
    for (int hh = 0; hh < 2 * Hk; ++hh) {
      double* x = &ref[t * C + int64_t(hh) * Dk];
      double ss = 0;
      for (int i = 0; i < Dk; ++i) ss += x[i] * x[i];
      const double inv = 1.0 / std::sqrt(ss + p.qk_eps) * (hh < Hk ? 1.0 / std::sqrt(double(Dk)) : 1.0);
      for (int i = 0; i < Dk; ++i) x[i] *= inv;
    }
  for (int r = 0; r < K - 1; ++r)
    for (int64_t c = 0; c < C; ++c) ref_cs[r * C + c] = fbits(static_cast<float>(X(S + r, c)));
  const auto gcs = get(dcs, (K - 1) * C);
  std::vector<double> got_cs(gcs.size());
  for (size_t i = 0; i < gcs.size(); ++i) got_cs[i] = fbits(gcs[i]);
  static const char* const kShift[] = {"", " qkv+1", " state+1", " u+1"};
  const std::string tag =
      fmt("Hk=%d Hv=%d Dk=%d Dv=%d K=%d S=%lld%s", Hk, Hv, Dk, Dv, K, (long long)S, kShift[shift]);
  report("deltanet_conv u " + tag, ref, to_d(get(du, S * C)), tolerances::small_fp32_rel_rms);
  report_exact("deltanet_conv state " + tag, ref_cs, got_cs);
  if (S >= 4096) {  // the state is rewritten by each timed launch: only the speed is read from here on
    const double us = median_us([&] { lc::deltanet_conv(0, p, dq, dw, dcs, du); });
    std::printf("TIME deltanet_conv %s %.1f us (%.2f TB/s)\n", tag.c_str(), us,
                4.0 * (2 * S * C + 2 * (K - 1) * C + C * K) / us * 1e-6);
  }
}

// out = bf16(RMSNorm(y; w) * silu(z)) per (row, value head).
static void check_dn_gated_norm(int Hv, int Dv, int64_t S) {
  Dev dv;
  const kp::DeltaNetParams p = deltanet_params(1, Hv, 128, Dv, 4, S);
  const int64_t n = S * Hv * Dv;
  const auto y = randn(n, 0.5f), z = randn(n, 1.5f), w = randu(Dv, 0.3f, 1.5f);
  const float *dy = dv.put(y), *dz = dv.put(z), *dw = dv.put(w);
  uint16_t* dout = dv.alloc<uint16_t>(n);
  lc::deltanet_gated_norm(0, p, dy, dz, dw, reinterpret_cast<lc::bf16*>(dout));
  after_launch();
  std::vector<double> ref(n);
  for (int64_t r = 0; r < S * Hv; ++r) {
    double ss = 0;
    for (int i = 0; i < Dv; ++i) ss += double(y[r * Dv + i]) * y[r * Dv + i];
    const double inv = 1.0 / std::sqrt(ss / Dv + p.norm_eps);
    for (int i = 0; i < Dv; ++i) ref[r * Dv + i] = y[r * Dv + i] * inv * w[i] * silu_d(z[r * Dv + i]);
  }
  report(fmt("deltanet_gated_norm Hv=%d Dv=%d S=%lld", Hv, Dv, (long long)S), ref, bf_to_d(get(dout, n)),
         tolerances::small_bf16_rel_rms, true);
}

// ---------------------------------------------------------------- deltanet.cu: deltanet_step (decode)
// One token: l2 norm of q (times Dk^-0.5), k fused in, then the gated delta rule (docs/model.md §4.3):
// S *= g; delta = beta (v - S k); S += delta k^T; o = S q; then, fused, out = bf16(RMSNorm(o_h; w) * silu(z_h)) per
// head. u = silu(N(0, 1.5)) (post-conv, q/k not normalised), b in [-4, 4], a in [-3, 0.5], dt_bias in [-1, 0.5],
// A_log in [-1.5, 0]; state ~ U(-0.5, 0.5) or zero. Launched twice from the same inputs with the same head counters
// (a graph replays the step): both launches must give the reference, and the counters must be left at zero.
static void check_deltanet_decode_scan(int Hk, int Hv, int Dk, int Dv, bool zero_state) {
  Dev dv;
  const kp::DeltaNetParams p = deltanet_params(Hk, Hv, Dk, Dv, 4, 1);
  const int64_t C = p.conv_dim, key_dim = int64_t(Hk) * Dk, ns = int64_t(Hv) * Dv * Dk, n = int64_t(Hv) * Dv;
  auto u = randn(C, 1.5f);
  for (auto& x : u) x = static_cast<float>(silu_d(x));
  const auto b = randu(Hv, -4.f, 4.f), a = randu(Hv, -3.f, 0.5f), dtb = randu(Hv, -1.f, 0.5f),
             alog = randu(Hv, -1.5f, 0.f);
  const auto z = randn(n, 1.5f), w = randu(Dv, 0.3f, 1.5f);
  const auto ssm0 = zero_state ? std::vector<float>(ns, 0.f) : randu(ns, -0.5f, 0.5f);
  const float *du = dv.put(u), *db = dv.put(b), *da = dv.put(a), *ddt = dv.put(dtb), *dal = dv.put(alog);
  const float *dz = dv.put(z), *dw = dv.put(w);
  float* dssm = dv.put(ssm0);
  int32_t* done = dv.put(std::vector<int32_t>(Hv, 0));
  std::vector<double> ry(n), rs(ns), rout(n), q(Dk), k(Dk), st(Dk);
  for (int h = 0; h < Hv; ++h) {
    const int kh = h / (Hv / Hk);
    double sq = 0, sk = 0;
    for (int i = 0; i < Dk; ++i) {
      q[i] = u[int64_t(kh) * Dk + i], k[i] = u[key_dim + int64_t(kh) * Dk + i];
      sq += q[i] * q[i], sk += k[i] * k[i];
    }
    const double iq = 1.0 / std::sqrt(sq + p.qk_eps) / std::sqrt(double(Dk)), ik = 1.0 / std::sqrt(sk + p.qk_eps);
    for (int i = 0; i < Dk; ++i) q[i] *= iq, k[i] *= ik;
    const double g = std::exp(-std::exp(double(alog[h])) * softplus_d(double(a[h]) + dtb[h]));
    const double beta = sigmoid_d(b[h]);
    for (int d = 0; d < Dv; ++d) {
      const int64_t row = (int64_t(h) * Dv + d) * Dk;
      double kst = 0;
      for (int i = 0; i < Dk; ++i) st[i] = ssm0[row + i] * g, kst += st[i] * k[i];
      const double delta = beta * (u[2 * key_dim + int64_t(h) * Dv + d] - kst);
      double o = 0;
      for (int i = 0; i < Dk; ++i) st[i] += delta * k[i], o += st[i] * q[i], rs[row + i] = st[i];
      ry[int64_t(h) * Dv + d] = o;
    }
    double ss = 0;
    for (int d = 0; d < Dv; ++d) ss += ry[int64_t(h) * Dv + d] * ry[int64_t(h) * Dv + d];
    const double inv = 1.0 / std::sqrt(ss / Dv + p.norm_eps);
    for (int d = 0; d < Dv; ++d) {
      const int64_t i = int64_t(h) * Dv + d;
      rout[i] = ry[i] * inv * w[d] * silu_d(z[i]);
    }
  }
  const std::string tag = fmt("Hk=%d Hv=%d Dk=%d Dv=%d%s", Hk, Hv, Dk, Dv, zero_state ? " zero-state" : "");
  for (int launch = 0; launch < 2; ++launch) {
    float* dy = dv.alloc<float>(n);
    uint16_t* dout = dv.alloc<uint16_t>(n);
    if (launch) CK(cudaMemcpy(dssm, ssm0.data(), ns * sizeof(float), cudaMemcpyHostToDevice));
    lc::deltanet_step(0, p, du, db, da, ddt, dal, dssm, dy, dz, dw, reinterpret_cast<lc::bf16*>(dout), done);
    after_launch();
    const std::string lt = launch ? " (again)" : "";
    report("deltanet_decode_scan y " + tag + lt, ry, to_d(get(dy, n)), tolerances::small_fp32_rel_rms);
    report("deltanet_decode_scan state " + tag + lt, rs, to_d(get(dssm, ns)), tolerances::small_fp32_rel_rms);
    report("deltanet_decode_scan gated out " + tag + lt, rout, bf_to_d(get(dout, n)), tolerances::small_bf16_rel_rms,
           true);
  }
  report_exact("deltanet_decode_scan head counters " + tag, std::vector<double>(Hv, 0.0), to_d(get(done, Hv)));
}

// ---------------------------------------------------------------- attention.cu: attention_prep
// q/k RMSNorm (weights U(0.5, 1.5)) + partial RoPE (half-split pairs, angles in fp64 as the CPU twin), q -> fp32,
// k -> bf16 cache, v -> bf16 cache (bit-exact round to nearest) at rows pos0..pos0+S-1. All cache rows are poisoned;
// rows outside pos0..pos0+S-1 must still hold the poison after the launch. use_dpos: pos0 read from the device
// (p.pos0 set to 0 on the host).
static void check_prep(int Hq, int Hkv, int D, int rd, int64_t S, int64_t pos0, bool use_dpos) {
  Dev dv;
  kp::AttentionParams p{};
  p.n_heads = Hq, p.n_kv_heads = Hkv, p.head_dim = D, p.rotary_dim = rd, p.rope_theta = 1e7f, p.eps = 1e-6f;
  p.scale = 1.f / std::sqrt(float(D)), p.pos0 = use_dpos ? 0 : pos0, p.S = S;
  const int64_t kvr = int64_t(Hkv) * D, cap = pos0 + S + 3;
  const auto qg = randn(S * Hq * 2 * D, 2.f), k = randn(S * kvr, 2.f), v = randn(S * kvr, 1.f);
  const auto qn = randu(D, 0.5f, 1.5f), kn = randu(D, 0.5f, 1.5f);
  const float *dqg = dv.put(qg), *dk = dv.put(k), *dvv = dv.put(v), *dqn = dv.put(qn), *dkn = dv.put(kn);
  float* dq = dv.alloc<float>(S * Hq * D);
  uint16_t *dkc = dv.alloc<uint16_t>(cap * kvr), *dvc = dv.alloc<uint16_t>(cap * kvr);
  const int32_t* dpos = use_dpos ? dv.put(std::vector<int32_t>{static_cast<int32_t>(pos0)}) : nullptr;
  lc::attention_prep(0, p, dqg, dk, dvv, dqn, dkn, dq, reinterpret_cast<lc::bf16*>(dkc),
                     reinterpret_cast<lc::bf16*>(dvc), dpos);
  after_launch();
  const int half = rd / 2;
  std::vector<double> rq(S * Hq * D), rk(S * kvr), row(D);
  auto norm_rope = [&](const float* src, const std::vector<float>& w, int64_t t, double* dst) {
    double ss = 0;
    for (int i = 0; i < D; ++i) ss += double(src[i]) * src[i];
    const double inv = 1.0 / std::sqrt(ss / D + p.eps);
    for (int i = 0; i < D; ++i) row[i] = src[i] * inv * w[i];
    for (int i = 0; i < half; ++i) {
      const double ang = double(pos0 + t) * std::pow(double(p.rope_theta), -2.0 * i / rd);
      const double c = std::cos(ang), s = std::sin(ang), x0 = row[i], x1 = row[i + half];
      row[i] = x0 * c - x1 * s;
      row[i + half] = x1 * c + x0 * s;
    }
    for (int i = 0; i < D; ++i) dst[i] = row[i];
  };
  for (int64_t t = 0; t < S; ++t) {
    for (int h = 0; h < Hq; ++h) norm_rope(&qg[(t * Hq + h) * 2 * D], qn, t, &rq[(t * Hq + h) * D]);
    for (int h = 0; h < Hkv; ++h) norm_rope(&k[t * kvr + int64_t(h) * D], kn, t, &rk[t * kvr + int64_t(h) * D]);
  }
  const auto gk = get(dkc, cap * kvr), gv = get(dvc, cap * kvr);
  std::vector<double> got_k(S * kvr), ref_v(S * kvr), got_v(S * kvr);
  int64_t pad_bad = 0;  // rows outside pos0..pos0+S-1 (counted, not stored: the cache can hold 10^8 entries)
  for (int64_t r = 0; r < cap; ++r)
    for (int64_t c = 0; c < kvr; ++c) {
      const int64_t i = r * kvr + c, j = (r - pos0) * kvr + c;
      if (r >= pos0 && r < pos0 + S) {
        got_k[j] = bf2d(gk[i]);
        ref_v[j] = lc::host_bf16(v[j]), got_v[j] = gv[i];
      } else {
        pad_bad += (gk[i] != 0xFFFF) + (gv[i] != 0xFFFF);
      }
    }
  const std::string tag = fmt("Hq=%d Hkv=%d D=%d rd=%d S=%lld pos0=%lld%s", Hq, Hkv, D, rd, (long long)S,
                              (long long)pos0, use_dpos ? " dpos" : "");
  report("attention_prep q " + tag, rq, to_d(get(dq, S * Hq * D)), tolerances::small_fp32_rel_rms);
  report("attention_prep k_cache " + tag, rk, got_k, tolerances::small_bf16_rel_rms, true);
  report_exact("attention_prep v_cache " + tag, ref_v, got_v);
  const bool pad_ok = pad_bad == 0;  // exact: no cache entry outside the new rows changed
  ++n_total;
  n_pass += pad_ok;
  std::printf("%s %-52s rel_rms=%.2e max_abs=%.2e (exact; changed entries %lld/%lld)\n", pad_ok ? "PASS" : "FAIL",
              ("attention_prep untouched rows " + tag).c_str(), pad_ok ? 0.0 : 1.0, double(pad_bad),
              static_cast<long long>(pad_bad), static_cast<long long>(2 * (cap - S) * kvr));
}

// ---------------------------------------------------------------- main
int main(int argc, char** argv) {
  const uint64_t seed =
      argc > 1 ? std::strtoull(argv[1], nullptr, 0)
               : static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  rng.seed(seed);
  int dev = 0;
  cudaDeviceProp prop;
  try {
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
  } catch (const std::exception& e) {
    std::printf("FAIL no device: %s\nSUMMARY small 0/1\n", e.what());
    return 1;
  }
  std::printf("check_small: device %s, %d SMs, seed %llu\n", prop.name, prop.multiProcessorCount,
              static_cast<unsigned long long>(seed));
  const auto t0 = std::chrono::steady_clock::now();
  auto C = [](const std::string& n, const std::function<void()>& f) { run_case(n, f); };

  // embed: the real table (vocab 248320, hidden 2048), then awkward widths (one group; > one 1024-wide pass).
  C("embed real", [] { check_embed(248320, 2048, 4, 37); });
  C("embed S=1", [] { check_embed(248320, 2048, 4, 1); });
  C("embed in=64", [] { check_embed(1000, 64, 4, 5); });
  C("embed in=2112", [] { check_embed(517, 2112, 4, 37); });
  C("embed bits=8", [] { check_embed(300, 192, 8, 7); });

  // rms_norm: hidden 2048; n below one block, odd, large. Register path (n % 4 == 0, n <= 2048, aligned): n = 2048
  // (every thread's two float4s; 4096 rows timed), 100 (25 float4s: a partial warp, second float4 unused), 1028 (257
  // float4s: thread 0 alone holds a second one). Loop path: n = 2049 (odd), 2052 and 5000 (past 2048), x+1 (x not
  // 16-byte aligned).
  for (int64_t rows : {1, 37, 300, 4096}) C("rms_norm", [=] { check_rms_norm(rows, 2048); });
  C("rms_norm n=100", [] { check_rms_norm(5, 100); });
  C("rms_norm n=1028", [] { check_rms_norm(7, 1028); });
  C("rms_norm n=2049", [] { check_rms_norm(37, 2049); });
  C("rms_norm n=2052", [] { check_rms_norm(3, 2052); });
  C("rms_norm n=5000", [] { check_rms_norm(3, 5000); });
  C("rms_norm x+1", [] { check_rms_norm(37, 2048, 1); });

  // moe_route: E=256 top-8 (renorm, as the model), E=5 top-3 both ways, E=33 (partial lane group), 300 rows.
  C("route", [] { check_route(37, 256, 8, 1); });
  C("route", [] { check_route(1, 256, 8, 1); });
  C("route", [] { check_route(300, 256, 8, 0); });
  C("route", [] { check_route(37, 5, 3, 1); });
  C("route", [] { check_route(37, 5, 3, 0); });
  C("route", [] { check_route(7, 33, 4, 1); });
  C("route", [] { check_route(3, 8, 8, 1); });  // k == E
  C("route", [] { check_route_nonfinite(256, 8); });
  C("route", [] { check_route_nonfinite(5, 3); });

  // moe_sort: real routing sizes (P up to 16384 > 1024 threads), tile_rows 16/64, skewed loads, E=5 top-3.
  C("sort", [] { check_sort(37, 256, 8, 64, false); });
  C("sort", [] { check_sort(37, 256, 8, 16, true); });
  C("sort", [] { check_sort(1, 256, 8, 64, false); });
  C("sort", [] { check_sort(2048, 256, 8, 64, false); });
  C("sort", [] { check_sort(2048, 256, 8, 16, true); });
  C("sort", [] { check_sort(37, 5, 3, 16, false); });
  C("sort", [] { check_sort(300, 5, 3, 64, true); });
  C("sort", [] { check_sort(1, 5, 3, 16, false); });
  // several sort blocks (2,048 pairs each): the 4K and 16K prefill chunks, a partial last block, E > 256 threads
  C("sort", [] { check_sort(4096, 256, 8, 128, false); });
  C("sort", [] { check_sort(16384, 256, 8, 64, true); });
  C("sort", [] { check_sort(2049, 256, 8, 128, true); });
  C("sort", [] { check_sort(300, 1000, 8, 16, false); });

  // moe_combine: hidden 2048 top-8; > 4096 blocks of work (grid-stride loop); awkward H / k.
  C("combine", [] { check_combine(1, 2048, 8); });
  C("combine", [] { check_combine(37, 2048, 8); });
  C("combine", [] { check_combine(600, 2048, 8); });
  C("combine", [] { check_combine(5, 96, 3); });
  C("combine", [] { check_combine(7, 33, 1); });
  C("combine", [] { check_combine(4096, 2048, 8); });

  // deltanet_conv: real (Hk 16, Hv 32, Dk = Dv = 128, C 8192, K 4) at S = 1 (< K-1: state rows shift), 2, 37, 100,
  // 4096 (timed); awkward heads / dims, K = 2, 3, 5 (the generic kernel size). 16 rows per thread, loaded 4 at a
  // time: every S but 4096 ends in a partial row block, S = 1, 2, 7, 17, 18, 19, 33, 37, 65 in a partial batch.
  // Fused path (float4 channels + l2 norm; C % 4 == 0, 128 % Dk == 0, Dk % 4 == 0, aligned):
  //   real shape, all S: K = 4, heads of 32 lanes, q/k warps and v warps apart;
  //   Hk 3 Dk 64 (C 960): 16-lane heads, partial last warp (240 threads);  Hk 4 Dk 64 K 2 (C 1024): 16-lane heads;
  //   Hk 2 Dk 32 K 3 (C 272): 8-lane heads, partial last warp (68 threads);
  //   Hk 1 Dk 32 K 5 (C 112): the generic K, 8-lane heads, a warp of q, k and v lanes, 28 threads;
  //   Hk 2 Dk 16 (C 124): 4-lane heads, q/k and v lanes in one warp, 31 threads;  Hk 3 Dk 4 (C 36): 1-lane heads.
  // Channel-per-thread path + l2norm_kernel: Dk 96 (C 512, K 4), Dk 40 with C 194 (K 2), C 179 with Dk 32 (K 4),
  //   Dk 96 (C 404, K 3), Dk 40 (C 128, K 5: the generic K), the real shape with qkv / state / u misaligned.
  for (int64_t S : {1, 2, 37, 100, 4096}) C("deltanet_conv", [=] { check_dn_conv(16, 32, 128, 128, 4, S); });
  C("deltanet_conv", [] { check_dn_conv(3, 6, 64, 96, 4, 37); });
  C("deltanet_conv", [] { check_dn_conv(4, 8, 64, 64, 2, 17); });
  C("deltanet_conv", [] { check_dn_conv(2, 3, 32, 48, 3, 65); });
  C("deltanet_conv", [] { check_dn_conv(1, 2, 32, 24, 5, 40); });
  C("deltanet_conv", [] { check_dn_conv(2, 3, 16, 20, 4, 33); });
  C("deltanet_conv", [] { check_dn_conv(3, 2, 4, 6, 4, 7); });
  C("deltanet_conv", [] { check_dn_conv(1, 5, 96, 64, 4, 1); });
  C("deltanet_conv", [] { check_dn_conv(2, 2, 40, 17, 2, 37); });
  C("deltanet_conv", [] { check_dn_conv(2, 3, 32, 17, 4, 20); });
  C("deltanet_conv", [] { check_dn_conv(2, 2, 96, 10, 3, 18); });
  C("deltanet_conv", [] { check_dn_conv(1, 2, 40, 24, 5, 19); });
  for (int shift : {1, 2, 3}) C("deltanet_conv", [=] { check_dn_conv(16, 32, 128, 128, 4, 37, shift); });

  // deltanet_gated_norm
  for (int64_t S : {1, 37}) C("deltanet_gated_norm", [=] { check_dn_gated_norm(32, 128, S); });
  C("deltanet_gated_norm", [] { check_dn_gated_norm(6, 96, 37); });
  C("deltanet_gated_norm", [] { check_dn_gated_norm(3, 64, 5); });
  C("deltanet_gated_norm", [] { check_dn_gated_norm(1, 40, 3); });
  C("deltanet_gated_norm", [] { check_dn_gated_norm(5, 200, 2); });

  // deltanet_scan (decode): real heads, zero and nonzero state; Dk != Dv; Dk not a multiple of 32; odd head counts;
  // Dv not a multiple of the 4 rows per block (17, 97, 1: a head's last block holds idle warps), Dv 200 and 256.
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(16, 32, 128, 128, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(16, 32, 128, 128, true); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(3, 6, 64, 96, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(1, 5, 96, 64, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(2, 4, 100, 40, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(2, 2, 32, 17, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(1, 3, 128, 97, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(2, 2, 64, 200, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(1, 1, 128, 256, false); });
  C("deltanet_decode_scan", [] { check_deltanet_decode_scan(1, 2, 16, 1, false); });

  // attention_prep: real (Hq 16, Hkv 2, D 256, rotary 64, theta 1e7) prefill / decode / long position / device
  // position; awkward head counts, D, rotary dims (full rotary, rotary not a multiple of 64).
  C("prep", [] { check_prep(16, 2, 256, 64, 1, 0, false); });
  C("prep", [] { check_prep(16, 2, 256, 64, 37, 1000, false); });
  C("prep", [] { check_prep(16, 2, 256, 64, 300, 0, false); });
  C("prep", [] { check_prep(16, 2, 256, 64, 1, 200000, false); });
  C("prep", [] { check_prep(16, 2, 256, 64, 1, 4095, true); });
  C("prep", [] { check_prep(5, 1, 64, 32, 37, 7, false); });
  C("prep", [] { check_prep(3, 3, 96, 96, 2, 11, false); });
  C("prep", [] { check_prep(6, 2, 80, 20, 5, 33, false); });
  C("prep", [] { check_prep(2, 1, 256, 256, 3, 5, false); });   // rotary over the whole head: 4 pairs a lane

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("elapsed %.1f s\n", secs);
  std::printf("SUMMARY small %d/%d\n", n_pass, n_total);
  return n_pass == n_total ? 0 : 1;
}
