// The decode sub-blocks over M rows (decode_rows.cuh).
#include "cuda/decode_rows.cuh"

#include <stdexcept>

#include "cuda/attention.cuh"
#include "cuda/decode_layers.cuh"
#include "cuda/deltanet.cuh"
#include "cuda/sample.cuh"

namespace lily::cuda {
namespace {

// A segment of an M-row launch: weight w (w1: a dual segment's up), output mode, fp32 y or bf16 yb, row stride ldy.
rows::Seg rows_seg(const DLinear& w, int mode, float* y, bf16* yb, int64_t ldy, const DLinear* w1 = nullptr) {
  rows::Seg s;
  s.w0 = w, s.w1 = w1 ? *w1 : w;
  s.mode = mode, s.y = y, s.yb = yb, s.ldy = ldy;
  return s;
}

}  // namespace

int DecodeRowsLayers::deltanet(const DeviceLayer& L, DeltaNetState& s, int M, float* conv_hist,
                               float* state_rows) const {
  const Config& c = *cfg;
  const int64_t C = c.conv_dim(), HD = c.value_dim(), Hv = c.deltanet_v_heads;
  rows::Args a;
  a.rows = M, a.in = static_cast<int32_t>(c.hidden), a.xmode = rows::kXNorm, a.eps = c.rms_eps;
  a.xf = b.x, a.ldx = c.hidden, a.nw = L.in_norm;
  a.nseg = 4;
  a.seg[0] = rows_seg(L.qkv, rows::kOConv, nullptr, nullptr, C);
  a.seg[1] = rows_seg(L.z, rows::kOStore, b.z, nullptr, HD);
  a.seg[2] = rows_seg(L.b, rows::kOStore, b.b, nullptr, Hv);
  a.seg[3] = rows_seg(L.a, rows::kOStore, b.a, nullptr, Hv);
  a.conv_w = L.conv_w, a.conv_state = s.conv.as<float>(), a.u = b.u, a.conv_hist = conv_hist;
  a.conv_k = c.conv_kernel;
  rows::proj(st, a);
  deltanet_step_rows(st, deltanet_params(c, M), b.u, b.b, b.a, L.dt_bias, L.a_log, s.ssm.as<float>(), b.y, b.z,
                     L.deltanet_norm, b.yb, b.head_done, state_rows);
  rows::Args o;
  o.rows = M, o.in = static_cast<int32_t>(HD), o.xmode = rows::kXBf16, o.xb = b.yb, o.ldx = HD;
  o.nseg = 1;
  o.seg[0] = rows_seg(L.out, rows::kOAccum, b.x, nullptr, c.hidden);
  rows::proj(st, o);
  return 3;
}

int DecodeRowsLayers::attention(const DeviceLayer& L, KVCache& kv, const int32_t* dpos, int M) const {
  const Config& c = *cfg;
  const int64_t D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
  rows::Args a;
  a.rows = M, a.in = static_cast<int32_t>(c.hidden), a.xmode = rows::kXNorm, a.eps = c.rms_eps;
  a.xf = b.x, a.ldx = c.hidden, a.nw = L.in_norm;
  a.nseg = 3;
  a.seg[0] = rows_seg(L.q, rows::kOStore, b.qg, nullptr, Hq * 2 * D);
  a.seg[1] = rows_seg(L.k, rows::kOStore, b.k, nullptr, Hkv * D);
  a.seg[2] = rows_seg(L.v, rows::kOStore, b.v, nullptr, Hkv * D);
  rows::proj(st, a);
  const kp::AttentionParams p = attention_params(c, 0, M);
  attention_prep(st, p, b.qg, b.k, b.v, L.q_norm, L.k_norm, b.q, kv.k.as<bf16>(), kv.v.as<bf16>(), dpos);
  // the split count of the capacity's one-row plan, as every row's one-row step runs it (its length per row)
  kp::AttentionParams cap = attention_params(c, kv.capacity - 1, 1);
  const kp::AttnSplitParams sp = attention_plan(cap, sm_count);
  if (sp.n_splits > b.max_splits) throw std::logic_error("[lily] cuda decode rows: attention split count");
  cuda::attention(st, p, sp, b.q, b.qg, kv.k.as<bf16>(), kv.v.as<bf16>(), b.part, b.ob, dpos,
                  /*tensor_core_decode=*/true);
  rows::Args o;
  o.rows = M, o.in = static_cast<int32_t>(Hq * D), o.xmode = rows::kXBf16, o.xb = b.ob, o.ldx = Hq * D;
  o.nseg = 1;
  o.seg[0] = rows_seg(L.o, rows::kOAccum, b.x, nullptr, c.hidden);
  rows::proj(st, o);
  return 5;
}

int DecodeRowsLayers::moe(const DeviceLayer& L, int M) const {
  const Config& c = *cfg;
  const int k = c.top_k;
  const int64_t H = c.hidden, I = c.moe_inter, E = c.n_experts;
  // the router (8-bit), the shared expert's gate/up and its one-row gate, on the normed rows (kept in h)
  rows::Args a;
  a.rows = M, a.in = static_cast<int32_t>(H), a.xmode = rows::kXNorm, a.eps = c.rms_eps;
  a.xf = b.x, a.ldx = H, a.nw = L.post_norm, a.h_out = b.h;
  a.nseg = 3;
  a.seg[0] = rows_seg(L.router, rows::kOStore, b.router, nullptr, E);
  a.seg[1] = rows_seg(L.sh_gate, rows::kODual, nullptr, b.sact, L.sh_gate.p.out, &L.sh_up);
  a.seg[2] = rows_seg(L.sh_expert_gate, rows::kOStore, b.sgate, nullptr, 1);
  rows::proj(st, a);
  // each row's top-k and the experts' gate/up (each distinct expert once)
  rows::Args e;
  e.rows = M, e.in = static_cast<int32_t>(H), e.xmode = rows::kXBf16, e.xb = b.h, e.ldx = H;
  e.rlogits = b.router, e.E = static_cast<int32_t>(E), e.top_k = k, e.norm_topk = c.norm_topk_prob ? 1 : 0;
  e.top_idx = b.top_idx, e.top_w = b.top_w;
  e.nseg = 1;
  e.seg[0] = rows_seg(L.gate, rows::kODual, nullptr, b.act, I, &L.up);
  e.seg[0].routed = 1;
  rows::proj(st, e);
  // the experts' downs (each slot's activations) and the shared expert's, then the combine into x
  rows::Args d;
  d.rows = M, d.in = static_cast<int32_t>(I), d.xmode = rows::kXBf16, d.ldx = I;
  d.E = static_cast<int32_t>(E), d.top_k = k, d.top_idx = b.top_idx, d.route_from_idx = 1;
  d.nseg = 2;
  d.seg[0] = rows_seg(L.down, rows::kOStore, b.yx, nullptr, H);
  d.seg[0].routed = 1, d.seg[0].xrouted = 1, d.seg[0].xb = b.act, d.seg[0].ldx = I;
  d.seg[1] = rows_seg(L.sh_down, rows::kOStore, b.ysh, nullptr, H);
  d.seg[1].xb = b.sact, d.seg[1].ldx = L.sh_down.p.in;
  if (L.sh_down.p.in != I) throw std::logic_error("[lily] cuda decode rows: the shared expert's width differs from I");
  rows::proj(st, d);
  rows::CombineArgs cb;
  cb.yx = b.yx, cb.ysh = b.ysh, cb.top_w = b.top_w, cb.sgate = b.sgate, cb.x = b.x;
  cb.M = M, cb.k = k, cb.H = static_cast<int32_t>(H);
  rows::moe_combine(st, cb);
  return 4;
}

int DecodeRowsLayers::head_greedy(const DLinear& lm_head, const float* final_norm, int M) const {
  const Config& c = *cfg;
  rows::Args a;
  a.rows = M, a.in = static_cast<int32_t>(c.hidden), a.xmode = rows::kXNorm, a.eps = c.rms_eps;
  a.xf = b.x, a.ldx = c.hidden, a.nw = final_norm, a.amax = b.amax;
  a.nseg = 1;
  a.seg[0] = rows_seg(lm_head, rows::kOStore, b.logits, nullptr, lm_head.p.out);
  const unsigned blocks = rows::proj(st, a);
  sample::argmax_from_block_keys(st, b.amax, static_cast<int>(blocks), b.tokens, M);
  return 2;
}

}  // namespace lily::cuda
