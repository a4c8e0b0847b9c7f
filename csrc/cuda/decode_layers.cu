// The fused decode sub-blocks of one token (decode_layers.cuh).
#include "cuda/decode_layers.cuh"

#include <cmath>
#include <stdexcept>

#include "cuda/attention.cuh"
#include "cuda/deltanet.cuh"

namespace lily::cuda {

kp::DeltaNetParams deltanet_params(const Config& cfg, int64_t S) {
  return {cfg.deltanet_k_heads, cfg.deltanet_v_heads, cfg.deltanet_k_dim, cfg.deltanet_v_dim, cfg.conv_kernel,
          cfg.conv_dim(),       cfg.rms_eps,          1e-6f,              S};
}

kp::AttentionParams attention_params(const Config& cfg, int64_t pos0, int64_t S) {
  return {cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rotary_dim, static_cast<float>(cfg.rope_theta),
          cfg.rms_eps, 1.f / std::sqrt(static_cast<float>(cfg.head_dim)), 0, pos0, S};
}

gemv::Seg decode_seg(const DLinear& w, int mode, float* y, bf16* yb) {
  gemv::Seg g;
  g.w0 = g.w1 = w;
  g.mode = mode;
  g.y = y;
  g.yb = yb;
  return g;
}

gemv::ProjArgs DecodeLayers::norm_args(const float* w) const {
  gemv::ProjArgs a;
  a.xmode = gemv::kXNorm;
  a.in = cfg->hidden;
  a.eps = cfg->rms_eps;
  a.xf = b.x;
  a.nw = w;
  return a;
}

// x += DeltaNet(RMSNorm(x)): [norm + qkv/z/b/a + conv] -> [scan + gated norm] -> [out + residual].
int DecodeLayers::deltanet(const DeviceLayer& L, DeltaNetState& s) const {
  namespace d = gemv;
  d::ProjArgs a = norm_args(L.in_norm);
  a.nseg = 4;
  a.seg[0] = decode_seg(L.qkv, d::kOConv, nullptr);
  a.seg[1] = decode_seg(L.z, d::kOStore, b.z);
  a.seg[2] = decode_seg(L.b, d::kOStore, b.b);
  a.seg[3] = decode_seg(L.a, d::kOStore, b.a);
  a.conv_w = L.conv_w;
  a.conv_state = s.conv.as<float>();
  a.u = b.u;
  a.conv_dim = cfg->conv_dim();
  a.conv_k = cfg->conv_kernel;
  d::proj(st, a);
  deltanet_step(st, deltanet_params(*cfg, 1), b.u, b.b, b.a, L.dt_bias, L.a_log, s.ssm.as<float>(), b.y, b.z,
                L.deltanet_norm, b.yb, b.head_done);
  d::ProjArgs o;
  o.nseg = 1;
  o.xmode = d::kXBf16;
  o.in = cfg->value_dim();
  o.xb = b.yb;
  o.seg[0] = decode_seg(L.out, d::kOAccum, b.x);
  d::proj(st, o);
  return 3;
}

// x += Attention(RMSNorm(x)) at the control block's position: [norm + q/k/v] -> prep (q/k norm, RoPE, cache append)
// -> attention (+ split combine) -> [o + residual].
int DecodeLayers::attention(const DeviceLayer& L, KVCache& kv, const int32_t* dpos, int split_k, int gqa_pack) const {
  namespace d = gemv;
  d::ProjArgs a = norm_args(L.in_norm);
  a.nseg = 3;
  a.seg[0] = decode_seg(L.q, d::kOStore, b.qg);
  a.seg[1] = decode_seg(L.k, d::kOStore, b.k);
  a.seg[2] = decode_seg(L.v, d::kOStore, b.v);
  d::proj(st, a);
  const kp::AttentionParams p = attention_params(*cfg, 0, 1);
  attention_prep(st, p, b.qg, b.k, b.v, L.q_norm, L.k_norm, b.q, kv.k.as<bf16>(), kv.v.as<bf16>(), dpos);
  // Split count fixed by the capacity (a step is recorded per capacity); split length follows the position.
  kp::AttentionParams cap = p;
  cap.pos0 = kv.capacity - 1;
  kp::AttnSplitParams sp = attention_plan(cap, sm_count);
  if (!split_k) sp.n_splits = 1;          // ablation: one block per (row tile, KV head) reads every key
  if (!gqa_pack) sp.heads_per_block = 1;  // ablation: one query head per block (the CUDA-core kernel)
  if (sp.n_splits > b.max_splits) throw std::logic_error("[lily] cuda decode: attention split count");
  cuda::attention(st, p, sp, b.q, b.qg, kv.k.as<bf16>(), kv.v.as<bf16>(), b.part, b.ob, dpos,
                  /*tensor_core_decode=*/gqa_pack != 0);  // the tensor-core kernel always packs 8 heads
  d::ProjArgs o;
  o.nseg = 1;
  o.xmode = d::kXBf16;
  o.in = cfg->n_heads * cfg->head_dim;
  o.xb = b.ob;
  o.seg[0] = decode_seg(L.o, d::kOAccum, b.x);
  d::proj(st, o);
  return 5;
}

// x += MoE(RMSNorm(x)): [norm + router + shared gate/up + shared gate] -> [routing + experts' gate/up] -> [experts'
// down + shared down + combine + residual].
int DecodeLayers::moe(const DeviceLayer& L) const {
  namespace d = gemv;
  const int k = cfg->top_k;
  d::ProjArgs a = norm_args(L.post_norm);
  a.h_out = b.h;
  a.nseg = 3;
  a.seg[0] = decode_seg(L.router, d::kOStore, b.router);
  a.seg[1] = decode_seg(L.sh_gate, d::kODual, nullptr, b.sact);
  a.seg[1].w1 = L.sh_up;
  a.seg[2] = decode_seg(L.sh_expert_gate, d::kOStore, b.sgate);
  d::proj(st, a);
  d::ProjArgs e;
  e.nseg = 1;
  e.xmode = d::kXBf16;
  e.in = cfg->hidden;
  e.xb = b.h;
  e.route = 1;
  e.rlogits = b.router;
  e.E = cfg->n_experts;
  e.top_k = k;
  e.norm_topk = cfg->norm_topk_prob ? 1 : 0;
  e.top_idx = b.top_idx;
  e.top_w = b.top_w;
  e.seg[0] = decode_seg(L.gate, d::kODual, nullptr, b.act);
  e.seg[0].w1 = L.up;
  e.seg[0].routed = 1;
  e.seg[0].slots = k;
  e.seg[0].y_step = cfg->moe_inter;
  d::proj(st, e);
  d::DownArgs dn;
  dn.wd = L.down;
  dn.ws = L.sh_down;
  dn.act = b.act;
  dn.sact = b.sact;
  dn.top_idx = b.top_idx;
  dn.top_w = b.top_w;
  dn.sgate = b.sgate;
  dn.x = b.x;
  dn.k = k;
  d::moe_down(st, dn);
  return 3;
}

}  // namespace lily::cuda
