// build: csrc/cuda/gemv.cu
// Decode GEMV timing (gemv.cuh: every projection of the fused decode step) at the real decode shapes: time per launch
// (the mean of 60 back-to-back launches with PDL, as in the step) over weight copies that exceed the L2, as TB/s of
// weight bytes; the MoE down; the fixed cost of one launch (a line through 128 .. 12,352 output rows); a plain
// streaming read for calibration. Correctness: tests/kernels/test_cuda_gemv.py.
// Usage: time_decode [--once]   (--once: one launch per shape, e.g. for ncu --kernel-name regex:gemv_kernel)
#include <cmath>

#include "cuda/gemv.cuh"
#include "timing.cuh"

using namespace timing;
namespace g = lily::cuda::gemv;

namespace {

// Time per launch of proj over `copies` weight copies of shape outs x in: the bf16 staging or, xmode kXNorm, the
// step's RMSNorm of the residual.
double time_proj(const char* tag, int64_t in, std::vector<int64_t> outs, int mode, int copies, int xmode = g::kXBf16) {
  std::vector<g::ProjArgs> args(copies);
  std::vector<DevWeight> ws;
  std::vector<void*> bufs;
  bf16* x = drandom<bf16>(in, 1);
  float* xf = drandom<float>(in, 2);
  float* nw = drandom<float>(in, 3, 0.5f, 1.5f);
  double bytes = 0;
  for (int c = 0; c < copies; ++c) {
    g::ProjArgs& a = args[c];
    a.in = static_cast<int32_t>(in), a.xmode = xmode, a.xb = x, a.xf = xf, a.nw = nw, a.eps = 1e-6f;
    a.nseg = static_cast<int>(outs.size());
    for (int s = 0; s < a.nseg; ++s) {
      ws.emplace_back();
      ws.back().make(4, 1, outs[s], in, 100 * c + 10 * s);
      a.seg[s].w0 = a.seg[s].w1 = ws.back().d;
      if (mode == g::kODual) {  // the up projection beside the gate
        ws.emplace_back();
        ws.back().make(4, 1, outs[s], in, 100 * c + 10 * s + 5);
        a.seg[s].w1 = ws.back().d;
      }
      a.seg[s].mode = mode;
      a.seg[s].y = dalloc<float>(outs[s]);
      a.seg[s].yb = dalloc<bf16>(outs[s]);
      bufs.push_back(a.seg[s].y), bufs.push_back(a.seg[s].yb);
      if (c == 0) bytes += (mode == g::kODual ? 2.0 : 1.0) * outs[s] * in * (0.5 + 4.0 / 64);
    }
  }
  const double ms = mean_ms([&](int i) { g::proj(nullptr, args[i % copies]); });
  if (g_once) std::printf("ONCE proj %s\n", tag);
  else std::printf("TIME proj %-30s %6.1f MB | %6.2f us %.2f TB/s\n", tag, bytes / 1e6, ms * 1e3, bytes / ms / 1e9);
  for (auto& w : ws) w.free_all();
  for (void* p : bufs) cudaFree(p);
  cudaFree(x), cudaFree(xf), cudaFree(nw);
  return ms;
}

// The MoE down: 8 routed experts of 256 (ids rotated over the copies) + the shared expert, combined into the residual.
void time_down() {
  const int64_t H = 2048, I = 512;
  const int k = 8, E = 256, copies = 8;
  DevWeight wd, ws;
  wd.make(4, E, H, I, 7), ws.make(4, 1, H, I, 8);
  bf16 *act = drandom<bf16>(k * I, 9), *sact = drandom<bf16>(I, 10);
  float *x = drandom<float>(H, 11), *sg = dupload(std::vector<float>{0.1f});
  std::vector<g::DownArgs> args(copies);
  for (int c = 0; c < copies; ++c) {
    std::vector<int32_t> idx(k);
    for (int j = 0; j < k; ++j) idx[j] = (c * k + j) * 3 % E;
    g::DownArgs& a = args[c];
    a.wd = wd.d, a.ws = ws.d, a.act = act, a.sact = sact, a.top_idx = dupload(idx);
    a.top_w = dupload(std::vector<float>(k, 0.1f)), a.sgate = sg, a.x = x, a.k = k;
  }
  const double bytes = (k + 1) * H * I * (0.5 + 4.0 / 64);
  const double ms = mean_ms([&](int i) { g::moe_down(nullptr, args[i % copies]); });
  if (g_once) std::printf("ONCE down\n");
  else std::printf("TIME down 8+1 experts              %6.1f MB | %6.2f us %.2f TB/s\n", bytes / 1e6, ms * 1e3,
                   bytes / ms / 1e9);
  for (auto& a : args) cudaFree(const_cast<int32_t*>(a.top_idx)), cudaFree(const_cast<float*>(a.top_w));
  wd.free_all(), ws.free_all(), cudaFree(act), cudaFree(sact), cudaFree(x), cudaFree(sg);
}

// The fixed cost of one launch: the DeltaNet in-projection's input (2048) at 128 .. 12,352 output rows, each over
// enough weight copies to exceed the L2, and a least-squares line t = a + bytes / B through the points (a: the
// launch's start and tail, B: the streaming rate inside it).
void time_fixed_cost() {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int n = 0;
  for (int64_t r : {128, 512, 2048, 4096, 8192, 12352}) {
    const double mb = r * 2048 * (0.5 + 4.0 / 64) / 1e6;
    char tag[64];
    std::snprintf(tag, sizeof tag, "fixed cost, %lld rows", static_cast<long long>(r));
    const int copies = static_cast<int>(std::max(2.0, std::ceil(240.0 / mb)));
    const double us = time_proj(tag, 2048, {r}, g::kOStore, copies) * 1e3;
    sx += mb, sy += us, sxx += mb * mb, sxy += mb * us, ++n;
  }
  const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx), icpt = (sy - slope * sx) / n;
  std::printf("TIME fixed cost per launch %.2f us + bytes at %.2f TB/s (fit over %d shapes)\n", icpt, 1.0 / slope, n);
}

// Calibration: a plain streaming read of n uint4 (8 independent 16-byte loads a thread in flight).
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

void time_read(int64_t bytes) {
  uint4* p = dalloc<uint4>(bytes / 16);
  uint32_t* o = dalloc<uint32_t>(1);
  CK(cudaMemset(p, 0x5A, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int bps : {4, 8, 16}) {
    const double ms = mean_ms([&](int) { read_kernel<<<sms * bps, 256>>>(p, bytes / 16, o); }, 10, 1);
    std::printf("TIME read %.0f MB, %d blocks/SM: %.2f TB/s\n", bytes / 1e6, bps, bytes / ms / 1e9);
  }
  cudaFree(p), cudaFree(o);
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_decode");
  time_proj("dn in-proj qkv+z+b+a", 2048, {8192, 4096, 32, 32}, g::kOStore, 8);
  time_proj("dn out-proj (accum)", 4096, {2048}, g::kOAccum, 24);
  time_proj("shared gate/up (dual)", 2048, {512}, g::kODual, 64);
  time_proj("expert gate/up x8 (dual)", 2048, {4096}, g::kODual, 16);
  time_proj("lm_head 248320", 2048, {248320}, g::kOStore, 2);
  time_proj("attn q+k+v", 2048, {8192, 512, 512}, g::kOStore, 8);
  time_proj("dn in-proj, RMSNorm staging", 2048, {8192, 4096, 32, 32}, g::kOStore, 8, g::kXNorm);
  time_proj("shared gate/up, RMSNorm", 2048, {512}, g::kODual, 64, g::kXNorm);
  time_down();
  if (g_once) return 0;
  time_fixed_cost();
  time_read(286LL << 20);
  time_read(14LL << 20);
  return 0;
}
