// The CUDA op table (ops_table.h), prefill side: norm, linear and grouped GEMMs, MoE routing / sort / combine, the
// DeltaNet conv, scans and gated norm. Each entry: inputs to the device, the product's launch function, outputs back.
#include <algorithm>

#include "cuda/deltanet.cuh"
#include "cuda/embed_norm.cuh"
#include "cuda/gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/ops_table_dev.cuh"

namespace lily::cuda::ops {

int sm_count() { return device_sm_count(); }
bool device_is_sm90() { return cuda::device_is_sm90(); }

void embed(const Linear& E, const int32_t* ids, int64_t S, float* x) {
  Dev dv;
  const DLinear dE = dv.linear(E);
  float* dx = dv.alloc<float>(S * E.in);
  cuda::embed(kStream, dE, dv.put(ids, S), S, dx);
  finish("embed");
  get(x, dx, S * E.in);
}

void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t n, int x_offset, uint16_t* y) {
  Dev dv;
  const float* dx = dv.put(x, rows * n, x_offset);
  uint16_t* dy = dv.alloc<uint16_t>(rows * n);
  cuda::rms_norm(kStream, dx, dv.put(w, n), eps, rows, n, as_bf16(dy));
  finish("rms_norm");
  get(y, dy, rows * n);
}

void rms_norm_f32(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  Dev dv;
  float* dy = dv.alloc<float>(rows * n);
  cuda::rms_norm(kStream, dv.put(x, rows * n), dv.put(w, n), eps, rows, n, dy);
  finish("rms_norm_f32");
  get(y, dy, rows * n);
}

namespace {

// The wmma fallback for one product (force_gemm_fallback is a process-wide switch of the check programs): on for
// kGemmFallback, off again however the call ends.
struct FallbackScope {
  explicit FallbackScope(int impl) { force_gemm_fallback(impl == kGemmFallback); }
  ~FallbackScope() { force_gemm_fallback(false); }
};

void check_impl(int impl, const char* op) {
  if (impl != kGemmAuto && impl != kGemmFallback && impl != kGemmMma)
    throw std::invalid_argument(std::string("[cuda_ops.") + op + "] impl is 0 (auto), 1 (wmma fallback) or 2 (mma)");
}

void check_mma(const DLinear& W0, const DLinear* W1, const bf16* x, int64_t ldx, const char* op) {
  if (!gemm_mma_supported(W0, W1, x, ldx))
    throw std::invalid_argument(std::string("[cuda_ops.") + op + "] the mma GEMM does not take this weight / input");
}

}  // namespace

void linear(const Linear& W, const uint16_t* x, int64_t S, int64_t ldx, const float* y0, int64_t ldy, int impl,
            int sb_offset, float* y) {
  check_impl(impl, "linear");
  Dev dv;
  const DLinear dW = dv.linear(W, sb_offset);
  const bf16* dx = as_bf16(dv.put(x, S * ldx));
  float* dy = y0 ? dv.put(y0, S * ldy) : dv.alloc<float>(S * ldy);
  FallbackScope fb(impl);
  if (impl == kGemmMma) {
    check_mma(dW, nullptr, dx, ldx, "linear");
    const kp::GemmParams gp{S, ldx, ldy, 0, y0 ? 1 : 0};
    gemm_mma(kStream, GemmMmaArgs{dW, dW, gp, GroupMap{}, dx, dy, nullptr}, false,
             gemm_mma_plain_rows(S, W.out, false));
  } else {
    cuda::linear(kStream, dW, dx, ldx, S, dy, ldy, y0 != nullptr);
  }
  finish("linear");
  get(y, dy, S * ldy);
}

void linear_silu_mul(const Linear& W0, const Linear& W1, const uint16_t* x, int64_t S, int64_t ldx, int64_t ldy,
                     int impl, int sb_offset, uint16_t* y) {
  check_impl(impl, "linear_silu_mul");
  Dev dv;
  const DLinear d0 = dv.linear(W0, sb_offset), d1 = dv.linear(W1, sb_offset);
  const bf16* dx = as_bf16(dv.put(x, S * ldx));
  uint16_t* dy = dv.alloc<uint16_t>(S * ldy);
  FallbackScope fb(impl);
  if (impl == kGemmMma) {
    check_mma(d0, &d1, dx, ldx, "linear_silu_mul");
    const kp::GemmParams gp{S, ldx, ldy, 0, 0};
    gemm_mma(kStream, GemmMmaArgs{d0, d1, gp, GroupMap{}, dx, nullptr, as_bf16(dy)}, true,
             gemm_mma_plain_rows(S, W0.out, true));
  } else {
    cuda::linear_silu_mul(kStream, d0, d1, dx, ldx, S, as_bf16(dy), ldy);
  }
  finish("linear_silu_mul");
  get(y, dy, S * ldy);
}

void linear_concat(const Linear& W, const std::vector<int64_t>& rows, const std::vector<int64_t>& ldy,
                   bool concatenated, const uint16_t* x, int64_t S, const std::vector<float*>& y) {
  const int n = static_cast<int>(rows.size());
  if (n < 1 || n > kMaxConcat || ldy.size() != rows.size() || y.size() != rows.size())
    throw std::invalid_argument("[cuda_ops.linear_concat] 1 to 4 parts, each with its row count, stride and output");
  if (W.kind != Linear::Kind::Quant || W.experts != 0)
    throw std::invalid_argument("[cuda_ops.linear_concat] the concatenation is one quantized matrix");
  Dev dv;
  const DLinear dW = dv.linear(W);
  const bf16* dx = as_bf16(dv.put(x, S * W.in));
  // each part a row view of the one device matrix (weights_cuda.cu's concatenations)
  const int64_t wpr = W.in * W.bits / 32, gpr = W.in / W.group;
  std::vector<DLinear> parts(n);
  std::vector<float*> dy(n);
  int64_t row0 = 0;
  for (int i = 0; i < n; ++i) {
    DLinear& d = parts[i];
    d = dW;
    d.p.out = rows[i], d.p.expert_words = rows[i] * wpr, d.p.expert_groups = rows[i] * gpr;
    d.p.expert_elems = rows[i] * W.in;
    d.codes += row0 * wpr, d.scales += row0 * gpr, d.biases += row0 * gpr;
    row0 += rows[i];
    dy[i] = dv.alloc<float>(S * ldy[i]);
  }
  if (row0 != W.out) throw std::invalid_argument("[cuda_ops.linear_concat] the parts' rows must add up to W's");
  cuda::linear_concat(kStream, concatenated ? dW : DLinear{}, parts.data(), n, dx, W.in, S, dy.data(), ldy.data());
  finish("linear_concat");
  for (int i = 0; i < n; ++i) get(y[i], dy[i], S * ldy[i]);
}

void grouped(const Linear& W0, const Linear& W1, const Linear& W2, const HostTileMap& map, int64_t P,
             const int32_t* a_rows, const int32_t* y_rows, const float* scale, const uint16_t* h, int64_t S,
             const uint16_t* act_in, int tile_rows, int impl, uint16_t* act, uint16_t* d) {
  check_impl(impl, "grouped");
  if (impl == kGemmMma) throw std::invalid_argument("[cuda_ops.grouped] impl is 0 (auto) or 1 (wmma fallback)");
  Dev dv;
  const DLinear d0 = dv.linear(W0), d1 = dv.linear(W1), d2 = dv.linear(W2);
  const int32_t* nt = dv.put(&map.n_tiles, 1);
  GroupMap g{nt, dv.put(map.tile_expert, map.max_tiles), dv.put(map.tile_row0, map.max_tiles),
             dv.put(map.tile_rows, map.max_tiles), dv.put(a_rows, P), dv.put(y_rows, P), dv.put(scale, P),
             map.max_tiles};
  uint16_t* dact = dv.alloc<uint16_t>(P * W0.out);
  uint16_t* dd = dv.alloc<uint16_t>(P * W2.out);
  FallbackScope fb(impl);
  grouped_gate_up(kStream, d0, d1, g, as_bf16(dv.put(h, S * W0.in)), W0.in, as_bf16(dact), tile_rows);
  grouped_down(kStream, d2, g, as_bf16(dv.put(act_in, P * W2.in)), as_bf16(dd), tile_rows);
  finish("grouped");
  get(act, dact, P * W0.out);
  get(d, dd, P * W2.out);
}

void experts_gate_up(const Linear& W0, const Linear& W1, const int32_t* ids, int k, const uint16_t* x, uint16_t* act) {
  Dev dv;
  const DLinear d0 = dv.linear(W0), d1 = dv.linear(W1);
  uint16_t* dact = dv.alloc<uint16_t>(k * W0.out);
  cuda::experts_gate_up(kStream, d0, d1, dv.put(ids, k), k, as_bf16(dv.put(x, W0.in)), as_bf16(dact));
  finish("experts_gate_up");
  get(act, dact, k * W0.out);
}

void experts_down(const Linear& W2, const int32_t* ids, const float* w, int k, const uint16_t* act_in, uint16_t* d) {
  Dev dv;
  const DLinear d2 = dv.linear(W2);
  uint16_t* dd = dv.alloc<uint16_t>(k * W2.out);
  cuda::experts_down(kStream, d2, dv.put(ids, k), dv.put(w, k), k, as_bf16(dv.put(act_in, k * W2.in)), as_bf16(dd));
  finish("experts_down");
  get(d, dd, k * W2.out);
}

void moe_route(const kp::MoeParams& p, const float* logits, int32_t* idx, float* w) {
  Dev dv;
  const int64_t n = p.S * p.top_k;
  int32_t* di = dv.alloc<int32_t>(n);
  float* dw = dv.alloc<float>(n);
  cuda::moe_route(kStream, p, dv.put(logits, p.S * p.n_experts), di, dw);
  finish("moe_route");
  get(idx, di, n);
  get(w, dw, n);
}

int64_t moe_sort_max_tiles(const kp::MoeParams& p, int tile_rows) {
  return grouped_max_tiles(p.S * p.top_k, p.n_experts, tile_rows);
}

void moe_sort(const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows, const HostSort& out) {
  const int64_t P = p.S * p.top_k, mt = moe_sort_max_tiles(p, tile_rows);
  Dev dv;
  SortBuffers b;
  b.pair_row = dv.alloc<int32_t>(P), b.pair_id = dv.alloc<int32_t>(P), b.pair_w = dv.alloc<float>(P);
  b.n_tiles = dv.alloc<int32_t>(1), b.tile_expert = dv.alloc<int32_t>(mt);
  b.tile_row0 = dv.alloc<int32_t>(mt), b.tile_rows = dv.alloc<int32_t>(mt);
  b.block_base = dv.alloc<int32_t>(moe_sort_scratch(P, p.n_experts));
  cuda::moe_sort(kStream, p, dv.put(top_idx, P), dv.put(top_w, P), tile_rows, b);
  finish("moe_sort");
  get(out.pair_row, b.pair_row, P), get(out.pair_id, b.pair_id, P), get(out.pair_w, b.pair_w, P);
  get(out.n_tiles, b.n_tiles, 1), get(out.tile_expert, b.tile_expert, mt);
  get(out.tile_row0, b.tile_row0, mt), get(out.tile_rows, b.tile_rows, mt);
}

void moe_experts(const kp::MoeParams& p, const Linear& gate, const Linear& up, const Linear& down, const uint16_t* h,
                 const int32_t* top_idx, const float* top_w, int tile_rows, bool host_count, uint16_t* d) {
  const int64_t P = p.S * p.top_k;
  // the backend's scratch sizes (backend_cuda.cu reserve): the tile map at the smallest tile, any tile fits
  const int64_t mt = grouped_max_tiles(P, p.n_experts, 16);
  Dev dv;
  const DLinear dg = dv.linear(gate), du = dv.linear(up), dd = dv.linear(down);
  SortBuffers b;
  b.pair_row = dv.alloc<int32_t>(P), b.pair_id = dv.alloc<int32_t>(P), b.pair_w = dv.alloc<float>(P);
  b.n_tiles = dv.alloc<int32_t>(1), b.tile_expert = dv.alloc<int32_t>(mt);
  b.tile_row0 = dv.alloc<int32_t>(mt), b.tile_rows = dv.alloc<int32_t>(mt);
  b.block_base = dv.alloc<int32_t>(moe_sort_scratch(P, p.n_experts));
  uint16_t* dact = dv.alloc<uint16_t>(P * p.inter);
  uint16_t* dout = dv.alloc<uint16_t>(P * p.hidden);
  cuda::moe_experts(kStream, p, dg, du, dd, as_bf16(dv.put(h, p.S * p.hidden)), dv.put(top_idx, P), dv.put(top_w, P),
                    b, as_bf16(dact), as_bf16(dout), tile_rows, host_count);
  finish("moe_experts");
  get(d, dout, P * p.hidden);
}

void moe_combine(const kp::MoeParams& p, const float* sh, const float* gate, const uint16_t* d, float* x) {
  Dev dv;
  const int64_t n = p.S * p.hidden;
  float* dx = dv.put(x, n);
  cuda::moe_combine(kStream, p, dv.put(sh, n), dv.put(gate, p.S), as_bf16(dv.put(d, n * p.top_k)), dx);
  finish("moe_combine");
  get(x, dx, n);
}

void deltanet_conv(const kp::DeltaNetParams& p, const float* qkv, const float* conv_w, float* conv_state, int misalign,
                   float* u) {
  const int64_t C = p.conv_dim, ns = static_cast<int64_t>(p.conv_kernel - 1) * C;
  Dev dv;
  const float* dq = dv.put(qkv, p.S * C, misalign == 1);
  float* dst = dv.put(conv_state, ns, misalign == 2);
  float* du = dv.alloc<float>(p.S * C + 1) + (misalign == 3);
  cuda::deltanet_conv(kStream, p, dq, dv.put(conv_w, C * p.conv_kernel), dst, du);
  finish("deltanet_conv");
  get(u, du, p.S * C);
  get(conv_state, dst, ns);
}

namespace {

// The scan's device inputs and its poisoned chunk scratch (the forms' own size).
struct ScanDev {
  const float *u, *b, *a, *dt_bias, *a_log;
  float *ssm, *scratch;
  size_t scratch_bytes;
  ScanDev(Dev& dv, const kp::DeltaNetParams& p, const float* u_, const float* b_, const float* a_,
          const float* dt_bias_, const float* a_log_, const float* ssm_) {
    u = dv.put(u_, p.S * p.conv_dim), b = dv.put(b_, p.S * p.v_heads), a = dv.put(a_, p.S * p.v_heads);
    dt_bias = dv.put(dt_bias_, p.v_heads), a_log = dv.put(a_log_, p.v_heads);
    ssm = dv.put(ssm_, static_cast<int64_t>(p.v_heads) * p.v_dim * p.k_dim);
    scratch_bytes = deltanet_chunk_scratch_bytes(p);
    scratch = dv.alloc<float>((scratch_bytes + 3) / 4);  // NaN: scratch read before it is written shows
  }
};

}  // namespace

void deltanet_scan(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a, const float* dt_bias,
                   const float* a_log, float* ssm, int variant, float* y) {
  Dev dv;
  ScanDev s(dv, p, u, b, a, dt_bias, a_log, ssm);
  const int64_t ny = p.S * p.v_heads * p.v_dim, ns = static_cast<int64_t>(p.v_heads) * p.v_dim * p.k_dim;
  float* dy = dv.alloc<float>(ny);
  switch (variant) {
    case kScanSeq8: deltanet_scan_seq(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, 8); break;
    case kScanSeq16: deltanet_scan_seq(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, 16); break;
    case kScanChunk:
      cuda::deltanet_scan(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, kScanChunked, s.scratch,
                          s.scratch_bytes);
      break;
    case kScanAutoForm: cuda::deltanet_scan(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy); break;
    default:
      throw std::invalid_argument("[cuda_ops.deltanet_scan] variant is 0 (seq8), 1 (seq16), 2 (chunk), 3 (auto)");
  }
  finish("deltanet_scan");
  get(y, dy, ny);
  get(ssm, s.ssm, ns);
}

void deltanet_scan_norm(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, const float* z, const float* norm_w, float* ssm,
                        int variant, uint16_t* out) {
  Dev dv;
  ScanDev s(dv, p, u, b, a, dt_bias, a_log, ssm);
  const int64_t ny = p.S * p.v_heads * p.v_dim, ns = static_cast<int64_t>(p.v_heads) * p.v_dim * p.k_dim;
  float* dy = dv.alloc<float>(ny);  // the pair's scratch (the fused chunked form never writes it)
  const float* dz = dv.put(z, ny);
  const float* dw = dv.put(norm_w, p.v_dim);
  uint16_t* dout = dv.alloc<uint16_t>(ny);
  switch (variant) {
    case kNormChunk:
    case kNormSeq:
      cuda::deltanet_scan_norm(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, dz, dw, as_bf16(dout),
                               variant == kNormChunk ? kScanChunked : kScanSequential, s.scratch, s.scratch_bytes);
      break;
    case kNormAuto:  // defaults: auto, the internal scratch
      cuda::deltanet_scan_norm(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, dz, dw, as_bf16(dout));
      break;
    case kNormSplit:
      cuda::deltanet_scan(kStream, p, s.u, s.b, s.a, s.dt_bias, s.a_log, s.ssm, dy, kScanChunked, s.scratch,
                          s.scratch_bytes);
      cuda::deltanet_gated_norm(kStream, p, dy, dz, dw, as_bf16(dout));
      break;
    default:
      throw std::invalid_argument("[cuda_ops.deltanet_scan_norm] variant is 0 (chunk+norm), 1 (auto+norm), "
                                  "2 (seq+norm) or 3 (chunk, then gated_norm)");
  }
  finish("deltanet_scan_norm");
  get(out, dout, ny);
  get(ssm, s.ssm, ns);
}

int deltanet_scan_pick(const kp::DeltaNetParams& p) { return cuda::deltanet_scan_pick(p, kScanAuto); }

void deltanet_gated_norm(const kp::DeltaNetParams& p, const float* y, const float* z, const float* w, uint16_t* out) {
  Dev dv;
  const int64_t n = p.S * p.v_heads * p.v_dim;
  uint16_t* dout = dv.alloc<uint16_t>(n);
  cuda::deltanet_gated_norm(kStream, p, dv.put(y, n), dv.put(z, n), dv.put(w, p.v_dim), as_bf16(dout));
  finish("deltanet_gated_norm");
  get(out, dout, n);
}

void deltanet_step_rows(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, const float* z, const float* norm_w,
                        int32_t* head_done, float* y, uint16_t* out, float* state_rows) {
  Dev dv;
  const int64_t M = p.S, n = static_cast<int64_t>(p.v_heads) * p.v_dim, ns = n * p.k_dim;
  float* dssm = dv.put(ssm, ns);
  int32_t* done = dv.put(head_done, p.v_heads);
  float* dy = dv.alloc<float>(M * n);
  uint16_t* dout = dv.alloc<uint16_t>(M * n);
  float* drows = state_rows ? dv.alloc<float>(M * ns) : nullptr;
  cuda::deltanet_step_rows(kStream, p, dv.put(u, M * p.conv_dim), dv.put(b, M * p.v_heads), dv.put(a, M * p.v_heads),
                           dv.put(dt_bias, p.v_heads), dv.put(a_log, p.v_heads), dssm, dy, dv.put(z, M * n),
                           dv.put(norm_w, p.v_dim), as_bf16(dout), done, drows);
  finish("deltanet_step_rows");
  get(y, dy, M * n);
  get(out, dout, M * n);
  get(ssm, dssm, ns);
  get(head_done, done, p.v_heads);
  if (state_rows) get(state_rows, drows, M * ns);
}

void deltanet_step(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a, const float* dt_bias,
                   const float* a_log, float* ssm, const float* z, const float* norm_w, int32_t* head_done, float* y,
                   uint16_t* out) {
  if (p.S != 1) throw std::invalid_argument("[cuda_ops.deltanet_step] one token (S == 1)");
  Dev dv;
  const int64_t n = static_cast<int64_t>(p.v_heads) * p.v_dim, ns = n * p.k_dim;
  float* dssm = dv.put(ssm, ns);
  int32_t* done = dv.put(head_done, p.v_heads);
  float* dy = dv.alloc<float>(n);
  uint16_t* dout = dv.alloc<uint16_t>(n);
  cuda::deltanet_step(kStream, p, dv.put(u, p.conv_dim), dv.put(b, p.v_heads), dv.put(a, p.v_heads),
                      dv.put(dt_bias, p.v_heads), dv.put(a_log, p.v_heads), dssm, dy, dv.put(z, n),
                      dv.put(norm_w, p.v_dim), as_bf16(dout), done);
  finish("deltanet_step");
  get(y, dy, n);
  get(out, dout, n);
  get(ssm, dssm, ns);
  get(head_done, done, p.v_heads);
}

}  // namespace lily::cuda::ops
