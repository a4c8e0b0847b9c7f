// The decode GEMV's check programs' shared prelude (check_decode.cu and its fused launches' checks): random
// MLX 4- / 8-bit and dense weights with their host copies (QW), device buffers, bf16 inputs and the pass / fail
// report. One translation unit per program, so its globals (the seed, the pass count) are the program's.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/gemv.cuh"

using namespace lily;
using namespace lily::cuda;

static std::mt19937_64 rng(std::chrono::steady_clock::now().time_since_epoch().count());
static int n_pass = 0, n_total = 0;

template <class T>
inline T* dnew(const std::vector<T>& h) {
  T* d = nullptr;
  LILY_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) LILY_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
inline std::vector<T> dget(const T* d, size_t n) {
  std::vector<T> h(n);
  LILY_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// A host + device weight [E, out, in]: MLX affine 4- or 8-bit (group 64 unless given, scale ~ 1/(2^bits sqrt(in)),
// bias centring the codes) or dense bf16 (bits 16).
struct QW {
  int64_t E, out, in;
  int bits, group;
  std::vector<uint32_t> codes;
  std::vector<uint16_t> sc, bi, dense;
  DLinear d;
  QW(int64_t E_, int64_t out_, int64_t in_, int bits_ = 4, int group_ = 64)
      : E(E_), out(out_), in(in_), bits(bits_), group(group_) {
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    if (bits == 16) {
      std::normal_distribution<float> nd(0.f, 1.f / std::sqrt(static_cast<float>(in)));
      dense.resize(E * out * in);
      for (auto& v : dense) v = host_bf16(nd(rng));
      d.p = kp::LinearParams{1, 16, 0, 0, out, in, 0, 0, out * in};
      d.dense = dnew(dense);
      return;
    }
    codes.resize(E * out * in * bits / 32);
    sc.resize(E * out * in / group);
    bi.resize(sc.size());
    for (auto& c : codes) c = static_cast<uint32_t>(rng());
    const float qmax = static_cast<float>((1 << bits) - 1);
    for (size_t i = 0; i < sc.size(); ++i) {
      const float s = u(rng) * 16.f / (qmax * 8.f * std::sqrt(static_cast<float>(in)));
      sc[i] = host_bf16(s);
      bi[i] = host_bf16(-0.5f * qmax * s * u(rng));
    }
    d.p = kp::LinearParams{0, bits, group, 0, out, in, out * in * bits / 32, out * in / group, out * in};
    d.codes = dnew(codes);
    d.scales = dnew(sc);
    d.biases = dnew(bi);
  }
  double w(int64_t e, int64_t r, int64_t k) const {
    if (bits == 16) return host_float(dense[(e * out + r) * in + k]);
    const int per = 32 / bits;
    const uint32_t word = codes[(e * out + r) * (in / per) + k / per];
    const int q = (word >> (bits * (k % per))) & ((1 << bits) - 1);
    const int64_t g = (e * out + r) * (in / group) + k / group;
    return static_cast<double>(host_float(sc[g])) * q + host_float(bi[g]);
  }
  double dot(int64_t e, int64_t r, const std::vector<uint16_t>& x, int64_t off = 0) const {
    double s = 0;
    for (int64_t k = 0; k < in; ++k) s += w(e, r, k) * host_float(x[off + k]);
    return s;
  }
};

inline std::vector<uint16_t> rand_x(int64_t n) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> x(n);
  for (auto& v : x) v = host_bf16(nd(rng));
  return x;
}

inline void report(const char* name, const std::vector<double>& ref, const std::vector<double>& got, double tol) {
  double num = 0, den = 0, mx = 0;
  bool finite = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) finite = false;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
    mx = std::max(mx, std::fabs(got[i] - ref[i]));
  }
  const double rel = std::sqrt(num / std::max(den, 1e-300));
  const bool ok = finite && rel <= tol;
  ++n_total;
  n_pass += ok;
  std::printf("%s %-44s rel_rms=%.2e max_abs=%.2e (tol %.0e)%s\n", ok ? "PASS" : "FAIL", name, rel, mx, tol,
              finite ? "" : " NON-FINITE");
}

inline double silu_d(double v) { return v / (1 + std::exp(-v)); }
