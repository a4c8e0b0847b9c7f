// build: csrc/cuda/gemm.cu csrc/cuda/gemm_mma.cu csrc/cuda/gemm_wgmma.cu csrc/cuda/gemm_one.cu
// Prefill GEMM family (gemm.cuh): the mma.sync GEMM (impl 1) and the wmma fallback (impl 0,
// forced by cuda::force_gemm_fallback; gemm.cu takes it for weights the mma GEMM does not serve)
// against an fp64 host reference on real and awkward shapes, plain and grouped (MoE), then both timed at the
// model's real sizes. Usage: check_gemm [seed]   (a fresh seed each run unless given).
//
// Tolerance: the reference uses the operands the kernels use (A bf16, weights bf16(s*q + b) rounded once), so
// fp32 outputs differ only by fp32 accumulation order (rel RMS ~1e-6): bound 2e-3, the low end of the bf16
// band. Dual outputs are bf16(silu(r0) * r1): one more bf16 rounding (rel RMS ~2^-9/sqrt(3) = 1.1e-3): 5e-3.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gemm.cuh"
#include "tolerances.h"

#include "check_gemm_util.cuh"

namespace {

constexpr double kTolF32 = tolerances::gemm_rel_rms, kTolBf16 = tolerances::gemm_bf16_rel_rms;

// ---- plain GEMM cases ------------------------------------------------------------------------------------
enum Mode { kStore = 0, kAcc = 1, kDual = 2 };
const char* kModeName[] = {"store", "acc", "dual"};

struct PlainCase {
  std::string name;
  int bits;
  int64_t M, N, K;
  Mode mode;
  int64_t lda_pad = 0, ldy_pad = 0;
  int sb_off = 0;
  int64_t sample = 64;
};

void run_plain(Rng& r, const PlainCase& c) {
  const int64_t lda = c.K + c.lda_pad, ldy = c.N + c.ldy_pad;
  const bool dual = c.mode == kDual;
  QWeight W0 = make_qweight(r, c.bits, 1, c.N, c.K, c.sb_off), W1;
  if (dual) W1 = make_qweight(r, c.bits, 1, c.N, c.K, c.sb_off);
  const std::vector<uint16_t> A = random_bf16(r, c.M * lda, -1, 1);
  std::vector<float> y0(c.M * ldy);
  for (auto& v : y0) v = static_cast<float>(r.uni(-1, 1));
  const std::vector<int64_t> rows = sample_rows(r, c.M, c.sample);
  std::vector<const uint16_t*> rp;
  for (int64_t m : rows) rp.push_back(A.data() + m * lda);
  const std::vector<int> ex(rows.size(), 0);
  const std::vector<double> r0 = reference(W0, rp, ex);
  const std::vector<double> r1 = dual ? reference(W1, rp, ex) : std::vector<double>{};

  bf16* dA = reinterpret_cast<bf16*>(dupload(A));
  float* dy = dalloc<float>(c.M * ldy);
  bf16* dyb = dalloc<bf16>(c.M * ldy);
  for (int impl = 1; impl >= 0; --impl) {
    if (impl == 0 && c.M == 1) continue;  // S == 1 takes the GEMV in linear(); the wmma GEMM is unreachable
    if (c.mode == kAcc) CK(cudaMemcpy(dy, y0.data(), y0.size() * 4, cudaMemcpyHostToDevice));
    else CK(cudaMemset(c.mode == kDual ? static_cast<void*>(dyb) : dy, 0xFF, c.M * ldy * (dual ? 2 : 4)));
    const cuda::DLinear w0 = W0.dl(), w1 = dual ? W1.dl() : W0.dl();
    if (impl == 1 && c.M == 1) {  // the GEMM itself at one row
      kp::GemmParams gp{c.M, lda, ldy, 0, c.mode == kAcc};
      cuda::GemmMmaArgs a{w0, w1, gp, cuda::GroupMap{}, dA, dual ? nullptr : dy, dual ? dyb : nullptr};
      cuda::gemm_mma(nullptr, a, dual, cuda::gemm_mma_plain_rows(c.M, c.N, dual));
    } else if (dual) {
      cuda::force_gemm_fallback(impl == 0);
      cuda::linear_silu_mul(nullptr, w0, w1, dA, lda, c.M, dyb, ldy);
    } else {
      cuda::force_gemm_fallback(impl == 0);
      cuda::linear(nullptr, w0, dA, lda, c.M, dy, ldy, c.mode == kAcc);
    }
    sync_check();
    Stats s;
    if (dual) {
      const std::vector<uint16_t> out = ddownload(reinterpret_cast<uint16_t*>(dyb), c.M * ldy);
      for (int64_t m = 0; m < c.M; ++m)
        for (int64_t n = 0; n < c.N; ++n)
          if (!std::isfinite(bf2f(out[m * ldy + n]))) ++s.bad;
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t n = 0; n < c.N; ++n) {
          const double ref = silu(r0[i * c.N + n]) * r1[i * c.N + n];
          const float o = bf2f(out[rows[i] * ldy + n]);
          if (std::isfinite(o)) s.add(o, ref);
        }
    } else {
      const std::vector<float> out = ddownload(dy, c.M * ldy);
      for (int64_t m = 0; m < c.M; ++m)
        for (int64_t n = 0; n < c.N; ++n)
          if (!std::isfinite(out[m * ldy + n])) ++s.bad;
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t n = 0; n < c.N; ++n) {
          const double base = c.mode == kAcc ? y0[rows[i] * ldy + n] : 0.0;
          const float o = out[rows[i] * ldy + n];
          if (std::isfinite(o)) s.add(o - base, r0[i * c.N + n]);
        }
    }
    char nm[256];
    std::snprintf(nm, sizeof nm, "%s/%s q%d %s M=%lld N=%lld K=%lld", impl ? "mma" : "wmma", c.name.c_str(), c.bits,
                  kModeName[c.mode], (long long)c.M, (long long)c.N, (long long)c.K);
    report(nm, s, dual ? kTolBf16 : kTolF32);
  }
  cudaFree(dA), cudaFree(dy), cudaFree(dyb);
  W0.free_device();
  if (dual) W1.free_device();
}

// ---- concatenated projections (linear_concat) ----------------------------------------------------------
// Row view [row0, row0 + n) of a single (one-expert) quantized weight, group 64.
cuda::DLinear row_view(cuda::DLinear d, int64_t row0, int64_t n) {
  const int64_t wpr = d.p.in * d.p.bits / 32, gpr = d.p.in / 64;
  d.p.out = n, d.p.expert_words = n * wpr, d.p.expert_groups = n * gpr;
  d.codes += row0 * wpr, d.scales += row0 * gpr, d.biases += row0 * gpr;
  return d;
}

// One weight of sum(ns) rows cut into parts of ns[i] rows (boundaries inside the GEMM's 64-row blocks too), each
// part's output in its own poisoned buffer of row stride ns[i] + pads[i]; the concatenated launch (taken by the
// wgmma GEMM from 64 rows when the tiles fill the GPU, else one linear() per part) and, as its twin, the parts
// without the concatenation (concat.codes == nullptr: one linear() each) against the fp64 reference rows.
void run_concat(Rng& r, const std::string& name, int bits, int64_t M, const std::vector<int64_t>& ns,
                const std::vector<int64_t>& pads, int64_t K) {
  int64_t N = 0;
  for (int64_t n : ns) N += n;
  const int np = static_cast<int>(ns.size());
  QWeight W = make_qweight(r, bits, 1, N, K);
  const std::vector<uint16_t> A = random_bf16(r, M * K, -1, 1);
  const std::vector<int64_t> rows = sample_rows(r, M, 48);
  std::vector<const uint16_t*> rp;
  for (int64_t m : rows) rp.push_back(A.data() + m * K);
  const std::vector<double> ref = reference(W, rp, std::vector<int>(rows.size(), 0));
  bf16* dA = reinterpret_cast<bf16*>(dupload(A));
  std::vector<cuda::DLinear> parts;
  std::vector<float*> ys;
  std::vector<int64_t> lds, begin;
  for (int i = 0, row0 = 0; i < np; row0 += static_cast<int>(ns[i]), ++i) {
    parts.push_back(row_view(W.dl(), row0, ns[i]));
    lds.push_back(ns[i] + pads[i]);
    ys.push_back(dalloc<float>(M * lds[i]));
    begin.push_back(row0);
  }
  for (int form = 0; form < 2; ++form) {  // 0: concatenated, 1: the parts alone
    for (int i = 0; i < np; ++i) CK(cudaMemset(ys[i], 0xFF, M * lds[i] * 4));
    cuda::DLinear concat = W.dl();
    if (form == 1) concat = cuda::DLinear{};
    cuda::linear_concat(nullptr, concat, parts.data(), np, dA, K, M, ys.data(), lds.data());
    sync_check();
    Stats s;
    for (int i = 0; i < np; ++i) {
      const std::vector<float> out = ddownload(ys[i], M * lds[i]);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < ns[i]; ++n)
          if (!std::isfinite(out[m * lds[i] + n])) ++s.bad;
      for (size_t k = 0; k < rows.size(); ++k)
        for (int64_t n = 0; n < ns[i]; ++n) {
          const float o = out[rows[k] * lds[i] + n];
          if (std::isfinite(o)) s.add(o, ref[k * N + begin[i] + n]);
        }
    }
    std::string shape;
    for (int64_t n : ns) shape += (shape.empty() ? "" : "+") + std::to_string(n);
    char nm[256];
    std::snprintf(nm, sizeof nm, "concat/%s q%d %s M=%lld N=%s K=%lld", name.c_str(), bits, form ? "parts" : "joined",
                  (long long)M, shape.c_str(), (long long)K);
    report(nm, s, kTolF32);
  }
  for (float* y : ys) cudaFree(y);
  cudaFree(dA);
  W.free_device();
}

// ---- grouped (MoE) cases ---------------------------------------------------------------------------------
// Tile map exactly as moe_sort builds it: per expert, consecutive tiles of <= tile_rows sorted pairs.
struct DeviceMap {
  cuda::GroupMap g;
  std::vector<int32_t*> bufs;
  void free_all() {
    for (auto* p : bufs) cudaFree(p);
  }
};

DeviceMap upload_map(const std::vector<int>& counts, int tile_rows, const int32_t* a_rows, const int32_t* y_rows,
                     const float* scale) {
  std::vector<int32_t> te, t0, tr;
  int off = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int r = 0; r < counts[e]; r += tile_rows) {
      te.push_back(static_cast<int32_t>(e));
      t0.push_back(off + r);
      tr.push_back(std::min(tile_rows, counts[e] - r));
    }
    off += counts[e];
  }
  const int64_t cap = cuda::grouped_max_tiles(off, static_cast<int>(counts.size()), tile_rows);
  if (static_cast<int64_t>(te.size()) > cap) {
    std::fprintf(stderr, "tile map over capacity\n");
    std::exit(2);
  }
  const std::vector<int32_t> nt{static_cast<int32_t>(te.size())};
  // Unused capacity holds garbage on the device too: the kernels must stop at n_tiles.
  te.resize(cap, 0x7FFFFFFF), t0.resize(cap, -1), tr.resize(cap, 1 << 20);
  DeviceMap m;
  m.bufs = {dupload(nt), dupload(te), dupload(t0), dupload(tr)};
  m.g.n_tiles = m.bufs[0], m.g.tile_expert = m.bufs[1], m.g.tile_row0 = m.bufs[2], m.g.tile_rows = m.bufs[3];
  m.g.a_rows = a_rows, m.g.y_rows = y_rows, m.g.scale = scale;
  m.g.max_tiles = cap;
  return m;
}

// Routed pairs sorted by expert: counts per expert, pair -> token (a_rows), pair -> output row (y_rows, a
// permutation), routing weight (scale).
struct Routing {
  int64_t S = 0;
  std::vector<int> counts;
  std::vector<int32_t> a_rows, y_rows;
  std::vector<float> scale;
  int64_t pairs() const { return static_cast<int64_t>(a_rows.size()); }
};

Routing routing_from_counts(Rng& r, const std::vector<int>& counts, int64_t S) {
  Routing R;
  R.S = S, R.counts = counts;
  for (int c : counts)
    for (int i = 0; i < c; ++i) R.a_rows.push_back(static_cast<int32_t>(r.below(S)));
  R.y_rows.resize(R.a_rows.size());
  for (size_t i = 0; i < R.y_rows.size(); ++i) R.y_rows[i] = static_cast<int32_t>(i);
  for (size_t i = R.y_rows.size(); i > 1; --i) std::swap(R.y_rows[i - 1], R.y_rows[r.below(i)]);
  for (size_t i = 0; i < R.a_rows.size(); ++i) R.scale.push_back(static_cast<float>(r.uni(0.05, 1.0)));
  return R;
}

// Top-k of skewed expert popularity per token (Gumbel top-k on log-normal popularity), like real routing.
Routing routing_skewed(Rng& r, int64_t S, int E, int k) {
  std::vector<double> logp(E);
  for (auto& v : logp) v = 1.2 * r.normal();
  std::vector<std::vector<int32_t>> tok(E);
  std::vector<std::pair<double, int>> key(E);
  for (int64_t s = 0; s < S; ++s) {
    for (int e = 0; e < E; ++e) key[e] = {logp[e] - std::log(-std::log(std::max(r.uni(), 1e-300))), e};
    std::partial_sort(key.begin(), key.begin() + k, key.end(), std::greater<>());
    for (int j = 0; j < k; ++j) tok[key[j].second].push_back(static_cast<int32_t>(s * k + j));
  }
  Routing R;
  R.S = S;
  for (int e = 0; e < E; ++e) {
    R.counts.push_back(static_cast<int>(tok[e].size()));
    for (int32_t id : tok[e]) {
      R.a_rows.push_back(id / k);
      R.y_rows.push_back(id);
      R.scale.push_back(static_cast<float>(r.uni(0.02, 0.5)));
    }
  }
  return R;
}

std::vector<int> pair_experts(const Routing& R) {
  std::vector<int> ex;
  for (size_t e = 0; e < R.counts.size(); ++e) ex.insert(ex.end(), R.counts[e], static_cast<int>(e));
  return ex;
}

// gate/up: act[p] = bf16(silu(h[a_rows[p]] W0[e]^T) * (h[a_rows[p]] W1[e]^T))   h [S, H], act [P, I]
// down:    d[y_rows[p]] = scale[p] * (act_in[p] W2[e]^T)                        act_in [P, Kd], d [P, D]
// (down reads its own random act_in, so I and Kd may differ). Every tile size runs on the mma path, those
// <= 64 on the wmma path too.
void run_grouped(Rng& r, const std::string& name, const Routing& R, int bits, int64_t H, int64_t I, int64_t Kd,
                 int64_t D, int64_t sample, const std::vector<int>& tiles) {
  const int E = static_cast<int>(R.counts.size());
  const int64_t P = R.pairs();
  const std::vector<int> ex = pair_experts(R);
  QWeight W0 = make_qweight(r, bits, E, I, H), W1 = make_qweight(r, bits, E, I, H), W2 = make_qweight(r, bits, E, D, Kd);
  const std::vector<uint16_t> h = random_bf16(r, R.S * H, -1, 1), act_in = random_bf16(r, P * Kd, -1, 1);
  const std::vector<int64_t> ps = sample_rows(r, P, sample);
  std::vector<const uint16_t*> gu_rows, deltanet_rows;
  std::vector<int> ps_ex;
  for (int64_t p : ps) {
    gu_rows.push_back(h.data() + R.a_rows[p] * H);
    deltanet_rows.push_back(act_in.data() + p * Kd);
    ps_ex.push_back(ex[p]);
  }
  const std::vector<double> rg = reference(W0, gu_rows, ps_ex), ru = reference(W1, gu_rows, ps_ex),
                            rd = reference(W2, deltanet_rows, ps_ex);
  bf16* dh = reinterpret_cast<bf16*>(dupload(h));
  bf16* dact_in = reinterpret_cast<bf16*>(dupload(act_in));
  int32_t* da = dupload(R.a_rows);
  int32_t* dyr = dupload(R.y_rows);
  float* dsc = dupload(R.scale);
  bf16* dact = dalloc<bf16>(P * I);
  bf16* dd = dalloc<bf16>(P * D);
  for (int tile : tiles)
    for (int impl = 1; impl >= 0; --impl) {
      if (impl == 0 && tile > cuda::kGemmBM) continue;
      DeviceMap m = upload_map(R.counts, tile, da, dyr, dsc);
      CK(cudaMemset(dact, 0xFF, P * I * 2));
      CK(cudaMemset(dd, 0xFF, P * D * 2));
      cuda::force_gemm_fallback(impl == 0);
      cuda::grouped_gate_up(nullptr, W0.dl(), W1.dl(), m.g, dh, H, dact, tile);
      cuda::grouped_down(nullptr, W2.dl(), m.g, dact_in, dd, tile);
      sync_check();
      const std::vector<uint16_t> act = ddownload(reinterpret_cast<uint16_t*>(dact), P * I);
      const std::vector<uint16_t> d = ddownload(reinterpret_cast<uint16_t*>(dd), P * D);
      Stats sg, sd;
      for (auto v : act)
        if (!std::isfinite(bf2f(v))) ++sg.bad;
      for (auto v : d)
        if (!std::isfinite(bf2f(v))) ++sd.bad;
      for (size_t i = 0; i < ps.size(); ++i) {
        const int64_t p = ps[i];
        for (int64_t n = 0; n < I; ++n) {
          const float o = bf2f(act[p * I + n]);
          if (std::isfinite(o)) sg.add(o, silu(rg[i * I + n]) * ru[i * I + n]);
        }
        for (int64_t n = 0; n < D; ++n) {
          const float o = bf2f(d[R.y_rows[p] * D + n]);
          if (std::isfinite(o)) sd.add(o, R.scale[p] * rd[i * D + n]);
        }
      }
      char nm[256];
      std::snprintf(nm, sizeof nm, "%s/%s_gate_up q%d tile=%d E=%d pairs=%lld N=%lld K=%lld", impl ? "mma" : "wmma",
                    name.c_str(), bits, tile, E, (long long)P, (long long)I, (long long)H);
      report(nm, sg, kTolBf16);
      std::snprintf(nm, sizeof nm, "%s/%s_down q%d tile=%d E=%d pairs=%lld N=%lld K=%lld", impl ? "mma" : "wmma",
                    name.c_str(), bits, tile, E, (long long)P, (long long)D, (long long)Kd);
      report(nm, sd, kTolBf16);  // d is bf16: one more rounding, as the dual's
      m.free_all();
    }
  cudaFree(dh), cudaFree(dact_in), cudaFree(da), cudaFree(dyr), cudaFree(dsc), cudaFree(dact), cudaFree(dd);
  W0.free_device(), W1.free_device(), W2.free_device();
}

// ---- timing ----------------------------------------------------------------------------------------------
__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33, x *= 0xFF51AFD7ED558CCDull, x ^= x >> 33, x *= 0xC4CEB9FE1A85EC53ull, x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__global__ void fill_u32(uint32_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = hash32(seed * 0x9E3779B97F4A7C15ull + i);
}
__global__ void fill_bf16(bf16* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(lo + (hi - lo) * (hash32(seed * 0x9E3779B97F4A7C15ull + i) >> 8) * (1.f / 16777216.f));
}

// Device-only weights for timing (random codes, scales like make_qweight).
struct DevWeight {
  cuda::DLinear d;
  void make(int bits, int64_t E, int64_t out, int64_t in, uint64_t seed) {
    const int64_t words = E * out * in * bits / 32, groups = E * out * in / 64;
    uint32_t* c = dalloc<uint32_t>(words);
    bf16* s = dalloc<bf16>(groups);
    bf16* b = dalloc<bf16>(groups);
    const float q = static_cast<float>((1 << bits) - 1);
    fill_u32<<<1024, 256>>>(c, words, seed);
    fill_bf16<<<1024, 256>>>(s, groups, seed + 1, 0.08f / q, 0.2f / q);
    fill_bf16<<<1024, 256>>>(b, groups, seed + 2, -0.13f, -0.03f);
    CK(cudaGetLastError());
    d.p = kp::LinearParams{0, bits, 64, 0, out, in, out * in * bits / 32, out * in / 64, 0};
    d.codes = c, d.scales = reinterpret_cast<uint16_t*>(s), d.biases = reinterpret_cast<uint16_t*>(b);
  }
  void free_all() {
    cudaFree(const_cast<uint32_t*>(d.codes)), cudaFree(const_cast<uint16_t*>(d.scales)),
        cudaFree(const_cast<uint16_t*>(d.biases));
  }
};

// Median of `reps` event-timed launches after warm-up, rotating input sets so L2 (60 MB) does not hold them.
double median_ms(const std::function<void(int)>& launch, int nsets, int reps = 25) {
  for (int i = 0; i < 3; ++i) launch(i % nsets);
  sync_check();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(ev[2 * i]));
    launch(i % nsets);
    CK(cudaEventRecord(ev[2 * i + 1]));
  }
  sync_check();
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) CK(cudaEventDestroy(e));
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

constexpr double kPeakTflops = 790.0;

void print_time(const std::string& name, double ms, double flop, double ms_old) {
  const double tf = flop / (ms * 1e-3) / 1e12;
  std::printf("TIME %-44s %8.1f us %7.1f TFLOP/s (%4.1f%% of %.0f)", name.c_str(), ms * 1e3, tf, 100 * tf / kPeakTflops,
              kPeakTflops);
  if (ms_old > 0) std::printf("  x%.2f vs wmma", ms_old / ms);
  std::printf("\n");
}

void time_plain(const std::string& name, int bits, int64_t M, int64_t N, int64_t K, Mode mode) {
  constexpr int kSets = 4;
  const bool dual = mode == kDual;
  DevWeight w0[kSets], w1[kSets];
  bf16* A[kSets];
  for (int s = 0; s < kSets; ++s) {
    w0[s].make(bits, 1, N, K, 100 + 10 * s);
    if (dual) w1[s].make(bits, 1, N, K, 105 + 10 * s);
    A[s] = dalloc<bf16>(M * K);
    fill_bf16<<<1024, 256>>>(A[s], M * K, 7 + s, -1.f, 1.f);
  }
  float* y = dalloc<float>(M * N);
  bf16* yb = dalloc<bf16>(M * N);
  CK(cudaMemset(y, 0, M * N * 4));
  double ms[2];
  for (int impl = 0; impl < 2; ++impl) {
    cuda::force_gemm_fallback(impl == 0);
    ms[impl] = median_ms(
        [&](int s) {
          if (dual) cuda::linear_silu_mul(nullptr, w0[s].d, w1[s].d, A[s], K, M, yb, N);
          else cuda::linear(nullptr, w0[s].d, A[s], K, M, y, N, mode == kAcc);
        },
        kSets);
  }
  cuda::force_gemm_fallback(false);
  const double flop = 2.0 * M * N * K * (dual ? 2 : 1);
  char nm[160];
  std::snprintf(nm, sizeof nm, "%s q%d %s %lldx%lldx%lld", name.c_str(), bits, kModeName[mode], (long long)M,
                (long long)N, (long long)K);
  print_time(std::string("wmma/") + nm, ms[0], flop, 0);
  print_time(std::string("mma/") + nm, ms[1], flop, ms[0]);
  for (int s = 0; s < kSets; ++s) {
    w0[s].free_all();
    if (dual) w1[s].free_all();
    cudaFree(A[s]);
  }
  cudaFree(y), cudaFree(yb);
}

// The DeltaNet in-projection (qkv 8192, z 4096, b 32, a 32 rows) at M rows: one concatenated GEMM against the four.
void time_concat(int64_t M) {
  constexpr int kSets = 4;
  const std::vector<int64_t> ns = {8192, 4096, 32, 32};
  const int64_t N = 12352, K = 2048;
  DevWeight w[kSets];
  bf16* A[kSets];
  for (int s = 0; s < kSets; ++s) {
    w[s].make(4, 1, N, K, 300 + 10 * s);
    A[s] = dalloc<bf16>(M * K);
    fill_bf16<<<1024, 256>>>(A[s], M * K, 17 + s, -1.f, 1.f);
  }
  std::vector<float*> ys;
  std::vector<int64_t> lds(ns.begin(), ns.end());
  for (int64_t n : ns) ys.push_back(dalloc<float>(M * n));
  std::vector<cuda::DLinear> parts[kSets];  // each set's four row views, built once outside the timing
  for (int s = 0; s < kSets; ++s)
    for (int64_t i = 0, row0 = 0; i < 4; row0 += ns[i], ++i) parts[s].push_back(row_view(w[s].d, row0, ns[i]));
  double ms[2];
  for (int form = 0; form < 2; ++form)
    ms[form] = median_ms(
        [&](int s) {
          cuda::linear_concat(nullptr, form == 0 ? w[s].d : cuda::DLinear{}, parts[s].data(), 4, A[s], K, M,
                              ys.data(), lds.data());
        },
        kSets);
  const double flop = 2.0 * M * N * K;
  char nm[160];
  std::snprintf(nm, sizeof nm, "deltanet_in q4 %lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
  print_time(std::string("parts/") + nm, ms[1], flop, 0);
  print_time(std::string("concat/") + nm, ms[0], flop, ms[1]);
  for (int s = 0; s < kSets; ++s) w[s].free_all(), cudaFree(A[s]);
  for (float* y : ys) cudaFree(y);
}

// Real MoE sizes: S tokens x top-8 over 256 experts (skewed), gate/up 2048 -> 2 x 512, down 512 -> 2048.
void time_grouped(Rng& r, int64_t S) {
  constexpr int kSets = 3, E = 256, k = 8;
  constexpr int64_t H = 2048, I = 512;
  const Routing R = routing_skewed(r, S, E, k);
  const int64_t P = R.pairs();
  const int auto_tile = cuda::pick_expert_tile(P, E);
  const int mx = *std::max_element(R.counts.begin(), R.counts.end());
  const int zeros = static_cast<int>(std::count(R.counts.begin(), R.counts.end(), 0));
  std::printf("INFO grouped timing: pairs=%lld experts=%d max_rows=%d empty=%d auto_tile=%d\n", (long long)P, E, mx,
              zeros, auto_tile);
  DevWeight wg[kSets], wu[kSets], wd[kSets];
  bf16 *h[kSets], *act_in[kSets];
  for (int s = 0; s < kSets; ++s) {
    wg[s].make(4, E, I, H, 200 + 10 * s), wu[s].make(4, E, I, H, 203 + 10 * s), wd[s].make(4, E, H, I, 206 + 10 * s);
    h[s] = dalloc<bf16>(S * H), act_in[s] = dalloc<bf16>(P * I);
    fill_bf16<<<1024, 256>>>(h[s], S * H, 300 + s, -1.f, 1.f);
    fill_bf16<<<1024, 256>>>(act_in[s], P * I, 400 + s, -1.f, 1.f);
  }
  int32_t* da = dupload(R.a_rows);
  int32_t* dyr = dupload(R.y_rows);
  float* dsc = dupload(R.scale);
  bf16* act = dalloc<bf16>(P * I);
  bf16* d = dalloc<bf16>(P * H);
  const double flop_gu = 2.0 * P * (2 * I) * H, flop_dn = 2.0 * P * H * I;
  double old_gu = 0, old_dn = 0;
  for (int tile : {64, 16, 32, 128})
    for (int impl = 0; impl < 2; ++impl) {
      if (impl == 0 && tile != cuda::kGemmBM) continue;
      DeviceMap m = upload_map(R.counts, tile, da, dyr, dsc);
      cuda::force_gemm_fallback(impl == 0);
      const double gu = median_ms(
          [&](int s) { cuda::grouped_gate_up(nullptr, wg[s].d, wu[s].d, m.g, h[s], H, act, tile); }, kSets);
      const double dn = median_ms([&](int s) { cuda::grouped_down(nullptr, wd[s].d, m.g, act_in[s], d, tile); },
                                  kSets);
      if (impl == 0) old_gu = gu, old_dn = dn;
      const std::string tag = std::string(impl ? "mma/" : "wmma/") + "moe_%s q4 tile=" + std::to_string(tile) +
                              (tile == auto_tile ? "(auto)" : "");
      char nm[160];
      std::snprintf(nm, sizeof nm, tag.c_str(), "gate_up_dual");
      print_time(nm, gu, flop_gu, impl ? old_gu : 0);
      std::snprintf(nm, sizeof nm, tag.c_str(), "down");
      print_time(nm, dn, flop_dn, impl ? old_dn : 0);
      m.free_all();
    }
  for (int s = 0; s < kSets; ++s) {
    wg[s].free_all(), wu[s].free_all(), wd[s].free_all();
    cudaFree(h[s]), cudaFree(act_in[s]);
  }
  cudaFree(da), cudaFree(dyr), cudaFree(dsc), cudaFree(act), cudaFree(d);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10)
                                 : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                       static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::printf("INFO check_gemm seed=%llu\n", (unsigned long long)seed);
  Rng r{seed};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // Real shapes (hidden 2048), M = a 2048-token prefill chunk; reference on 64 sampled rows.
    const std::vector<PlainCase> real = {
        {"deltanet_qkv", 4, 2048, 8192, 2048, kStore},      {"deltanet_out", 4, 2048, 2048, 4096, kAcc},
        {"attn_kv", 4, 2048, 512, 2048, kStore},       {"deltanet_b", 4, 2048, 32, 2048, kStore},
        {"router", 8, 2048, 256, 2048, kStore},        {"shared_gate_up", 4, 2048, 512, 2048, kDual},
        {"shared_down", 4, 2048, 2048, 512, kStore},   {"shared_expert_gate", 4, 2048, 1, 2048, kStore},
        {"lm_head", 4, 5, 248320, 2048, kStore},
    };
    for (const auto& c : real) run_plain(r, c);
    // Awkward shapes: every (M, N, K); mode and bits rotate so each of the 6 pairs appears 4 times.
    int idx = 0;
    for (int64_t M : {1, 3, 77, 130})
      for (int64_t N : {1, 32, 200})
        for (int64_t K : {64, 192}) {
          run_plain(r, {"odd", (idx / 3) % 2 ? 8 : 4, M, N, K, static_cast<Mode>(idx % 3)});
          ++idx;
        }
    // Padded lda, odd ldy (scalar epilogue), scale/bias arrays starting 2 bytes past a 4-byte boundary.
    run_plain(r, {"padded", 4, 77, 200, 192, kStore, 8, 1, 1});
    run_plain(r, {"padded", 4, 130, 72, 128, kDual, 16, 3, 1});
    run_plain(r, {"padded", 8, 33, 40, 256, kAcc, 8, 1, 1});

    // Concatenated projections: the real DeltaNet and attention in-projections; part boundaries inside 64-row
    // blocks, a 1-row part, padded output rows; M = 33 (under the wgmma GEMM's 64 rows: the mma GEMM).
    // 8-bit (the router and the shared expert's gate): the mma GEMM's epilogue routes the columns.
    run_concat(r, "deltanet_in", 4, 2048, {8192, 4096, 32, 32}, {0, 0, 0, 0}, 2048);
    run_concat(r, "attn_in", 4, 300, {8192, 512, 512}, {0, 0, 0}, 2048);
    run_concat(r, "odd", 4, 300, {1000, 37, 1, 300}, {1, 3, 0, 5}, 192);
    run_concat(r, "odd", 4, 33, {100, 37, 1}, {0, 3, 2}, 128);
    run_concat(r, "q8", 8, 2048, {256, 1}, {0, 0}, 2048);
    run_concat(r, "q8", 8, 5, {256, 1}, {0, 0}, 2048);
    run_concat(r, "odd", 8, 77, {33, 1, 70, 3}, {1, 0, 2, 3}, 128);

    // Grouped: 32 experts with empty ones, a 1-row and a 300-row expert; real gate/up and down dims.
    {
      std::vector<int> counts(32);
      for (auto& c : counts) c = static_cast<int>(std::pow(r.uni(), 2.0) * 120);
      counts[0] = 0, counts[1] = 1, counts[2] = 300, counts[3] = 0, counts[7] = 0, counts[31] = 2;
      const Routing R = routing_from_counts(r, counts, 512);
      run_grouped(r, "moe", R, 4, 2048, 512, 512, 2048, 192, {16, 32, 64, 128});
    }
    // Grouped awkward: tiny K, N not a multiple of any tile, 8-bit.
    {
      const Routing R = routing_from_counts(r, {0, 1, 37, 0, 130, 5, 0, 17}, 97);
      run_grouped(r, "moe_odd", R, 4, 192, 200, 128, 72, 1000, {16, 32, 64, 128});
      // an odd down width: the bf16 d rows are not 4-byte aligned, so every GEMM's bf16 store takes its scalar tail
      run_grouped(r, "moe_odd_n", R, 4, 192, 200, 128, 75, 1000, {16, 64, 128});
      const Routing R8 = routing_from_counts(r, {3, 0, 66, 1, 0, 129}, 50);
      run_grouped(r, "moe_q8", R8, 8, 128, 40, 64, 256, 1000, {16, 64, 128});
    }
    // Real MoE size: 2048 tokens x top-8 over 256 skewed experts, auto tile; 128 sampled pairs.
    {
      const Routing R = routing_skewed(r, 2048, 256, 8);
      run_grouped(r, "moe_real", R, 4, 2048, 512, 512, 2048, 128, {cuda::pick_expert_tile(R.pairs(), 256)});
    }
    const double check_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("INFO checks took %.1f s\n", check_s);

    if (g_pass == g_total) {
      time_plain("deltanet_qkv", 4, 2048, 8192, 2048, kStore);
      time_plain("deltanet_out", 4, 2048, 2048, 4096, kAcc);
      time_plain("attn_kv", 4, 2048, 512, 2048, kStore);
      time_plain("router", 8, 2048, 256, 2048, kStore);
      time_plain("shared_gate_up", 4, 2048, 512, 2048, kDual);
      time_concat(2048);
      time_concat(4096);
      time_grouped(r, 2048);
      time_grouped(r, 4096);  // the 4K prefill's tile map (128-row tiles)
    } else {
      std::printf("INFO timing skipped: correctness failed\n");
    }
  } catch (const std::exception& ex) {
    std::printf("FAIL exception: %s\n", ex.what());
    ++g_total;
  }
  std::printf("INFO total %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("SUMMARY gemm %d/%d\n", g_pass, g_total);
  return g_pass == g_total ? 0 : 1;
}
