// build: csrc/cuda/gemv.cu
// The decode GEMV (csrc/cuda/gemv.cuh) against an fp64 host twin: random MLX 4-bit and 8-bit weights (group 64)
// and dense bf16 ones, fresh seed per run, outputs poisoned with NaN first; real and awkward shapes, launches
// that mix formats (the MoE entry: 8-bit router + 4-bit shared gate/up), the greedy head's block argmax, the DeltaNet
// in-projection's conv epilogue; then the
// time per launch at the real decode shapes (weights rotated over several copies so the 60 MB L2 does not hold
// them), as TB/s of weight bytes.
//
// Tolerance: fp32 dequantised weights and fp32 accumulation; the codes enter as 1 + q 2^-p (exact) and the
// constant part is subtracted per 32-element unit, which costs up to ~2^-13 relative per unit (8-bit: 2^-9 of
// sum |x| against ~128 sum |x|), so rel RMS vs fp64 <= 1e-4; dual outputs are rounded to bf16 (rel 2^-8): 8e-3.
#include "check_decode_common.cuh"
#include "tolerances.h"

// --profile: no checks, one launch per timed shape (for ncu: `ncu --kernel-name regex:gemv_kernel ... --profile`)
static int g_warm = 3, g_reps = 60;

// Store / accumulate / dual on one or several segments (bits[s]: 4, 8 or 16 = dense bf16), bf16 input (x staged as
// is); store launches also check the greedy head's block argmax keys.
static void check_proj(const char* tag, int64_t in, std::vector<int64_t> outs, int mode, std::vector<int> bits = {},
                       int group = 64) {
  using namespace lily::cuda::gemv;
  ProjArgs a;
  a.in = static_cast<int32_t>(in);
  a.xmode = kXBf16;
  auto x = rand_x(in);
  bf16* dx = reinterpret_cast<bf16*>(dnew(x));
  a.xb = dx;
  a.nseg = static_cast<int>(outs.size());
  std::vector<QW*> w0, w1;
  std::vector<float*> ys;
  std::vector<uint16_t*> ybs;
  std::vector<std::vector<float>> y0;
  for (int s = 0; s < a.nseg; ++s) {
    const int b = s < static_cast<int>(bits.size()) ? bits[s] : 4;
    w0.push_back(new QW(1, outs[s], in, b, b == 16 ? 64 : group));
    w1.push_back(mode == kODual ? new QW(1, outs[s], in, b, b == 16 ? 64 : group) : w0.back());
    Seg& g = a.seg[s];
    g.w0 = w0[s]->d;
    g.w1 = w1[s]->d;
    g.mode = mode;
    std::vector<float> init(outs[s]);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : init) v = mode == kOAccum ? nd(rng) : NAN;
    y0.push_back(init);
    ys.push_back(dnew(init));
    ybs.push_back(dnew(std::vector<uint16_t>(outs[s], 0xFFFF)));
    g.y = ys[s];
    g.yb = reinterpret_cast<bf16*>(ybs[s]);
  }
  int64_t total = 0;
  for (int64_t o : outs) total += o;
  unsigned long long* damax = dnew(std::vector<unsigned long long>(head_blocks(total), ~0ull));
  const bool head = mode == kOStore && a.nseg == 1;  // the greedy head: one segment, keys over its rows
  if (head) a.amax = damax;
  const unsigned nb = proj(0, a);
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  if (head) {  // the largest key over the blocks names the largest output (ties: the lowest row)
    auto keys = dget(damax, nb);
    unsigned long long m = 0;
    for (auto k : keys) m = std::max(m, k);
    double best = -1e300;
    int64_t best_row = -1;
    auto y = dget(ys[0], outs[0]);
    for (int64_t r = 0; r < outs[0]; ++r)
      if (y[r] > best) best = y[r], best_row = r;
    const int64_t got_row = 0xFFFFFFFFll - static_cast<int64_t>(m & 0xFFFFFFFFull);
    ++n_total;
    const bool ok = got_row == best_row && nb <= head_blocks(total);
    n_pass += ok;
    std::printf("%s %-44s argmax row %lld (host %lld), %u blocks\n", ok ? "PASS" : "FAIL", tag,
                static_cast<long long>(got_row), static_cast<long long>(best_row), nb);
  }
  for (int s = 0; s < a.nseg; ++s) {
    std::vector<double> ref(outs[s]), got(outs[s]);
    if (mode == kODual) {
      auto yb = dget(ybs[s], outs[s]);
      for (int64_t r = 0; r < outs[s]; ++r) {
        const double g = w0[s]->dot(0, r, x), u = w1[s]->dot(0, r, x);
        ref[r] = silu_d(g) * u;
        got[r] = host_float(yb[r]);
      }
    } else {
      auto y = dget(ys[s], outs[s]);
      for (int64_t r = 0; r < outs[s]; ++r) {
        ref[r] = w0[s]->dot(0, r, x) + (mode == kOAccum ? y0[s][r] : 0.0);
        got[r] = y[r];
      }
    }
    char name[160], grp[16] = "";
    if (w0[s]->bits != 16 && w0[s]->group != 64) std::snprintf(grp, sizeof grp, " g%d", w0[s]->group);
    std::snprintf(name, sizeof name, "%s %d-bit%s in=%lld out=%lld seg%d/%d", tag, w0[s]->bits, grp,
                  static_cast<long long>(in), static_cast<long long>(outs[s]), s, a.nseg);
    report(name, ref, got, mode == kODual ? tolerances::gemv_dual_rel_rms : tolerances::gemv_rel_rms);
  }
}

// The DeltaNet in-projection's conv epilogue (mode kOConv, segment 0), beside a plain store segment as in the step:
// u[c] = SiLU(sum_j<K-1 w[c, j] state[j, c] + w[c, K-1] y[c]) with y = W x, and the state shifted by one row with y
// as its newest (K-1 rows of C channels). The twin is fp64; the shifted rows must be bit-exact copies, the new row
// and u within the GEMV tolerance. Outputs and the state's new row are poisoned first.
static void check_conv(int64_t in, int64_t C, int K, int64_t other) {
  using namespace lily::cuda::gemv;
  std::normal_distribution<float> nd(0.f, 1.f);
  QW w(1, C, in), wz(1, other, in);
  auto x = rand_x(in);
  std::vector<float> cw(C * K), st((K - 1) * C);
  for (auto& v : cw) v = 0.5f * nd(rng);
  for (auto& v : st) v = nd(rng);
  ProjArgs a;
  a.in = static_cast<int32_t>(in);
  a.xmode = kXBf16;
  a.xb = reinterpret_cast<bf16*>(dnew(x));
  a.nseg = 2;
  a.seg[0].w0 = a.seg[0].w1 = w.d, a.seg[0].mode = kOConv;
  float* dz = dnew(std::vector<float>(other, NAN));
  a.seg[1].w0 = a.seg[1].w1 = wz.d, a.seg[1].mode = kOStore, a.seg[1].y = dz;
  float* dst = dnew(st);
  float* du = dnew(std::vector<float>(C, NAN));
  a.conv_w = dnew(cw), a.conv_state = dst, a.u = du;
  a.conv_dim = static_cast<int32_t>(C), a.conv_k = K;
  proj(0, a);
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  const auto u = dget(du, C), st1 = dget(dst, (K - 1) * C), z = dget(dz, other);
  std::vector<double> ru(C), gu(C), rn(C), gn(C), rz(other), gz(other);
  int64_t moved = 0, wrong = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double y = w.dot(0, c, x);
    double cv = cw[c * K + K - 1] * y;
    for (int j = 0; j < K - 1; ++j) cv += static_cast<double>(cw[c * K + j]) * st[j * C + c];
    ru[c] = silu_d(cv), gu[c] = u[c];
    for (int r = 0; r + 1 < K - 1; ++r, ++moved) wrong += st1[r * C + c] != st[(r + 1) * C + c];
    rn[c] = y, gn[c] = st1[(K - 2) * C + c];
  }
  for (int64_t r = 0; r < other; ++r) rz[r] = wz.dot(0, r, x), gz[r] = z[r];
  char name[160];
  std::snprintf(name, sizeof name, "conv u in=%lld C=%lld K=%d", static_cast<long long>(in), static_cast<long long>(C), K);
  report(name, ru, gu, tolerances::gemv_rel_rms);
  std::snprintf(name, sizeof name, "conv state's new row C=%lld K=%d", static_cast<long long>(C), K);
  report(name, rn, gn, tolerances::gemv_rel_rms);
  std::snprintf(name, sizeof name, "conv's neighbour store out=%lld", static_cast<long long>(other));
  report(name, rz, gz, tolerances::gemv_rel_rms);
  ++n_total;
  n_pass += wrong == 0;
  std::printf("%s conv state rows shifted C=%lld K=%d: %lld of %lld moved entries differ\n", wrong ? "FAIL" : "PASS",
              static_cast<long long>(C), K, static_cast<long long>(wrong), static_cast<long long>(moved));
}

// The producer's normalisation staged in the launch (RMSNorm of the fp32 residual, its bf16 copy h_out from block 0)
// and the routing prologue (softmax top-k of E router
// logits, optional renormalisation; the segment's k slots read the chosen experts, block 0 writes the routing).
// The twin normalises in fp64 and rounds to bf16 as the kernel does; the routing is checked as ids (exact) and
// weights, the outputs as in check_proj.
struct StageSpec {
  int xmode;            // kXBf16 or kXNorm
  int E = 0, k = 0;     // routing prologue when k > 0: E experts, top k (the one segment is routed over k slots)
  bool norm_topk = true;
};
static void check_staged(const char* tag, const StageSpec& sp, int64_t in, int64_t out, int mode) {
  using namespace lily::cuda::gemv;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  const float eps = 1e-6f;
  std::vector<float> xf(in), nw(in);
  for (auto& v : xf) v = 3.f * nd(rng);
  for (auto& v : nw) v = u(rng);
  // the staged row as the kernel rounds it: bf16(x * inv * w); a bf16 staging reads it as is
  std::vector<uint16_t> xs(in);
  if (sp.xmode == kXBf16) {
    xs = rand_x(in);
  } else if (sp.xmode == kXNorm) {
    double ss = 0;
    for (float v : xf) ss += static_cast<double>(v) * v;
    const double inv = 1 / std::sqrt(ss / static_cast<double>(in) + eps);
    for (int64_t i = 0; i < in; ++i) xs[i] = host_bf16(static_cast<float>(xf[i] * inv * nw[i]));
  }
  const int E = sp.k > 0 ? sp.E : 1, slots = sp.k > 0 ? sp.k : 1;
  QW w0(E, out, in), *w1 = mode == kODual ? new QW(E, out, in) : &w0;
  ProjArgs a;
  a.in = static_cast<int32_t>(in);
  a.xmode = sp.xmode;
  a.eps = eps;
  a.xb = reinterpret_cast<bf16*>(dnew(xs));
  a.xf = dnew(xf);
  a.nw = dnew(nw);
  uint16_t* dh = dnew(std::vector<uint16_t>(in, 0xFFFF));
  if (sp.xmode == kXNorm) a.h_out = reinterpret_cast<bf16*>(dh);
  std::vector<float> logits(E);
  std::vector<int32_t> idx(slots, 0);
  std::vector<double> tw(slots, 1.0);
  int32_t* didx = dnew(std::vector<int32_t>(slots, -1));
  float* dtw = dnew(std::vector<float>(slots, NAN));
  if (sp.k > 0) {
    for (auto& v : logits) v = 2.f * nd(rng);
    a.route = 1, a.rlogits = dnew(logits), a.E = E, a.top_k = sp.k, a.norm_topk = sp.norm_topk ? 1 : 0;
    a.top_idx = didx, a.top_w = dtw;
    double mx = -1e300, den = 0, chosen = 0;
    for (float v : logits) mx = std::max(mx, static_cast<double>(v));
    std::vector<double> p(E);
    for (int e = 0; e < E; ++e) den += p[e] = std::exp(logits[e] - mx);
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int i, int j) { return p[i] > p[j]; });
    for (int j = 0; j < sp.k; ++j) idx[j] = order[j], tw[j] = p[order[j]] / den, chosen += tw[j];
    if (sp.norm_topk)
      for (auto& v : tw) v /= chosen;
  }
  std::vector<float> y0(slots * out);
  for (auto& v : y0) v = mode == kOAccum ? nd(rng) : NAN;
  float* dy = dnew(y0);
  uint16_t* dyb = dnew(std::vector<uint16_t>(slots * out, 0xFFFF));
  a.nseg = 1;
  Seg& g = a.seg[0];
  g.w0 = w0.d, g.w1 = w1->d, g.mode = mode, g.y = dy, g.yb = reinterpret_cast<bf16*>(dyb);
  if (sp.k > 0) g.routed = 1, g.slots = slots, g.y_step = out;
  proj(0, a);
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  char name[160];
  if (sp.xmode == kXNorm) {  // block 0's bf16 copy of the normed row, per element within one rounding
    auto h = dget(dh, in);
    std::vector<double> ref(in), got(in);
    for (int64_t i = 0; i < in; ++i) ref[i] = host_float(xs[i]), got[i] = host_float(h[i]);
    std::snprintf(name, sizeof name, "%s h_out in=%lld", tag, static_cast<long long>(in));
    report(name, ref, got, tolerances::small_bf16_rel_rms);
  }
  if (sp.k > 0) {
    auto gi = dget(didx, slots);
    auto gw = dget(dtw, slots);
    std::vector<double> ref(tw), got(slots);
    bool ids = true;
    for (int j = 0; j < slots; ++j) ids = ids && gi[j] == idx[j], got[j] = gw[j];
    ++n_total;
    n_pass += ids;
    std::printf("%s %-44s ids %d %d %d ... (host %d %d %d ...)\n", ids ? "PASS" : "FAIL", tag, gi[0], gi[1 % slots],
                gi[2 % slots], idx[0], idx[1 % slots], idx[2 % slots]);
    std::snprintf(name, sizeof name, "%s routing weights E=%d k=%d", tag, E, sp.k);
    report(name, ref, got, tolerances::small_fp32_rel_rms);
  }
  std::vector<double> ref(slots * out), got(slots * out);
  auto y = dget(dy, slots * out);
  auto yb = dget(dyb, slots * out);
  for (int j = 0; j < slots; ++j)
    for (int64_t r = 0; r < out; ++r) {
      const int64_t o = j * out + r;
      const double d0 = w0.dot(idx[j], r, xs);
      if (mode == kODual) {
        ref[o] = silu_d(d0) * w1->dot(idx[j], r, xs);
        got[o] = host_float(yb[o]);
      } else {
        ref[o] = d0 + (mode == kOAccum ? y0[o] : 0.0);
        got[o] = y[o];
      }
    }
  std::snprintf(name, sizeof name, "%s in=%lld out=%lld x%d", tag, static_cast<long long>(in),
                static_cast<long long>(out), slots);
  report(name, ref, got, mode == kODual ? tolerances::gemv_dual_rel_rms : tolerances::gemv_staged_rel_rms);
}

// Routed experts' down + shared down + combine into the residual.
static void check_down(int64_t H, int64_t I, int k, int E, int bits = 4, int64_t Is = 0) {
  using namespace lily::cuda::gemv;
  if (Is == 0) Is = I;
  QW wd(E, H, I, bits), ws(1, H, Is, bits);
  auto act = rand_x(k * I), sact = rand_x(Is);
  std::vector<int32_t> idx(k);
  std::vector<float> tw(k), x0(H), sg{0.3f};
  std::vector<int> perm(E);
  for (int i = 0; i < E; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int j = 0; j < k; ++j) idx[j] = perm[j % E], tw[j] = u(rng);
  for (auto& v : x0) v = nd(rng);
  DownArgs a;
  a.wd = wd.d;
  a.ws = ws.d;
  a.act = reinterpret_cast<bf16*>(dnew(act));
  a.sact = reinterpret_cast<bf16*>(dnew(sact));
  a.top_idx = dnew(idx);
  a.top_w = dnew(tw);
  a.sgate = dnew(sg);
  float* dx = dnew(x0);
  a.x = dx;
  a.k = k;
  moe_down(0, a);
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  auto y = dget(dx, H);
  std::vector<double> ref(H), got(H);
  const double gate = 1 / (1 + std::exp(-static_cast<double>(sg[0])));
  for (int64_t r = 0; r < H; ++r) {
    double s = x0[r];
    for (int j = 0; j < k; ++j) s += tw[j] * wd.dot(idx[j], r, act, j * I);
    s += gate * ws.dot(0, r, sact);
    ref[r] = s;
    got[r] = y[r];
  }
  char name[160];
  std::snprintf(name, sizeof name, "down %d-bit H=%lld I=%lld Is=%lld k=%d E=%d", bits, static_cast<long long>(H),
                static_cast<long long>(I), static_cast<long long>(Is), k, E);
  report(name, ref, got, tolerances::gemv_rel_rms);
}

// Mean ms per call of launch(i) over `reps` back-to-back calls, after `warm` untimed ones (stream 0).
template <class F>
static double ms_per_launch(int warm, int reps, F&& launch) {
  for (int i = 0; i < warm; ++i) launch(i);
  cudaEvent_t e0, e1;
  LILY_CUDA_CHECK(cudaEventCreate(&e0));
  LILY_CUDA_CHECK(cudaEventCreate(&e1));
  LILY_CUDA_CHECK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) launch(i);
  LILY_CUDA_CHECK(cudaEventRecord(e1));
  LILY_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  LILY_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  LILY_CUDA_CHECK(cudaEventDestroy(e0));
  LILY_CUDA_CHECK(cudaEventDestroy(e1));
  return ms / reps;
}

// An RMSNorm staging past kMaxNormIn elements (5 slices: one fetch per thread no longer covers the row) must be
// refused with an invalid_argument, not launched.
static void check_norm_refused(int64_t in) {
  using namespace lily::cuda::gemv;
  QW w(1, 8, in);
  ProjArgs a;
  a.in = static_cast<int32_t>(in);
  a.xmode = kXNorm;
  a.eps = 1e-6f;
  a.xf = dnew(std::vector<float>(in, 1.f));
  a.nw = dnew(std::vector<float>(in, 1.f));
  a.nseg = 1;
  a.seg[0].w0 = a.seg[0].w1 = w.d;
  a.seg[0].mode = kOStore;
  a.seg[0].y = dnew(std::vector<float>(8, 0.f));
  bool refused = false;
  try {
    proj(0, a);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  ++n_total;
  n_pass += refused;
  std::printf("%s rmsnorm staging of %lld elements refused\n", refused ? "PASS" : "FAIL", static_cast<long long>(in));
}

// Time per launch of proj over `copies` weight copies of shape outs x in (mean of g_reps back-to-back launches),
// with the bf16 staging or, xmode kXNorm, the step's RMSNorm.
static double time_proj(const char* tag, int64_t in, std::vector<int64_t> outs, int mode, int copies,
                        int xmode = lily::cuda::gemv::kXBf16) {
  using namespace lily::cuda::gemv;
  std::vector<ProjArgs> args(copies);
  auto x = rand_x(in);
  bf16* dx = reinterpret_cast<bf16*>(dnew(x));
  std::vector<float> xf(in), nw(in, 1.f);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : xf) v = nd(rng);
  float* dxf = dnew(xf);
  float* dnw = dnew(nw);
  double bytes = 0;
  for (int c = 0; c < copies; ++c) {
    ProjArgs& a = args[c];
    a.in = static_cast<int32_t>(in);
    a.xmode = xmode;
    a.xb = dx;
    a.xf = dxf;
    a.nw = dnw;
    a.eps = 1e-6f;
    a.nseg = static_cast<int>(outs.size());
    for (int s = 0; s < a.nseg; ++s) {
      QW* w = new QW(1, outs[s], in);
      QW* w1 = mode == kODual ? new QW(1, outs[s], in) : w;
      a.seg[s].w0 = w->d;
      a.seg[s].w1 = w1->d;
      a.seg[s].mode = mode;
      a.seg[s].y = dnew(std::vector<float>(outs[s], 0.f));
      a.seg[s].yb = reinterpret_cast<bf16*>(dnew(std::vector<uint16_t>(outs[s], 0)));
      if (c == 0) bytes += (mode == kODual ? 2.0 : 1.0) * outs[s] * in * (0.5 + 4.0 / 64);
    }
  }
  // every decode launch carries the PDL attribute (as in the step): back-to-back launches overlap their tails
  const double ms = ms_per_launch(g_warm, g_reps, [&](int i) { proj(0, args[i % copies]); });
  std::printf("TIME proj %-30s %6.1f MB | %6.2f us %.2f TB/s\n", tag, bytes / 1e6, ms * 1e3, bytes / ms / 1e9);
  return ms;
}

// 4-bit weights with a group under 64 are refused (the tensor-core tile sums 64 elements under one scale); the
// engine then takes its unfused decode path.
static void check_group32_refused() {
  QW w(1, 8, 256, 4, 32), w8(1, 8, 256, 8, 32);
  const bool ok = !lily::cuda::gemv::fits(w.d) && lily::cuda::gemv::fits(w8.d);
  ++n_total;
  n_pass += ok;
  std::printf("%s %-44s\n", ok ? "PASS" : "FAIL", "fits: 4-bit group 32 refused, 8-bit group 32 taken");
}

// The fixed cost of one launch: the DeltaNet in-projection's input (2048) at 128 .. 12,352 output rows, each timed
// over enough weight copies to exceed the L2, and a least-squares line t = a + bytes / B through the points
// (a: the launch's start and tail, B: the streaming rate inside it).
static void time_fixed_cost() {
  const int64_t rows[] = {128, 512, 2048, 4096, 8192, 12352};
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int n = 0;
  for (int64_t r : rows) {
    const double mb = r * 2048 * (0.5 + 4.0 / 64) / 1e6;
    const int copies = static_cast<int>(std::max(2.0, std::ceil(240.0 / mb)));
    char tag[64];
    std::snprintf(tag, sizeof tag, "fixed cost, %lld rows", static_cast<long long>(r));
    const double us = time_proj(tag, 2048, {r}, lily::cuda::gemv::kOStore, copies) * 1e3;
    sx += mb, sy += us, sxx += mb * mb, sxy += mb * us, ++n;
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx), icpt = (sy - slope * sx) / n;
  std::printf("TIME fixed cost per launch %.2f us + bytes at %.2f TB/s (fit over %d shapes)\n", icpt, 1.0 / slope, n);
}

// Calibration: a plain streaming read of n uint4 (8 independent 16-byte loads per thread in flight).
__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* out) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) acc ^= __ldg(p + i).x;
  if (acc == 0x12345678u) out[0] = acc;
}

static void time_read(int64_t bytes) {
  uint4* p = nullptr;
  uint32_t* o = nullptr;
  LILY_CUDA_CHECK(cudaMalloc(&p, bytes));
  LILY_CUDA_CHECK(cudaMalloc(&o, 4));
  LILY_CUDA_CHECK(cudaMemset(p, 0x5A, bytes));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int bps : {4, 8, 16}) {
    const int64_t n = bytes / 16;
    const double ms = ms_per_launch(1, 10, [&](int) { read_kernel<<<sms * bps, 256>>>(p, n, o); });
    std::printf("TIME read %.0f MB, %d blocks/SM: %.2f TB/s\n", bytes / 1e6, bps, bytes / ms / 1e9);
  }
  cudaFree(p);
  cudaFree(o);
}

// Time per launch of the MoE down (8 routed experts of 256 + shared) over rotated expert ids, three paths.
static void time_down() {
  using namespace lily::cuda::gemv;
  const int64_t H = 2048, I = 512;
  const int k = 8, E = 256, copies = 8;
  QW wd(E, H, I), ws(1, H, I);
  std::vector<DownArgs> args(copies);
  auto act = rand_x(k * I), sact = rand_x(I);
  bf16* dact = reinterpret_cast<bf16*>(dnew(act));
  bf16* dsact = reinterpret_cast<bf16*>(dnew(sact));
  float* x = dnew(std::vector<float>(H, 0.f));
  float* sg = dnew(std::vector<float>{0.1f});
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> idx(k);
    for (int j = 0; j < k; ++j) idx[j] = (c * k + j) * 3 % E;
    std::vector<float> tw(k, 0.1f);
    DownArgs& a = args[c];
    a.wd = wd.d, a.ws = ws.d, a.act = dact, a.sact = dsact, a.top_idx = dnew(idx), a.top_w = dnew(tw), a.sgate = sg;
    a.x = x, a.k = k;
  }
  const double bytes = (k + 1) * H * I * (0.5 + 4.0 / 64);
  const double ms = ms_per_launch(g_warm, g_reps, [&](int i) { moe_down(0, args[i % copies]); });
  std::printf("TIME down 8+1 experts              %6.1f MB | %6.2f us %.2f TB/s\n", bytes / 1e6, ms * 1e3,
              bytes / ms / 1e9);
}

int main(int argc, char** argv) {
  using namespace lily::cuda::gemv;
  const bool profile = argc > 1 && std::strcmp(argv[1], "--profile") == 0;
  if (profile) g_warm = 0, g_reps = 1;
  int dev = 0;
  cudaDeviceProp prop;
  LILY_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  if (!profile) {
    check_proj("store", 2048, {8192, 4096, 32, 32}, kOStore);
    check_proj("store", 64, {1, 17}, kOStore);
    check_proj("store", 192, {33}, kOStore);
    check_proj("accum", 4096, {2048}, kOAccum);
    check_proj("accum", 576, {5}, kOAccum);
    check_proj("dual", 2048, {512}, kODual);
    check_proj("dual", 128, {7, 16}, kODual);
    check_proj("store", 512, {1, 17, 40}, kOStore);
    check_proj("dual", 1024, {3, 40}, kODual);
    check_proj("accum", 1536, {31}, kOAccum);
    check_proj("store", 2048, {256, 1}, kOStore, {8, 8});            // router + shared-expert gate (8-bit)
    check_proj("store", 2048, {256}, kOStore, {8});
    check_proj("store", 2048, {256, 512, 1}, kOStore, {8, 4, 8});    // the MoE entry's mix of formats
    check_proj("store", 128, {5, 3}, kOStore, {8, 16});
    check_proj("store", 160, {128, 7}, kOStore, {16, 16});           // dense (in not a multiple of 64)
    check_proj("accum", 96, {128}, kOAccum, {16});
    check_proj("dual", 96, {9}, kODual, {16});
    check_proj("store", 8192, {33}, kOStore);                        // the longest input: 8 slices
    check_proj("store", 2048, {248320 / 16 + 3}, kOStore);           // a head-like launch: many tiles per warp
    check_proj("store", 2048, {300, 7}, kOStore, {4, 4}, 128);       // groups of 128 (two lanes' groups share one)
    check_proj("dual", 256, {9}, kODual, {}, 128);
    check_proj("store", 1024, {33, 5}, kOStore, {4, 8}, 256);      // groups of 256, 4- and 8-bit
    check_group32_refused();
    check_staged("rmsnorm store", {kXNorm}, 2048, 8192 + 4096 + 64, kOStore);         // the DeltaNet in-proj's staging
    check_staged("rmsnorm store", {kXNorm}, 192, 33, kOStore);
    check_staged("rmsnorm store", {kXNorm}, 4096, 300, kOStore);   // the longest RMSNorm row: 4 slices, 256 threads
    check_staged("rmsnorm store", {kXNorm}, 2560, 77, kOStore);    // 3 slices, 192 threads: two fetches a thread
    check_norm_refused(4128);
    check_conv(2048, 8192, 4, 4096 + 64);                           // the DeltaNet in-projection's qkv + z/b/a
    check_conv(64, 33, 4, 5);
    check_conv(192, 7, 2, 1);                                         // one state row
    check_conv(128, 40, 3, 9);
    check_staged("routed dual", {kXBf16, 256, 8, true}, 2048, 512, kODual);         // the experts' gate/up
    check_staged("routed dual", {kXBf16, 5, 3, false}, 128, 9, kODual);
    check_staged("rmsnorm routed dual", {kXNorm, 64, 4, true}, 512, 40, kODual);
    check_down(2048, 512, 8, 256);
    check_down(96, 128, 3, 5);
    check_down(17, 64, 1, 1);
    check_down(40, 512, 3, 7);
    check_down(128, 96, 3, 3, 16, 160);                              // tiny_odd's dense experts
    check_down(64, 128, 2, 4, 8);
  }
  // Real decode shapes; copies so the rotated weights exceed the L2.
  time_proj("dn in-proj qkv+z+b+a", 2048, {8192, 4096, 32, 32}, kOStore, 8);
  time_proj("dn out-proj (accum)", 4096, {2048}, kOAccum, 24);
  time_proj("shared gate/up (dual)", 2048, {512}, kODual, 64);
  time_proj("expert gate/up x8 (dual)", 2048, {4096}, kODual, 16);
  time_proj("lm_head 248320", 2048, {248320}, kOStore, 2);
  time_proj("attn q+k+v", 2048, {8192, 512, 512}, kOStore, 8);
  time_proj("dn in-proj, RMSNorm staging", 2048, {8192, 4096, 32, 32}, kOStore, 8, kXNorm);
  time_proj("shared gate/up, RMSNorm", 2048, {512}, kODual, 64, kXNorm);
  time_down();
  if (profile) return 0;
  time_fixed_cost();
  time_read(286LL << 20);
  time_read(14LL << 20);
  std::printf("SUMMARY decode_gemv %d/%d\n", n_pass, n_total);
  return n_pass == n_total ? 0 : 1;
}
