// build: csrc/cuda/gemv.cu csrc/cuda/gemv_rows.cu csrc/cuda/gemv_rows_combine.cu
// The M-row decode GEMV (gemv_rows.cuh) against the one-row decode GEMV (gemv.cuh) on the same weights: time per
// launch (the mean of 60 back-to-back launches with PDL, over weight copies that exceed the L2) at M = 1, 2, 4, 8 input
// rows, and the ratio to the one-row kernel's single row. Correctness: tests/kernels/test_cuda_gemv_rows.py.
// Usage: time_decode_rows [--once]
#include <cmath>
#include <functional>

#include "cuda/gemv.cuh"
#include "cuda/gemv_rows.cuh"
#include "timing.cuh"

using namespace timing;
namespace g = lily::cuda::gemv;
namespace r = lily::cuda::rows;

namespace {

// Times the one-row launch, then the M-row one at M = 1, 2, 4, 8 (set_rows(M) before each), and prints the TIME lines.
void report(const char* tag, double bytes, const std::function<void(int)>& one_row,
            const std::function<void(int)>& set_rows, const std::function<void(int)>& rows) {
  const double base = mean_ms(one_row);
  if (g_once) std::printf("ONCE proj %s\n", tag);
  else std::printf("TIME %-30s %6.1f MB | one-row gemv   %6.2f us %.2f TB/s\n", tag, bytes / 1e6, base * 1e3, bytes / base / 1e9);
  for (int M : {1, 2, 4, 8}) {
    set_rows(M);
    const double ms = mean_ms(rows);
    if (g_once) std::printf("ONCE rows %s M=%d\n", tag, M);
    else std::printf("TIME %-30s %6.1f MB | rows M=%d       %6.2f us %.2f TB/s  %.3fx one-row\n", tag, bytes / 1e6, M,
                     ms * 1e3, bytes / ms / 1e9, ms / base);
  }
}

// conv: segment 0 is the DeltaNet in-projection's conv epilogue (4 taps over its rows as channels), as in the step.
void time_shape(const char* tag, int64_t in, std::vector<int64_t> outs, int mode, int copies, int xmode,
                bool conv = false) {
  constexpr int kM = 8;
  std::vector<DevWeight> ws;
  std::vector<void*> bufs;
  bf16* x = drandom<bf16>(kM * in, 1);
  float* xf = drandom<float>(kM * in, 2);
  float* nw = drandom<float>(in, 3, 0.5f, 1.5f);
  std::vector<g::ProjArgs> one(copies);
  std::vector<r::Args> many(copies);
  double bytes = 0;
  for (int c = 0; c < copies; ++c) {
    g::ProjArgs& a = one[c];
    r::Args& b = many[c];
    a.in = b.in = static_cast<int32_t>(in);
    a.xmode = b.xmode = xmode;
    a.xb = b.xb = x, a.xf = b.xf = xf, a.nw = b.nw = nw, a.eps = b.eps = 1e-6f;
    b.ldx = in;
    a.nseg = b.nseg = static_cast<int>(outs.size());
    for (int s = 0; s < a.nseg; ++s) {
      ws.emplace_back();
      ws.back().make(4, 1, outs[s], in, 100 * c + 10 * s);
      a.seg[s].w0 = a.seg[s].w1 = b.seg[s].w0 = b.seg[s].w1 = ws.back().d;
      if (mode == g::kODual) {
        ws.emplace_back();
        ws.back().make(4, 1, outs[s], in, 100 * c + 10 * s + 5);
        a.seg[s].w1 = b.seg[s].w1 = ws.back().d;
      }
      a.seg[s].mode = b.seg[s].mode = mode;  // (store, accumulate and dual share their numbers in both enums)
      float* y = dalloc<float>(kM * outs[s]);
      bf16* yb = dalloc<bf16>(kM * outs[s]);
      CK(cudaMemset(y, 0, kM * outs[s] * sizeof(float)));
      a.seg[s].y = b.seg[s].y = y, a.seg[s].yb = b.seg[s].yb = yb, b.seg[s].ldy = outs[s];
      bufs.push_back(y), bufs.push_back(yb);
      if (c == 0) bytes += (mode == g::kODual ? 2.0 : 1.0) * outs[s] * in * (0.5 + 4.0 / 64);
    }
    if (conv) {
      constexpr int K = 4;
      const int64_t C = outs[0];
      float* cw = drandom<float>(C * K, 100 * c + 7);
      float* cs = dalloc<float>((K - 1) * C);
      float* u = dalloc<float>(kM * C);
      float* hist = dalloc<float>((K - 1 + kM) * C);
      CK(cudaMemset(cs, 0, (K - 1) * C * sizeof(float)));
      bufs.push_back(cw), bufs.push_back(cs), bufs.push_back(u), bufs.push_back(hist);
      a.seg[0].mode = g::kOConv, b.seg[0].mode = r::kOConv;
      a.conv_w = b.conv_w = cw, a.conv_state = b.conv_state = cs, a.u = b.u = u, b.conv_hist = hist;
      a.conv_dim = static_cast<int32_t>(C), a.conv_k = b.conv_k = K;
    }
  }
  report(tag, bytes, [&](int i) { g::proj(nullptr, one[i % copies]); }, [&](int M) { for (auto& b : many) b.rows = M; },
         [&](int i) { r::proj(nullptr, many[i % copies]); });
  for (auto& w : ws) w.free_all();
  for (void* p : bufs) cudaFree(p);
  cudaFree(x), cudaFree(xf), cudaFree(nw);
}

// The experts' gate/up (routed dual, the model's 256 experts of 8 over 2048 -> 512): one-row routing prologue launch
// against the M-row launch, each row's router logits random (so the rows' experts are nearly independent: M = 8 reads
// ~7x the experts of M = 1; the MB column is one row's 8 experts).
void time_routed(int copies) {
  constexpr int kM = 8, E = 256, k = 8, in = 2048, I = 512;
  bf16* x = drandom<bf16>(kM * in, 11);
  float* logits = drandom<float>(kM * E, 12, -2.f, 2.f);
  int32_t* idx = dalloc<int32_t>(kM * k);
  float* w = dalloc<float>(kM * k);
  bf16* act = dalloc<bf16>(kM * k * I);
  std::vector<DevWeight> ws(2 * copies);
  std::vector<g::ProjArgs> one(copies);
  std::vector<r::Args> many(copies);
  for (int c = 0; c < copies; ++c) {
    ws[2 * c].make(4, E, I, in, 1000 + 10 * c);
    ws[2 * c + 1].make(4, E, I, in, 1005 + 10 * c);
    g::ProjArgs& a = one[c];
    a.nseg = 1, a.xmode = g::kXBf16, a.in = in, a.xb = x, a.route = 1, a.rlogits = logits, a.E = E, a.top_k = k;
    a.norm_topk = 1, a.top_idx = idx, a.top_w = w;
    a.seg[0].w0 = ws[2 * c].d, a.seg[0].w1 = ws[2 * c + 1].d, a.seg[0].mode = g::kODual, a.seg[0].routed = 1;
    a.seg[0].slots = k, a.seg[0].y_step = I, a.seg[0].yb = act;
    r::Args& b = many[c];
    b.nseg = 1, b.xmode = r::kXBf16, b.in = in, b.xb = x, b.ldx = in, b.rlogits = logits, b.E = E, b.top_k = k;
    b.norm_topk = 1, b.top_idx = idx, b.top_w = w;
    b.seg[0].w0 = ws[2 * c].d, b.seg[0].w1 = ws[2 * c + 1].d, b.seg[0].mode = r::kODual, b.seg[0].routed = 1;
    b.seg[0].yb = act, b.seg[0].ldy = I;
  }
  const char* tag = "experts gate/up (routed)";
  const double bytes = 2.0 * k * I * in * (0.5 + 4.0 / 64);
  report(tag, bytes, [&](int i) { g::proj(nullptr, one[i % copies]); }, [&](int M) { for (auto& b : many) b.rows = M; },
         [&](int i) { r::proj(nullptr, many[i % copies]); });
  for (auto& d : ws) d.free_all();
  cudaFree(x), cudaFree(logits), cudaFree(idx), cudaFree(w), cudaFree(act);
}

// The experts' down + the shared expert's + the combine (the model's 8 of 256 experts, 512 -> 2048): the one-row
// K-concatenated moe_down against the M-row down launch plus rows::moe_combine, each row's routing random.
void time_routed_down(int copies) {
  constexpr int kM = 8, E = 256, k = 8, H = 2048, I = 512;
  bf16* act = drandom<bf16>(kM * k * I, 21);
  bf16* sact = drandom<bf16>(kM * I, 22);
  float* sgate = drandom<float>(kM, 23);
  float* w = drandom<float>(kM * k, 24, 0.f, 0.25f);
  float* x = drandom<float>(kM * H, 25);
  float* yx = dalloc<float>(kM * k * H);
  float* ysh = dalloc<float>(kM * H);
  std::vector<int32_t> ids_h(kM * k);
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < k; ++j) ids_h[m * k + j] = (37 * m + 29 * j + 11 * m * j) % E;  // distinct within a row
  int32_t* idx = dalloc<int32_t>(kM * k);
  CK(cudaMemcpy(idx, ids_h.data(), ids_h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  std::vector<DevWeight> ws(2 * copies);
  std::vector<g::DownArgs> one(copies);
  std::vector<r::Args> many(copies);
  for (int c = 0; c < copies; ++c) {
    ws[2 * c].make(4, E, H, I, 2000 + 10 * c);
    ws[2 * c + 1].make(4, 1, H, I, 2005 + 10 * c);
    g::DownArgs& a = one[c];
    a.wd = ws[2 * c].d, a.ws = ws[2 * c + 1].d, a.act = act, a.sact = sact, a.top_idx = idx, a.top_w = w;
    a.sgate = sgate, a.x = x, a.k = k;
    r::Args& b = many[c];
    b.nseg = 2, b.xmode = r::kXBf16, b.in = I, b.ldx = I, b.E = E, b.top_k = k, b.top_idx = idx;
    b.route_from_idx = 1;
    b.seg[0].w0 = b.seg[0].w1 = ws[2 * c].d, b.seg[0].mode = r::kOStore, b.seg[0].routed = 1, b.seg[0].xrouted = 1;
    b.seg[0].xb = act, b.seg[0].ldx = I, b.seg[0].y = yx, b.seg[0].ldy = H;
    b.seg[1].w0 = b.seg[1].w1 = ws[2 * c + 1].d, b.seg[1].mode = r::kOStore, b.seg[1].xb = sact, b.seg[1].ldx = I;
    b.seg[1].y = ysh, b.seg[1].ldy = H;
  }
  r::CombineArgs cb;
  cb.yx = yx, cb.ysh = ysh, cb.top_w = w, cb.sgate = sgate, cb.x = x, cb.k = k, cb.H = H;
  const char* tag = "experts down + shared + combine";
  const double bytes = 9.0 * H * I * (0.5 + 4.0 / 64);
  report(
      tag, bytes, [&](int i) { g::moe_down(nullptr, one[i % copies]); },
      [&](int M) {
        for (auto& b : many) b.rows = M;
        cb.M = M;
      },
      [&](int i) {
        r::proj(nullptr, many[i % copies]);
        r::moe_combine(nullptr, cb);
      });
  for (auto& d : ws) d.free_all();
  cudaFree(act), cudaFree(sact), cudaFree(sgate), cudaFree(w), cudaFree(x), cudaFree(yx), cudaFree(ysh), cudaFree(idx);
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_decode_rows");
  time_shape("dn in-proj, RMSNorm", 2048, {8192, 4096, 32, 32}, g::kOStore, 8, g::kXNorm);
  time_shape("dn out-proj (accum)", 4096, {2048}, g::kOAccum, 24, g::kXBf16);
  time_shape("attn q+k+v, RMSNorm", 2048, {8192, 512, 512}, g::kOStore, 8, g::kXNorm);
  time_shape("attn o-proj (accum)", 4096, {2048}, g::kOAccum, 24, g::kXBf16);
  time_shape("shared gate/up (dual)", 2048, {512}, g::kODual, 64, g::kXBf16);
  time_shape("shared down (accum)", 512, {2048}, g::kOAccum, 96, g::kXBf16);
  time_shape("lm_head 248320, RMSNorm", 2048, {248320}, g::kOStore, 2, g::kXNorm);
  try {  // (last: a build of gemv_rows.cu without the conv epilogue or the routing refuses them)
    time_shape("dn in-proj + conv, RMSNorm", 2048, {8192, 4096, 32, 32}, g::kOStore, 8, g::kXNorm, true);
    time_routed(3);
    time_routed_down(3);
  } catch (const std::exception& e) {
    std::printf("SKIP: %s\n", e.what());
  }
  return 0;
}
