// build: csrc/cuda/attention.cu csrc/cuda/attention_prefill.cu csrc/cuda/attention_prefill_wgmma.cu csrc/cuda/attention_decode.cu
// Attention (csrc/cuda/attention.cu dispatch: prefill on the tensor-core flash attention, attention_prefill_wgmma.cu's
// on Hopper and attention_prefill.cu's mma.sync twin, each prefill case run on both where the GPU has both; one row on
// the CUDA-core attn_kernel or with tc_decode the tensor-core decode kernel) against an fp64 host reference, then
// timing at the real shapes (the prefill shapes on both kernels).
//
// Reference: the same bf16 K/V cache, q rounded to bf16 (what the mma kernel consumes; attn_kernel reads
// fp32 q, which differs from this reference by far less than the tolerance), exact softmax and sigmoid gate
// in fp64. Tolerance rel_rms <= 5e-3: the output is rounded to bf16 (~1.1e-3 relative RMS) and P is rounded
// to bf16 before P V (~1e-3); a single key wrongly in or out of the causal window moves o, an average of n
// random values of size ~1/sqrt(n), by ~1/sqrt(n) relative (>= 8e-3 up to 16K keys), well above it.
// Unwritten outputs fail through the 0xFF (NaN) poison; cache rows past pos0 + S are NaN-poisoned too, so a
// kernel that reads (and does not zero-fill) keys past the causal window fails.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda/attention.cuh"
#include "check_exit.cuh"
#include "tolerances.h"

using lily::cuda::bf16;
namespace kp = lily::kp;


constexpr double kTol = tolerances::attention_rel_rms;

__device__ __forceinline__ float hash_uniform(uint64_t seed, int64_t i) {  // [-1, 1)
  uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.f / 16777216.f) - 1.f;
}
__global__ void fill_f32(float* x, int64_t n, uint64_t seed, float amp) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = amp * hash_uniform(seed, i);
}
__global__ void fill_bf16(bf16* x, int64_t n, uint64_t seed, float amp) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = __float2bfloat16(amp * hash_uniform(seed, i));
}
static void fill(float* x, int64_t n, uint64_t seed, float amp) {
  fill_f32<<<1024, 256>>>(x, n, seed, amp);
  CK(cudaGetLastError());
}
static void fill(bf16* x, int64_t n, uint64_t seed, float amp) {
  fill_bf16<<<1024, 256>>>(x, n, seed, amp);
  CK(cudaGetLastError());
}

static float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static float round_bf16(float f) {  // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16_bits_to_float(static_cast<uint16_t>(u >> 16));
}

struct Shape {
  int D, Hq, Hkv;
  int64_t S, pos0;
};
static kp::AttentionParams make_params(const Shape& s) {
  kp::AttentionParams p{};
  p.n_heads = s.Hq, p.n_kv_heads = s.Hkv, p.head_dim = s.D, p.rotary_dim = std::min(64, s.D);
  p.rope_theta = 1e7f, p.eps = 1e-6f, p.scale = 1.f / std::sqrt(static_cast<float>(s.D));
  p.pos0 = s.pos0, p.S = s.S;
  return p;
}

// Device buffers of one input set. q fp32 [S, Hq, D]; qg fp32 [S, Hq, 2D]; k, v bf16 [cap, Hkv*D].
struct Inputs {
  Shape s;
  int64_t cap = 0;
  float *q = nullptr, *qg = nullptr;
  bf16 *k = nullptr, *v = nullptr;
  void alloc(const Shape& sh, int64_t slack) {
    s = sh;
    cap = s.pos0 + s.S + slack;
    CK(cudaMalloc(&q, s.S * s.Hq * s.D * sizeof(float)));
    CK(cudaMalloc(&qg, s.S * s.Hq * 2 * s.D * sizeof(float)));
    CK(cudaMalloc(&k, cap * s.Hkv * s.D * sizeof(bf16)));
    CK(cudaMalloc(&v, cap * s.Hkv * s.D * sizeof(bf16)));
  }
  // Score std ~ sqrt(var q * var k) = sqrt(16/3 * 1) ~ 2.3: softmax neither flat nor one-hot.
  void randomize(uint64_t seed) {
    const int64_t valid = (s.pos0 + s.S) * s.Hkv * s.D;
    fill(q, s.S * s.Hq * s.D, seed + 1, 4.f);
    fill(qg, s.S * s.Hq * 2 * s.D, seed + 2, 3.f);
    fill(k, valid, seed + 3, 1.7320508f);
    fill(v, valid, seed + 4, 1.f);
    const size_t tail = (cap - s.pos0 - s.S) * s.Hkv * s.D * sizeof(bf16);
    CK(cudaMemset(k + valid, 0xFF, tail));  // rows past the chunk: NaN (never to be read unmasked)
    CK(cudaMemset(v + valid, 0xFF, tail));
  }
  void release() {
    CK(cudaFree(q));
    CK(cudaFree(qg));
    CK(cudaFree(k));
    CK(cudaFree(v));
  }
};

// Host copies for the reference.
struct HostInputs {
  std::vector<float> qb, qg;         // qb: q rounded to bf16
  std::vector<uint16_t> k, v;        // [pos0 + S, Hkv*D]
  void load(const Inputs& in) {
    const Shape& s = in.s;
    qb.resize(s.S * s.Hq * s.D), qg.resize(s.S * s.Hq * 2 * s.D);
    k.resize((s.pos0 + s.S) * s.Hkv * s.D), v.resize(k.size());
    CK(cudaMemcpy(qb.data(), in.q, qb.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(qg.data(), in.qg, qg.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(k.data(), in.k, k.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(v.data(), in.v, v.size() * 2, cudaMemcpyDeviceToHost));
    for (float& x : qb) x = round_bf16(x);
  }
};

// fp64 reference for row t and all G query heads of KV head g: ref[(t*Hq + h)*D + d].
static void reference_rows(const Shape& s, const HostInputs& h, int64_t t, int g, std::vector<double>& ref) {
  const int D = s.D, G = s.Hq / s.Hkv;
  const int64_t n = s.pos0 + t + 1, kvs = static_cast<int64_t>(s.Hkv) * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> sc(static_cast<size_t>(G) * n), kd(D), acc(static_cast<size_t>(G) * D, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int d = 0; d < D; ++d) kd[d] = bf16_bits_to_float(h.k[i * kvs + g * D + d]);
    for (int j = 0; j < G; ++j) {
      const float* q = &h.qb[(t * s.Hq + g * G + j) * D];
      double dot = 0.0;
      for (int d = 0; d < D; ++d) dot += q[d] * kd[d];
      sc[j * n + i] = dot * scale;
    }
  }
  for (int j = 0; j < G; ++j) {
    double m = -INFINITY, L = 0.0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sc[j * n + i]);
    for (int64_t i = 0; i < n; ++i) L += (sc[j * n + i] = std::exp(sc[j * n + i] - m));
    for (int64_t i = 0; i < n; ++i) sc[j * n + i] /= L;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < D; ++d) {
      const double vv = bf16_bits_to_float(h.v[i * kvs + g * D + d]);
      for (int j = 0; j < G; ++j) acc[j * D + d] += sc[j * n + i] * vv;
    }
  for (int j = 0; j < G; ++j) {
    const int64_t row = t * s.Hq + g * G + j;
    for (int d = 0; d < D; ++d) {
      const double gate = h.qg[row * 2 * D + D + d];
      ref[row * D + d] = acc[j * D + d] / (1.0 + std::exp(-gate));
    }
  }
}

struct Case {
  std::string name;
  Shape s;
  bool tc_decode;          // attention(..., tensor_core_decode): one row on the tensor-core decode kernel
  int sample;              // rows checked (0 = all)
};

static int g_sm_count = 0;

static size_t part_floats(const Shape& s, const kp::AttnSplitParams& sp) {
  return static_cast<size_t>(s.S) * s.Hq * sp.n_splits * (s.D + 2);
}

// Whether prefill chunks of this shape have a wgmma kernel here (then run_case checks it and the mma.sync twin).
static bool has_wgmma(const Shape& s) {
  return s.S > 1 && lily::cuda::attention_wgmma_supported(make_params(s));
}

static bool run_case(const Case& c, uint64_t seed, bool wgmma) {
  const Shape& s = c.s;
  Inputs in;
  in.alloc(s, 37);
  in.randomize(seed);
  const kp::AttentionParams p = make_params(s);
  const kp::AttnSplitParams sp = lily::cuda::attention_plan(p, g_sm_count);
  float* part = nullptr;
  bf16* o = nullptr;
  const size_t no = s.S * s.Hq * s.D;
  CK(cudaMalloc(&part, std::max<size_t>(part_floats(s, sp), 1) * sizeof(float)));
  CK(cudaMalloc(&o, no * sizeof(bf16)));
  CK(cudaMemset(part, 0xFF, std::max<size_t>(part_floats(s, sp), 1) * sizeof(float)));
  CK(cudaMemset(o, 0xFF, no * sizeof(bf16)));
  lily::cuda::attention(0, p, sp, in.q, in.qg, in.k, in.v, part, o, nullptr, c.tc_decode, wgmma);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(no);
  CK(cudaMemcpy(out.data(), o, no * 2, cudaMemcpyDeviceToHost));
  HostInputs h;
  h.load(in);

  std::vector<int64_t> rows;
  if (c.sample == 0 || c.sample >= s.S) {
    for (int64_t t = 0; t < s.S; ++t) rows.push_back(t);
  } else {  // ends, tile edges, and random rows
    const int64_t fixed[] = {0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, s.S / 2, s.S - 2, s.S - 1};
    for (int64_t t : fixed)
      if (t >= 0 && t < s.S) rows.push_back(t);
    uint64_t r = seed | 1;
    while (static_cast<int>(rows.size()) < c.sample) {
      r ^= r << 13, r ^= r >> 7, r ^= r << 17;
      rows.push_back(static_cast<int64_t>(r % s.S));
    }
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  std::vector<double> ref(no, 0.0);
  std::atomic<int64_t> next{0};
  const int64_t tasks = static_cast<int64_t>(rows.size()) * s.Hkv;
  auto worker = [&]() {
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) reference_rows(s, h, rows[i / s.Hkv], static_cast<int>(i % s.Hkv), ref);
  };
  const unsigned nth = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < nth; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();

  double se = 0.0, sr = 0.0, max_abs = 0.0;
  bool finite = true;
  for (int64_t t : rows)
    for (int64_t j = 0; j < static_cast<int64_t>(s.Hq) * s.D; ++j) {
      const int64_t idx = t * s.Hq * s.D + j;
      const double y = bf16_bits_to_float(out[idx]), r = ref[idx];
      if (!std::isfinite(y)) finite = false;
      se += (y - r) * (y - r), sr += r * r;
      max_abs = std::max(max_abs, std::fabs(y - r));
    }
  const double rel = finite ? std::sqrt(se / std::max(sr, 1e-300)) : INFINITY;
  const bool ok = finite && rel <= kTol;
  const char* impl = c.tc_decode ? "tc_decode" : s.S == 1 ? "cuda_cores" : has_wgmma(s) && wgmma ? "wgmma" : "mma";
  std::printf("%s %s rel_rms=%.3e max_abs=%.3e (D=%d Hq=%d Hkv=%d S=%lld pos0=%lld impl=%s splits=%d rows=%zu)\n",
              ok ? "PASS" : "FAIL", c.name.c_str(), rel, max_abs, s.D, s.Hq, s.Hkv, static_cast<long long>(s.S),
              static_cast<long long>(s.pos0), impl, sp.n_splits, rows.size());
  std::fflush(stdout);
  CK(cudaFree(part));
  CK(cudaFree(o));
  in.release();
  return ok;
}

// Median time (ms) over rotating input sets (tc_decode: one row on the tensor-core decode kernel; wgmma: prefill on
// the wgmma kernel where there is one, else the mma.sync kernel).
static double time_impl(std::vector<Inputs>& sets, bool tc_decode, double budget_ms, bool wgmma = true) {
  const Shape& s = sets[0].s;
  const kp::AttentionParams p = make_params(s);
  const kp::AttnSplitParams sp = lily::cuda::attention_plan(p, g_sm_count);
  float* part = nullptr;
  bf16* o = nullptr;
  CK(cudaMalloc(&part, std::max<size_t>(part_floats(s, sp), 1) * sizeof(float)));
  CK(cudaMalloc(&o, s.S * s.Hq * s.D * sizeof(bf16)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto once = [&](const Inputs& in) {
    CK(cudaEventRecord(e0));
    lily::cuda::attention(0, p, sp, in.q, in.qg, in.k, in.v, part, o, nullptr, tc_decode, wgmma);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms);
  };
  const double first = once(sets[0]);  // warm-up (and the cost estimate)
  once(sets[1]);
  const int reps = static_cast<int>(std::clamp(budget_ms / std::max(first, 1e-3), 3.0, 30.0));
  std::vector<double> ts;
  for (int r = 0; r < reps; ++r) ts.push_back(once(sets[r % sets.size()]));
  std::sort(ts.begin(), ts.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(part));
  CK(cudaFree(o));
  return ts[ts.size() / 2];
}

static void time_shape(const Shape& s, uint64_t seed) {
  std::vector<Inputs> sets(3);
  for (size_t i = 0; i < sets.size(); ++i) sets[i].alloc(s, 0), sets[i].randomize(seed + 100 * i);
  CK(cudaDeviceSynchronize());
  // Causal FLOPs: QK^T and PV, 2 FLOP per multiply-add each, over sum_t (pos0 + t + 1) keys.
  const double keys = static_cast<double>(s.S) * s.pos0 + 0.5 * s.S * (s.S + 1.0);
  const double flops = 4.0 * s.D * s.Hq * keys;
  for (const bool wgmma : {true, false}) {
    if (!wgmma && !has_wgmma(s)) break;  // the mma.sync kernel was the first row
    const double t = time_impl(sets, false, 1500.0, wgmma);
    std::printf("TIME attention %s D=%d Hq=%d Hkv=%d S=%lld pos0=%lld: %.3f ms %.1f TFLOP/s (%.1f%% of 790)\n",
                has_wgmma(s) && wgmma ? "wgmma" : "mma", s.D, s.Hq, s.Hkv, static_cast<long long>(s.S),
                static_cast<long long>(s.pos0), t, flops / t * 1e-9, 100.0 * flops / t * 1e-9 / 790.0);
  }
  std::fflush(stdout);
  for (auto& in : sets) in.release();
}

// One decode step's attention (S = 1) at a long context: a stream of the K/V cache, so reported as bandwidth;
// the CUDA-core kernel (gqa_pack=0's path) and the tensor-core decode kernel (split-K plan as the decode step uses).
static void time_decode(const Shape& s, uint64_t seed) {
  std::vector<Inputs> sets(3);
  for (size_t i = 0; i < sets.size(); ++i) sets[i].alloc(s, 0), sets[i].randomize(seed + 100 * i);
  CK(cudaDeviceSynchronize());
  const double bytes = static_cast<double>(s.pos0 + 1) * s.Hkv * s.D * 2.0 * 2.0;  // K and V, bf16
  const double t_cc = time_impl(sets, false, 300.0), t_tc = time_impl(sets, true, 300.0);
  std::printf("TIME decode attention D=%d Hq=%d Hkv=%d keys=%lld: CUDA cores %.1f us %.2f TB/s | tensor cores %.1f us "
              "%.2f TB/s (%.2fx)\n",
              s.D, s.Hq, s.Hkv, static_cast<long long>(s.pos0 + 1), t_cc * 1e3, bytes / t_cc * 1e-9, t_tc * 1e3,
              bytes / t_tc * 1e-9, t_cc / t_tc);
  std::fflush(stdout);
  for (auto& in : sets) in.release();
}

int main() {
  const auto wall0 = std::chrono::steady_clock::now();
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
  const uint64_t seed = static_cast<uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
  std::printf("check_attention seed=%llu sms=%d tol rel_rms<=%.0e\n", static_cast<unsigned long long>(seed),
              g_sm_count, kTol);

  const std::vector<Case> cases = {
      // real shapes (sampled rows: the fp64 reference of a 128K row costs ~1 GFLOP per KV head)
      {"real_S2048_pos0", {256, 16, 2, 2048, 0}, false, 64},
      {"real_S4096_pos0", {256, 16, 2, 4096, 0}, false, 24},
      {"real_S2048_pos14336", {256, 16, 2, 2048, 14336}, false, 24},
      {"real_S2048_pos129024", {256, 16, 2, 2048, 129024}, false, 8},
      {"real_S5_pos129024_split", {256, 16, 2, 5, 129024}, false, 0},
      {"real_S64_pos4000_split", {256, 16, 2, 64, 4000}, false, 0},
      // awkward shapes
      {"S1_pos0_decodepath", {256, 16, 2, 1, 0}, false, 0},
      {"S1_pos777_decodepath", {256, 16, 2, 1, 777}, false, 0},
      {"S1_pos131071_decodepath", {256, 16, 2, 1, 131071}, false, 0},
      {"S1_pos33_D64_decodepath", {64, 6, 2, 1, 33}, false, 0},
      // the tensor-core decode kernel (shapes it does not take fall back to attn_kernel)
      {"tc_S1_pos0", {256, 16, 2, 1, 0}, true, 0},
      {"tc_S1_pos63", {256, 16, 2, 1, 63}, true, 0},
      {"tc_S1_pos64", {256, 16, 2, 1, 64}, true, 0},
      {"tc_S1_pos777", {256, 16, 2, 1, 777}, true, 0},
      {"tc_S1_pos4100", {256, 16, 2, 1, 4100}, true, 0},
      {"tc_S1_pos131071", {256, 16, 2, 1, 131071}, true, 0},
      {"tc_D128_S1_pos1000", {128, 16, 2, 1, 1000}, true, 0},
      {"tc_D256_Hkv1_S1_pos5000", {256, 8, 1, 1, 5000}, true, 0},
      {"tc_fallback_D64_G3_S1_pos40", {64, 6, 2, 1, 40}, true, 0},
      {"S2_pos0", {256, 16, 2, 2, 0}, false, 0},
      {"S37_pos0", {256, 16, 2, 37, 0}, false, 0},
      {"S300_pos129", {256, 16, 2, 300, 129}, false, 0},
      {"S17_pos3000_split", {256, 16, 2, 17, 3000}, false, 0},
      {"D256_G1_S77", {256, 2, 2, 77, 0}, false, 0},
      {"D256_G8_S333_pos5000", {256, 8, 1, 333, 5000}, false, 0},
      {"D128_G1_S129_pos64", {128, 8, 8, 129, 64}, false, 0},
      {"D128_G1_S1000", {128, 4, 4, 1000, 0}, false, 0},
      {"D128_G8_S200", {128, 16, 2, 200, 0}, false, 0},
      {"D64_G2_S300_pos1000", {64, 4, 2, 300, 1000}, false, 0},
      {"D64_G2_S65_pos31", {64, 2, 1, 65, 31}, false, 0},
      {"D64_G3_S101_pos17", {64, 6, 2, 101, 17}, false, 0},
      {"D128_G5_S70_pos200", {128, 10, 2, 70, 200}, false, 0},
      {"D32_G4_S50_pos10", {32, 4, 1, 50, 10}, false, 0},
  };
  int passed = 0, total = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    ++total;
    if (run_case(cases[i], seed + 7919 * i, true)) ++passed;
    if (has_wgmma(cases[i].s) && !cases[i].tc_decode) {  // the mma.sync twin on the same inputs
      ++total;
      if (run_case(cases[i], seed + 7919 * i, false)) ++passed;
    }
  }
  // Timing only after every check passed (a wrong kernel's speed means nothing).
  if (passed == total) {
    time_shape({256, 16, 2, 2048, 0}, seed);
    time_shape({256, 16, 2, 4096, 0}, seed);  // a 4K prompt's attention layer
    time_shape({256, 16, 2, 2048, 14336}, seed);
    time_shape({256, 16, 2, 2048, 129024}, seed);
    time_shape({256, 16, 2, 8192, 122880}, seed);  // the last 8,192-row chunk of a 128K prompt
    time_shape({256, 16, 2, 16, 129024}, seed);  // a short last chunk at 128K: the split path
    time_decode({256, 16, 2, 1, 4095}, seed);
    time_decode({256, 16, 2, 1, 32767}, seed);
    time_decode({256, 16, 2, 1, 131071}, seed);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  std::printf("wall %.1f s\nSUMMARY attention %d/%d\n", wall, passed, total);
  return passed == total ? 0 : 1;
}
