// check_gemm.cu's host side: the pass counters and report, a seeded RNG, bf16 conversions, device copies, the MLX
// affine 4/8-bit weight with its fp64 reference rows, the error statistics. Included by check_gemm.cu only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gemm.cuh"
#include "check_exit.cuh"

using namespace lily;
using cuda::bf16;


namespace {

int g_pass = 0, g_total = 0;

// ---- host helpers ----------------------------------------------------------------------------------------
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uni() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  double uni(double lo, double hi) { return lo + (hi - lo) * uni(); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  double normal() { return std::sqrt(-2.0 * std::log(1.0 - uni())) * std::cos(6.283185307179586 * uni()); }
};

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}
template <class T>
T* dupload(const std::vector<T>& v) {
  T* p = dalloc<T>(v.size());
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
std::vector<T> ddownload(const T* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& f) {
  const int nt = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 32u));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += nt) f(i);
    });
  for (auto& x : th) x.join();
}

std::vector<uint16_t> random_bf16(Rng& r, size_t n, double lo, double hi) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f2bf(static_cast<float>(r.uni(lo, hi)));
  return v;
}

// ---- quantized weight: MLX affine, group 64, [E, out, in] ------------------------------------------------
struct QWeight {
  int bits = 4;
  int64_t E = 1, out = 0, in = 0;
  int sb_off = 0;  // scale/bias arrays start this many bf16 past a 16-byte boundary (address parity test)
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;
  uint32_t* d_codes = nullptr;
  uint16_t *d_scales = nullptr, *d_biases = nullptr;

  int64_t wpr() const { return in * bits / 32; }
  int64_t gpr() const { return in / 64; }
  cuda::DLinear dl() const {
    cuda::DLinear d;
    d.p = kp::LinearParams{0, bits, 64, 0, out, in, out * wpr(), out * gpr(), 0};
    d.codes = d_codes;
    d.scales = d_scales + sb_off;
    d.biases = d_biases + sb_off;
    return d;
  }
  // Row n of expert e as the kernels see it: bf16(s*q + b) (exact in fp64, one rounding).
  void dequant_row(int64_t e, int64_t n, float* w) const {
    const uint32_t* c = codes.data() + (e * out + n) * wpr();
    const int64_t g0 = (e * out + n) * gpr();
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t k = 0; k < in; ++k) {
      const double q = (c[k / per] >> (bits * (k % per))) & mask;
      const double v = static_cast<double>(bf2f(scales[g0 + k / 64])) * q + bf2f(biases[g0 + k / 64]);
      w[k] = bf2f(f2bf(static_cast<float>(v)));
    }
  }
  void free_device() {
    cudaFree(d_codes);
    cudaFree(d_scales);
    cudaFree(d_biases);
  }
};

// Scales like a real checkpoint: weights ~ +-0.1, bias near -s*(2^bits-1)/2 so s*q + b is centred.
QWeight make_qweight(Rng& r, int bits, int64_t E, int64_t out, int64_t in, int sb_off = 0) {
  QWeight W;
  W.bits = bits, W.E = E, W.out = out, W.in = in, W.sb_off = sb_off;
  W.codes.resize(E * out * W.wpr());
  for (auto& c : W.codes) c = static_cast<uint32_t>(r.next());
  const int64_t ng = E * out * W.gpr();
  W.scales.resize(ng);
  W.biases.resize(ng);
  const double qmax = (1 << bits) - 1;
  for (int64_t i = 0; i < ng; ++i) {
    const double s = r.uni(0.08, 0.2) / qmax;
    W.scales[i] = f2bf(static_cast<float>(s));
    W.biases[i] = f2bf(static_cast<float>(-s * qmax / 2 * r.uni(0.7, 1.3)));
  }
  W.d_codes = dupload(W.codes);
  W.d_scales = dalloc<uint16_t>(ng + sb_off);
  W.d_biases = dalloc<uint16_t>(ng + sb_off);
  CK(cudaMemcpy(W.d_scales + sb_off, W.scales.data(), ng * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(W.d_biases + sb_off, W.biases.data(), ng * 2, cudaMemcpyHostToDevice));
  return W;
}

// ref[i][n] = sum_k A_i[k] * W[e_i, n, k] in fp64 for rows i given as (bf16 row, expert).
std::vector<double> reference(const QWeight& W, const std::vector<const uint16_t*>& rows, const std::vector<int>& experts) {
  const int64_t R = static_cast<int64_t>(rows.size()), K = W.in, N = W.out;
  std::vector<float> af(R * K);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t k = 0; k < K; ++k) af[i * K + k] = bf2f(rows[i][k]);
  std::vector<std::vector<int64_t>> by_expert(W.E);
  for (int64_t i = 0; i < R; ++i) by_expert[experts[i]].push_back(i);
  std::vector<double> ref(R * N);
  constexpr int64_t kChunk = 16;
  parallel_for((N + kChunk - 1) / kChunk, [&](int64_t c) {
    std::vector<float> w(K);
    for (int64_t e = 0; e < W.E; ++e) {
      if (by_expert[e].empty()) continue;
      for (int64_t n = c * kChunk; n < std::min(N, c * kChunk + kChunk); ++n) {
        W.dequant_row(e, n, w.data());
        for (int64_t i : by_expert[e]) {
          const float* a = af.data() + i * K;
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(a[k]) * w[k];
          ref[i * N + n] = acc;
        }
      }
    }
  });
  return ref;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct Stats {
  double se = 0, sr = 0, max_abs = 0;
  int64_t bad = 0;  // non-finite outputs (unwritten elements stay NaN)
  void add(double out, double ref) {
    if (!std::isfinite(out)) {
      ++bad;
      return;
    }
    se += (out - ref) * (out - ref), sr += ref * ref, max_abs = std::max(max_abs, std::abs(out - ref));
  }
  double rel_rms() const { return std::sqrt(se / std::max(sr, 1e-300)); }
};

bool report(const std::string& name, const Stats& s, double tol) {
  const bool ok = s.bad == 0 && s.rel_rms() <= tol;
  ++g_total;
  g_pass += ok;
  std::printf("%s %s rel_rms=%.3e max_abs=%.3e%s\n", ok ? "PASS" : "FAIL", name.c_str(), s.rel_rms(), s.max_abs,
              s.bad ? (" nonfinite=" + std::to_string(s.bad)).c_str() : "");
  return ok;
}

void sync_check() {
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
}

std::vector<int64_t> sample_rows(Rng& r, int64_t M, int64_t n) {
  std::vector<int64_t> v;
  if (M <= n) {
    for (int64_t i = 0; i < M; ++i) v.push_back(i);
    return v;
  }
  v = {0, M - 1};
  while (static_cast<int64_t>(v.size()) < n) v.push_back(r.below(M));
  return v;
}

}  // namespace
