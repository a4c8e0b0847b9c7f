#include "metal/ops_metal.h"

#include <algorithm>
#include <stdexcept>

namespace lily::metal {
namespace {

constexpr uint32_t kGemvRows = 4, kGemvSimdgroups = 2;  // rows per simdgroup (template ROWS), simdgroups
constexpr uint32_t kGemmBN = 32, kGemmThreads = 128;  // both GEMM kernels (tensor op: execution_simdgroups<4>)
constexpr uint32_t kScanRows = 4;                        // state rows per simdgroup (template ROWS)

uint32_t cdiv(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }
BufRef at(BufRef r, size_t bytes) { return BufRef{r.buf, r.offset + bytes}; }
// Pipeline of a decode kernel serving `rows` input rows per threadgroup: <base> for one, <base>_m<rows> above.
std::string rows_kernel(const std::string& base, int rows) {
  return rows == 1 ? base : base + "_m" + std::to_string(rows);
}
constexpr int kMoeDecodeMaxK = 8, kMoeDecodeMaxSimdgroups = 4;  // moe.metal MOE_DEC_MAX_K, MOE_DEC_MAX_SG

template <class T>
void bytes(Encoder& e, int i, const T& v) { e.set_bytes(i, &v, sizeof(T)); }

void bind_w(Encoder& e, int i, const DevLinear& W) {
  e.set_buffer(i, W.w);
  e.set_buffer(i + 1, W.s);
  e.set_buffer(i + 2, W.b);
}

// Register slices per lane: Dk (scan) or D (attention) in units of 32.
int nk_for(int dk) {
  if (dk <= 32) return 1;
  if (dk <= 64) return 2;
  if (dk <= 128) return 4;
  throw std::invalid_argument("[lily] metal: DeltaNet key dim " + std::to_string(dk) + " > 128 is not instantiated");
}
int nd_for(int d) {
  if (d == 32 || d == 64 || d == 256) return d / 32;
  throw std::invalid_argument("[lily] metal: attention head dim " + std::to_string(d) + " is not instantiated (32/64/256)");
}
int hpg_for(int nd) { return nd == 8 ? 8 : 4; }

}  // namespace

std::string Ops::gemm_kernel(const std::string& fmt, bool glu, int bm) const {
  // gemm_tensor.metal instantiates q4 / q8 / bf16 plain and q4 / bf16 GLU, half tiles, BM 16 and 32
  const bool tensor = tensor_ops_ && (fmt == "q4" || fmt == "bf16" || (fmt == "q8" && !glu));
  return std::string(tensor ? "gemm_tensor_" : "gemm_") + (glu ? "glu_" : "") + fmt + (tensor ? "_f16" : "_f32") +
         "_bm" + std::to_string(bm);
}

void Ops::go(Encoder& e, const std::string& kernel, Size3 grid, Size3 tg) {
  e.set_pipeline(pipe(kernel));
  e.dispatch(grid, tg);
}

void Ops::linear(Encoder& e, const DevLinear& W, BufRef x, BufRef y, int S, bool accumulate, int x_stride,
                 int y_stride) {
  x_stride = x_stride ? x_stride : static_cast<int>(W.in);
  y_stride = y_stride ? y_stride : static_cast<int>(W.out);
  if (S <= kGemvMaxRows || exact_rows) {
    // Threadgroup rows of nm input rows each (all S when S <= kDecodeRows), then one for the rest: the kernels'
    // row count is a template parameter, so a group is always full. (The rest writes other rows of y, but the
    // device's hazards are per buffer: a barrier between.)
    const int nm = std::min(S, kDecodeRows), full = S / nm * nm;
    auto rows = [&](int row0, int m, int groups) {
      bind_w(e, 0, W);
      e.set_buffer(3, at(x, static_cast<size_t>(row0) * x_stride * 4));
      e.set_buffer(4, at(y, static_cast<size_t>(row0) * y_stride * 4));
      bytes(e, 5, W.args);
      bytes(e, 6, kp::GemvArgs{x_stride, y_stride, accumulate ? 1 : 0, 0});
      go(e, rows_kernel("gemv_" + W.fmt, m),
         {cdiv(W.out, kGemvRows * kGemvSimdgroups), static_cast<uint32_t>(groups), 1}, {32 * kGemvSimdgroups, 1, 1});
    };
    rows(0, nm, S / nm);
    if (full < S) {
      e.barrier();
      rows(full, S - full, 1);
    }
    return;
  }
  e.set_buffer(0, x);
  bind_w(e, 1, W);
  bind_w(e, 4, W);
  e.set_buffer(7, y);
  bytes(e, 8, W.args);
  const int bm = 32;
  bytes(e, 9, kp::GemmArgs{S, 0, 0, accumulate ? 1 : 0, x_stride, y_stride, static_cast<int>(cdiv(S, bm)), 0});
  for (int i = 10; i <= 14; ++i) e.set_buffer(i, x);  // block map unused in the plain form
  go(e, gemm_kernel(W.fmt, false, bm), {cdiv(W.out, kGemmBN), cdiv(S, bm), 1}, {kGemmThreads, 1, 1});
}

void Ops::linear_glu(Encoder& e, const DevLinear& Wg, const DevLinear& Wu, BufRef x, BufRef y, int S) {
  e.set_buffer(0, x);
  bind_w(e, 1, Wg);
  bind_w(e, 4, Wu);
  e.set_buffer(7, y);
  bytes(e, 8, Wg.args);
  const int bm = 32;
  bytes(e, 9, kp::GemmArgs{S, 0, 0, 2, static_cast<int>(Wg.in), static_cast<int>(Wg.out), static_cast<int>(cdiv(S, bm)), 0});
  for (int i = 10; i <= 14; ++i) e.set_buffer(i, x);
  go(e, gemm_kernel(Wg.fmt, true, bm), {cdiv(Wg.out, kGemmBN), cdiv(S, bm), 1}, {kGemmThreads, 1, 1});
}

void Ops::grouped(Encoder& e, const DevLinear& W, const DevLinear* Wu, BufRef a, int lda, bool gather,
                  const RouteBufs& r, BufRef y, int pairs, int bm, int max_tiles) {
  e.set_buffer(0, a);
  bind_w(e, 1, W);
  bind_w(e, 4, Wu ? *Wu : W);
  e.set_buffer(7, y);
  bytes(e, 8, W.args);
  bytes(e, 9, kp::GemmArgs{pairs, 1, gather ? 1 : 0, Wu ? 2 : 0, lda, static_cast<int>(W.out), max_tiles, 0});
  e.set_buffer(10, r.sorted_row);
  e.set_buffer(11, r.tile_expert);
  e.set_buffer(12, r.tile_row0);
  e.set_buffer(13, r.tile_rows);
  e.set_buffer(14, r.n_tiles);
  go(e, gemm_kernel(W.fmt, Wu != nullptr, bm), {cdiv(W.out, kGemmBN), static_cast<uint32_t>(max_tiles), 1},
     {kGemmThreads, 1, 1});
}

void Ops::rms_norm(Encoder& e, BufRef x, BufRef w, BufRef y, int S, int dim, float eps, int x_stride,
                   int y_stride) {
  e.set_buffer(0, x);
  e.set_buffer(1, w);
  e.set_buffer(2, y);
  bytes(e, 3, kp::NormArgs{dim, eps, x_stride ? x_stride : dim, y_stride ? y_stride : dim});
  const uint32_t cap = dev_.max_threads(pipe("rms_norm")) / 32 * 32;
  const uint32_t nt = std::min<uint32_t>(cap, std::max<uint32_t>(32, cdiv(dim, 8) / 32 * 32));
  go(e, "rms_norm", {static_cast<uint32_t>(S), 1, 1}, {nt, 1, 1});
}

void Ops::embed(Encoder& e, const DevLinear& E, BufRef ids, BufRef x, int S) {
  bind_w(e, 0, E);
  e.set_buffer(3, ids);
  e.set_buffer(4, x);
  bytes(e, 5, E.args);
  go(e, "embed_" + E.fmt, {static_cast<uint32_t>(S), 1, 1}, {128, 1, 1});
}

void Ops::copy_rows(Encoder& e, BufRef src, BufRef ids, BufRef y, int S, int dim) {
  DevLinear t;
  t.w = t.s = t.b = src;
  t.fmt = "f32";
  t.args.kind = 2;  // dense fp32 (linear_params)
  t.args.out = 1, t.args.in = dim, t.args.expert_elems = dim;
  embed(e, t, ids, y, S);
}

void Ops::argmax(Encoder& e, BufRef logits, int V, BufRef tokens, int slot) {
  e.set_buffer(0, logits);
  e.set_buffer(1, tokens);
  bytes(e, 2, kp::NormArgs{V, 0.f, slot, 0});
  go(e, "argmax", {1, 1, 1}, {std::min<uint32_t>(1024, dev_.max_threads(pipe("argmax")) / 32 * 32), 1, 1});
}

void Ops::deltanet_conv(Encoder& e, const kp::DeltaNetParams& p, BufRef qkv, BufRef conv_w, BufRef conv_state, BufRef u) {
  e.set_buffer(0, qkv);
  e.set_buffer(1, conv_w);
  e.set_buffer(2, conv_state);
  e.set_buffer(3, u);
  bytes(e, 4, p);
  go(e, "deltanet_conv", {cdiv(p.conv_dim, 128), 1, 1}, {128, 1, 1});
}

void Ops::deltanet_scan(Encoder& e, const kp::DeltaNetParams& p, BufRef u, BufRef b, BufRef a, BufRef a_log,
                   BufRef dt_bias, BufRef state, BufRef z, BufRef norm_w, BufRef y) {
  const std::string nk = "nk" + std::to_string(nk_for(p.k_dim));
  const uint32_t sgs = cdiv(p.v_dim, kScanRows);
  // The fused form needs the whole head (Dv / 4 simdgroups) in one threadgroup; the compiler may allow
  // fewer threads for this register-heavy pipeline, and then the unfused pair runs instead.
  const bool fuse = 32 * sgs <= dev_.max_threads(pipe("deltanet_scan_norm_" + nk));
  BufRef in[] = {u, b, a, a_log, dt_bias, state, y, z, norm_w};
  for (int i = 0; i < 9; ++i) e.set_buffer(i, in[i]);
  bytes(e, 9, p);
  if (fuse) {
    go(e, "deltanet_scan_norm_" + nk, {1, static_cast<uint32_t>(p.v_heads), 1}, {32 * sgs, 1, 1});
    return;
  }
  go(e, "deltanet_scan_" + nk, {cdiv(p.v_dim, kScanRows * 2), static_cast<uint32_t>(p.v_heads), 1}, {64, 1, 1});
  e.barrier();
  e.set_buffer(0, y);
  e.set_buffer(1, z);
  e.set_buffer(2, norm_w);
  bytes(e, 3, p);
  go(e, "deltanet_gated_norm", {static_cast<uint32_t>(p.S * p.v_heads), 1, 1}, {32, 1, 1});
}

namespace {
constexpr int64_t kChunk = 64;             // tokens per chunk of deltanet_chunk.metal (kChunk there)
constexpr uint32_t kChunkThreads = 256;     // both chunked kernels: 8 simdgroups
constexpr uint32_t kChunkStateRows = 32;    // state rows per threadgroup of deltanet_chunk_state

// Float offsets of the scratch regions of the chunked form (deltanet_chunk.metal's header), in binding order:
// W, U, P, Qg, Kd, LG, and the total.
struct ChunkScratchLayout {
  int64_t at[7];
  explicit ChunkScratchLayout(const kp::DeltaNetParams& p) {
    const int64_t hn = p.v_heads * ((p.S + kChunk - 1) / kChunk), dkp = 32 * nk_for(p.k_dim);
    const int64_t rows[6] = {dkp, p.v_dim, kChunk, dkp, dkp, 1};  // floats per chunk row of each region
    at[0] = 0;
    for (int i = 0; i < 6; ++i) at[i + 1] = at[i] + hn * kChunk * rows[i];
  }
};
}  // namespace

int Ops::scan_pick(const kp::DeltaNetParams& p, int form) {
  if (form == kScanAuto) return p.S >= kScanChunkMinRows ? kScanChunked : kScanSequential;
  if (form != kScanSequential && form != kScanChunked)
    throw std::invalid_argument("[lily] metal: deltanet_form is 0 (auto), 1 (sequential) or 2 (chunked), got " +
                                std::to_string(form));
  return form;
}

size_t Ops::deltanet_chunk_scratch_bytes(const kp::DeltaNetParams& p) {
  return static_cast<size_t>(ChunkScratchLayout(p).at[6]) * 4;
}

bool Ops::deltanet_chunked_fits(const kp::DeltaNetParams& p) {
  const std::string nk = "nk" + std::to_string(nk_for(p.k_dim));
  return dev_.max_threads(pipe("deltanet_chunk_prep_" + nk)) >= kChunkThreads &&
         dev_.max_threads(pipe("deltanet_chunk_state_" + nk)) >= kChunkThreads;
}

void Ops::deltanet_scan_chunked(Encoder& e, const kp::DeltaNetParams& p, BufRef u, BufRef b, BufRef a, BufRef a_log,
                           BufRef dt_bias, BufRef state, BufRef z, BufRef norm_w, BufRef y, BufRef scratch) {
  const std::string nk = "nk" + std::to_string(nk_for(p.k_dim));
  if (!deltanet_chunked_fits(p))
    throw std::runtime_error("[lily] metal: the chunked DeltaNet kernels (deltanet_chunk_*_" + nk + ") need " +
                             std::to_string(kChunkThreads) + " threads per threadgroup; this device allows fewer");
  const ChunkScratchLayout L(p);
  BufRef region[6];
  for (int i = 0; i < 6; ++i) region[i] = BufRef{scratch.buf, scratch.offset + static_cast<size_t>(L.at[i]) * 4};
  const uint32_t n_chunks = cdiv(p.S, kChunk), heads = static_cast<uint32_t>(p.v_heads);
  BufRef prep_in[] = {u, b, a, a_log, dt_bias};
  for (int i = 0; i < 5; ++i) e.set_buffer(i, prep_in[i]);
  for (int i = 0; i < 6; ++i) e.set_buffer(5 + i, region[i]);
  bytes(e, 11, p);
  go(e, "deltanet_chunk_prep_" + nk, {n_chunks, heads, 1}, {kChunkThreads, 1, 1});
  e.barrier();
  for (int i = 0; i < 6; ++i) e.set_buffer(i, region[i]);
  e.set_buffer(6, state);
  e.set_buffer(7, y);
  bytes(e, 8, p);
  go(e, "deltanet_chunk_state_" + nk, {cdiv(p.v_dim, kChunkStateRows), heads, 1}, {kChunkThreads, 1, 1});
  e.barrier();
  e.set_buffer(0, y);
  e.set_buffer(1, z);
  e.set_buffer(2, norm_w);
  bytes(e, 3, p);
  go(e, "deltanet_gated_norm", {static_cast<uint32_t>(p.S * p.v_heads), 1, 1}, {32, 1, 1});
}

void Ops::attn_prep(Encoder& e, const kp::AttentionParams& p, BufRef qg, BufRef k, BufRef v, BufRef q_norm,
                    BufRef k_norm, BufRef rope, BufRef q, BufRef k_cache, BufRef v_cache) {
  BufRef in[] = {qg, k, v, q_norm, k_norm, rope, q, k_cache, v_cache};
  for (int i = 0; i < 9; ++i) e.set_buffer(i, in[i]);
  bytes(e, 9, p);
  go(e, "attn_prep_nd" + std::to_string(nd_for(p.head_dim)) + kvs_,
     {static_cast<uint32_t>(p.S), static_cast<uint32_t>(p.n_heads + p.n_kv_heads), 1}, {32, 1, 1});
}

void Ops::attn_prefill(Encoder& e, const kp::AttentionParams& p, BufRef q, BufRef qg, BufRef k_cache,
                       BufRef v_cache, BufRef out) {
  const int nd = nd_for(p.head_dim), hpg = hpg_for(nd), rows = 4;
  BufRef in[] = {q, qg, k_cache, v_cache, out};
  for (int i = 0; i < 5; ++i) e.set_buffer(i, in[i]);
  bytes(e, 5, p);
  go(e, "attn_prefill_nd" + std::to_string(nd) + "_h" + std::to_string(hpg) + kvs_,
     {cdiv(p.S, rows), static_cast<uint32_t>(p.n_kv_heads), cdiv(p.n_heads / p.n_kv_heads, hpg)}, {32 * rows, 1, 1});
}

void Ops::attn_decode(Encoder& e, const kp::AttentionParams& p, BufRef q, BufRef qg, BufRef k_cache, BufRef v_cache,
                      BufRef ml, BufRef po, BufRef out) {
  const int nd = nd_for(p.head_dim), hpg = hpg_for(nd), nsg = 2;
  const int parts = attn_parts(p.pos0 + 1);
  const kp::AttnSplitParams sp{parts, kSplitLen, 0, 0};
  BufRef in[] = {q, k_cache, v_cache, ml, po};
  for (int i = 0; i < 5; ++i) e.set_buffer(i, in[i]);
  bytes(e, 5, p);
  bytes(e, 6, sp);
  go(e, "attn_decode_nd" + std::to_string(nd) + "_h" + std::to_string(hpg) + kvs_,
     {cdiv(parts, nsg), static_cast<uint32_t>(p.n_kv_heads), cdiv(p.n_heads / p.n_kv_heads, hpg)}, {32u * nsg, 1, 1});
  e.barrier();
  e.set_buffer(0, ml);
  e.set_buffer(1, po);
  e.set_buffer(2, qg);
  e.set_buffer(3, out);
  bytes(e, 4, p);
  bytes(e, 5, sp);
  go(e, "attn_decode_combine_nd" + std::to_string(nd), {static_cast<uint32_t>(p.n_heads), 1, 1}, {32, 1, 1});
}

void Ops::moe_topk(Encoder& e, BufRef logits, BufRef ids, BufRef wts, int S, int E, int k, bool norm) {
  if (E > 256) throw std::invalid_argument("[lily] metal: more than 256 experts is not instantiated");
  e.set_buffer(0, logits);
  e.set_buffer(1, ids);
  e.set_buffer(2, wts);
  bytes(e, 3, kp::RouteArgs{S, E, k, norm ? 1 : 0, 32, static_cast<int>(cdiv(S, 32)), 0, 0});
  go(e, E > 32 ? "moe_topk_j8" : "moe_topk_j1", {static_cast<uint32_t>(S), 1, 1}, {32, 1, 1});
}

void Ops::route(Encoder& e, BufRef logits, const RouteBufs& r, int S, int E, int k, bool norm, int bm,
                int max_tiles) {
  const int nb = static_cast<int>(cdiv(S, 32));
  const kp::RouteArgs ra{S, E, k, norm ? 1 : 0, 32, nb, bm, max_tiles};
  moe_topk(e, logits, r.ids, r.wts, S, E, k, norm);
  e.barrier();
  e.set_buffer(0, r.ids);
  e.set_buffer(1, r.counts);
  bytes(e, 2, ra);
  go(e, "moe_count", {static_cast<uint32_t>(nb), 1, 1}, {32, 1, 1});
  e.barrier();
  BufRef off[] = {r.counts, r.base, r.tile_expert, r.tile_row0, r.tile_rows, r.n_tiles};
  for (int i = 0; i < 6; ++i) e.set_buffer(i, off[i]);
  bytes(e, 6, ra);
  const uint32_t nt = std::max<uint32_t>(32, cdiv(E, 32) * 32);
  if (nt > dev_.max_threads(pipe("moe_offsets")))
    throw std::runtime_error("[lily] metal: moe_offsets needs one thread per expert (" + std::to_string(E) + ")");
  go(e, "moe_offsets", {1, 1, 1}, {nt, 1, 1});
  e.barrier();
  BufRef sc[] = {r.ids, r.wts, r.base, r.sorted_row, r.sorted_w, r.inv};
  for (int i = 0; i < 6; ++i) e.set_buffer(i, sc[i]);
  bytes(e, 6, ra);
  go(e, "moe_scatter", {static_cast<uint32_t>(nb), 1, 1}, {32, 1, 1});
}

void Ops::moe_combine(Encoder& e, BufRef x, BufRef yd, BufRef ysh, BufRef sg, const RouteBufs& r, int S, int H, int k) {
  BufRef in[] = {x, yd, ysh, sg, r.inv, r.wts};
  for (int i = 0; i < 6; ++i) e.set_buffer(i, in[i]);
  kp::MoeParams mp{};
  mp.hidden = H;
  mp.top_k = k;
  mp.S = S;
  bytes(e, 6, mp);
  go(e, "moe_combine", {cdiv(H, 128), static_cast<uint32_t>(S), 1}, {128, 1, 1});
}

void Ops::moe_gate_up_decode(Encoder& e, const DevLinear& g, const DevLinear& u, const DevLinear& sg,
                             const DevLinear& su, BufRef h, BufRef ids, BufRef act, int k, int act_stride, int rows) {
  if (g.fmt != sg.fmt || u.fmt != g.fmt || su.fmt != g.fmt)
    throw std::invalid_argument("[lily] metal: fused MoE decode needs one format for routed and shared gate/up");
  if (rows < 1 || rows > kDecodeRows) throw std::invalid_argument("[lily] metal: fused MoE decode of 1 to 8 rows");
  e.set_buffer(0, h);
  e.set_buffer(1, ids);
  bind_w(e, 2, g);
  bind_w(e, 5, u);
  bind_w(e, 8, sg);
  bind_w(e, 11, su);
  e.set_buffer(14, act);
  bytes(e, 15, g.args);
  bytes(e, 16, sg.args);
  bytes(e, 17, kp::MoeDecodeArgs{k, static_cast<int>(g.out), static_cast<int>(sg.out), act_stride});
  // grid y: one threadgroup row per (row, slot) pair and the shared expert; pairs whose expert an earlier row chose
  // return at once (moe.metal pair_rows)
  go(e, rows_kernel("moe_gate_up_decode_" + g.fmt, rows),
     {cdiv(std::max(g.out, sg.out), kGemvRows * kGemvSimdgroups), static_cast<uint32_t>(rows * k + 1), 1},
     {32 * kGemvSimdgroups, 1, 1});
}

void Ops::moe_down_decode(Encoder& e, const DevLinear& d, const DevLinear& sd, BufRef act, BufRef ids, BufRef wts,
                          BufRef sg_logit, BufRef x, int k, int act_stride, int rows) {
  if (d.fmt != sd.fmt)
    throw std::invalid_argument("[lily] metal: fused MoE decode needs one format for routed and shared down");
  static_assert(kGemvSimdgroups <= kMoeDecodeMaxSimdgroups, "moe_down_decode's threadgroup memory");
  if (rows < 1 || rows > kDecodeRows) throw std::invalid_argument("[lily] metal: fused MoE decode of 1 to 8 rows");
  if (k > kMoeDecodeMaxK)
    throw std::invalid_argument("[lily] metal: fused MoE decode of top_k > 8 is not instantiated");
  e.set_buffer(0, act);
  e.set_buffer(1, ids);
  e.set_buffer(2, wts);
  e.set_buffer(3, sg_logit);
  bind_w(e, 4, d);
  bind_w(e, 7, sd);
  e.set_buffer(10, x);
  bytes(e, 11, d.args);
  bytes(e, 12, sd.args);
  bytes(e, 13, kp::MoeDecodeArgs{k, static_cast<int>(d.in), static_cast<int>(sd.in), act_stride});
  go(e, rows_kernel("moe_down_decode_" + d.fmt, rows), {cdiv(d.out, kGemvRows * kGemvSimdgroups), 1, 1},
     {32 * kGemvSimdgroups, 1, 1});
}

}  // namespace lily::metal
