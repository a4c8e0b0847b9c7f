// The CUDA op table (ops_table.h), attention and decode side: q/k prep and attention (prefill, CUDA-core and
// tensor-core decode), the decode GEMV (proj with its prologues and epilogues, the MoE down), the device sampler.
#include "cuda/attention.cuh"
#include "cuda/gemv.cuh"
#include "cuda/gemv_rows.cuh"
#include "cuda/ops_table_dev.cuh"
#include "cuda/sample.cuh"

namespace lily::cuda::ops {

namespace {

// The launch's parameters and device position: with dpos the position lives on the device and the launch's pos0 is 0
// (as in the decode step, decode_layers.cu), so a kernel that read p.pos0 instead would be caught.
struct Position {
  kp::AttentionParams p;
  const int32_t* dpos = nullptr;
  Position(Dev& dv, const kp::AttentionParams& p_, bool on) : p(p_) {
    if (!on) return;
    const int32_t pos = static_cast<int32_t>(p_.pos0);
    dpos = dv.put(&pos, 1);
    p.pos0 = 0;
  }
};

kp::AttnSplitParams plan_of(const kp::AttentionParams& p, int64_t plan_pos0) {
  kp::AttentionParams pp = p;
  if (plan_pos0 >= 0) pp.pos0 = plan_pos0;
  return attention_plan(pp, sm_count());
}

}  // namespace

void attention_prep(const kp::AttentionParams& p, const float* qg, const float* k, const float* v, const float* q_norm,
                    const float* k_norm, int64_t cap, bool dpos, float* q, uint16_t* k_cache, uint16_t* v_cache) {
  const int64_t D = p.head_dim, kvr = p.n_kv_heads * D, nq = p.S * p.n_heads * D;
  Dev dv;
  float* dq = dv.alloc<float>(nq);
  uint16_t* dkc = dv.put(k_cache, cap * kvr);
  uint16_t* dvc = dv.put(v_cache, cap * kvr);
  const Position pos(dv, p, dpos);
  cuda::attention_prep(kStream, pos.p, dv.put(qg, 2 * nq), dv.put(k, p.S * kvr), dv.put(v, p.S * kvr),
                       dv.put(q_norm, D), dv.put(k_norm, D), dq, as_bf16(dkc), as_bf16(dvc), pos.dpos);
  finish("attention_prep");
  get(q, dq, nq);
  get(k_cache, dkc, cap * kvr);
  get(v_cache, dvc, cap * kvr);
}

void attention(const kp::AttentionParams& p, const float* q, const float* qg, const uint16_t* k_cache,
               const uint16_t* v_cache, int64_t cap, int64_t plan_pos0, bool tc_decode, bool wgmma, bool dpos,
               uint16_t* o) {
  const int64_t D = p.head_dim, kvr = p.n_kv_heads * D, nq = p.S * p.n_heads * D;
  kp::AttentionParams plan_p = p;  // rows of the decode step (dpos): the one-row plan, as every row runs it
  if (dpos) plan_p.S = 1;
  const kp::AttnSplitParams sp = plan_of(plan_p, plan_pos0);
  Dev dv;
  float* part = dv.alloc<float>(p.S * p.n_heads * sp.n_splits * (D + 2));
  uint16_t* dout = dv.alloc<uint16_t>(nq);
  const Position pos(dv, p, dpos);
  cuda::attention(kStream, pos.p, sp, dv.put(q, nq), dv.put(qg, 2 * nq), as_bf16(dv.put(k_cache, cap * kvr)),
                  as_bf16(dv.put(v_cache, cap * kvr)), part, as_bf16(dout), pos.dpos, tc_decode, wgmma);
  finish("attention");
  get(o, dout, nq);
}

int attention_splits(const kp::AttentionParams& p, int64_t plan_pos0) { return plan_of(p, plan_pos0).n_splits; }
bool attention_wgmma_supported(const kp::AttentionParams& p) { return cuda::attention_wgmma_supported(p); }
bool attention_decode_tc_supported(const kp::AttentionParams& p) { return cuda::attention_decode_tc_supported(p); }

unsigned gemv_proj(const ProjCall& c) {
  namespace g = gemv;
  const int nseg = static_cast<int>(c.segs.size());
  if (nseg < 1 || nseg > g::kMaxSegs) throw std::invalid_argument("[cuda_ops.gemv_proj] 1 to 4 segments");
  Dev dv;
  g::ProjArgs a;
  a.nseg = nseg;
  a.xmode = c.xmode;
  a.in = static_cast<int32_t>(c.in);
  a.eps = c.eps;
  a.xb = as_bf16(dv.put(c.xb, c.in));
  a.xf = dv.put(c.xf, c.in);
  a.nw = dv.put(c.nw, c.in);
  uint16_t* dh = c.h_out ? dv.alloc<uint16_t>(c.in) : nullptr;
  a.h_out = dh ? as_bf16(dh) : nullptr;
  if (c.top_k > 0) {
    a.route = 1, a.E = c.E, a.top_k = c.top_k, a.norm_topk = c.norm_topk;
    a.rlogits = dv.put(c.rlogits, c.E);
    a.top_idx = dv.alloc<int32_t>(c.top_k);
    a.top_w = dv.alloc<float>(c.top_k);
  }
  const int64_t nstate = static_cast<int64_t>(c.conv_k - 1) * c.conv_dim;
  if (c.conv_w) {
    a.conv_w = dv.put(c.conv_w, static_cast<int64_t>(c.conv_dim) * c.conv_k);
    a.conv_state = dv.put(c.conv_state, nstate);
    a.u = dv.alloc<float>(c.conv_dim);
    a.conv_dim = c.conv_dim, a.conv_k = c.conv_k;
  }
  int64_t rows = 0;
  for (int s = 0; s < nseg; ++s) {
    const ProjSegment& sg = c.segs[s];
    g::Seg& d = a.seg[s];
    d.w0 = dv.linear(sg.w0);
    d.w1 = sg.mode == g::kODual ? dv.linear(sg.w1) : d.w0;
    d.mode = sg.mode, d.routed = sg.routed, d.slots = sg.slots;
    d.y_step = sg.slots > 1 ? sg.w0.out : 0;  // slot j's outputs at j * out (decode_layers.cu's routed experts)
    const int64_t n = sg.slots * sg.w0.out;
    if (sg.mode == g::kOStore || sg.mode == g::kOAccum) d.y = sg.y0 ? dv.put(sg.y0, n) : dv.alloc<float>(n);
    if (sg.mode == g::kODual) d.yb = as_bf16(dv.alloc<uint16_t>(n));
    rows += n;
  }
  unsigned long long* damax = nullptr;
  if (c.head) {
    damax = dv.alloc<unsigned long long>(g::head_blocks(rows));  // all-ones: a block that writes no key shows
    a.amax = damax;
  }
  const unsigned nb = g::proj(kStream, a);
  int32_t* dtok = nullptr;
  if (c.head && c.token) {
    dtok = dv.alloc<int32_t>(1);
    sample::argmax_from_block_keys(kStream, damax, static_cast<int>(nb), dtok);
  }
  finish("gemv_proj");
  for (int s = 0; s < nseg; ++s) {
    const ProjSegment& sg = c.segs[s];
    const int64_t n = sg.slots * sg.w0.out;
    if (a.seg[s].y) get(sg.y, a.seg[s].y, n);
    if (a.seg[s].yb) get(sg.yb, reinterpret_cast<const uint16_t*>(a.seg[s].yb), n);
  }
  get(c.h_out, dh, c.in);
  if (c.top_k > 0) get(c.top_idx, a.top_idx, c.top_k), get(c.top_w, a.top_w, c.top_k);
  if (c.conv_w) get(c.u, a.u, c.conv_dim), get(c.conv_state, a.conv_state, nstate);
  if (c.head && c.amax) {
    c.amax->resize(nb);
    get(c.amax->data(), damax, nb);
  }
  if (dtok) get(c.token, dtok, 1);
  return nb;
}

void gemv_moe_down(const Linear& wd, const Linear& ws, const uint16_t* act, const uint16_t* sact, const int32_t* ids,
                   const float* w, float sgate, int k, float* x) {
  Dev dv;
  gemv::DownArgs a;
  a.wd = dv.linear(wd);
  a.ws = dv.linear(ws);
  a.act = as_bf16(dv.put(act, static_cast<int64_t>(k) * wd.in));
  a.sact = as_bf16(dv.put(sact, ws.in));
  a.top_idx = dv.put(ids, k);
  a.top_w = dv.put(w, k);
  a.sgate = dv.put(&sgate, 1);
  float* dx = dv.put(x, wd.out);
  a.x = dx;
  a.k = k;
  gemv::moe_down(kStream, a);
  finish("gemv_moe_down");
  get(x, dx, wd.out);
}

bool gemv_fits(const Linear& w) {
  DLinear d;
  d.p = linear_params(w);  // fits reads the parameters only
  return gemv::fits(d);
}

int64_t gemv_head_blocks(int64_t rows) { return gemv::head_blocks(rows); }

unsigned gemv_rows(const RowsCall& c) {
  namespace r = rows;
  const int nseg = static_cast<int>(c.segs.size());
  if (nseg < 1 || nseg > r::kMaxSegs) throw std::invalid_argument("[cuda_ops.gemv_rows] 1 to 4 segments");
  const int64_t M = c.rows, nx = M * c.in;
  Dev dv;
  r::Args a;
  a.nseg = nseg, a.rows = c.rows, a.xmode = c.xmode, a.in = static_cast<int32_t>(c.in), a.eps = c.eps, a.ldx = c.in;
  a.xb = as_bf16(dv.put(c.xb, nx));
  a.xf = dv.put(c.xf, nx);
  a.nw = dv.put(c.nw, c.in);
  uint16_t* dh = c.h_out ? dv.alloc<uint16_t>(nx) : nullptr;
  a.h_out = dh ? as_bf16(dh) : nullptr;
  for (int s = 0; s < nseg; ++s) {
    const RowsSegment& sg = c.segs[s];
    r::Seg& d = a.seg[s];
    d.w0 = dv.linear(sg.w0);
    d.w1 = sg.mode == r::kODual ? dv.linear(sg.w1) : d.w0;
    d.mode = sg.mode, d.ldy = sg.w0.out, d.routed = sg.routed, d.xrouted = sg.xrouted;
    const int64_t n = M * sg.w0.out * (sg.routed ? c.top_k : 1);
    if (sg.xb) d.xb = as_bf16(dv.put(sg.xb, M * c.in * (sg.xrouted ? c.top_k : 1))), d.ldx = c.in;
    if (sg.mode == r::kODual) d.yb = as_bf16(dv.alloc<uint16_t>(n));
    else if (sg.mode != r::kOConv) d.y = sg.y0 ? dv.put(sg.y0, n) : dv.alloc<float>(n);
  }
  unsigned long long* damax = nullptr;
  if (c.amax) a.amax = damax = dv.alloc<unsigned long long>(r::head_blocks(c.segs[0].w0.out) * M);
  const int64_t nstate = static_cast<int64_t>(c.conv_k - 1) * c.conv_dim, nu = M * c.conv_dim, nk = M * c.top_k;
  if (c.route_idx) {
    a.E = c.E, a.top_k = c.top_k, a.route_from_idx = 1;
    a.top_idx = dv.put(c.route_idx, nk);
  }
  if (c.rlogits) {
    a.rlogits = dv.put(c.rlogits, M * c.E);
    a.E = c.E, a.top_k = c.top_k, a.norm_topk = c.norm_topk;
    a.top_idx = dv.alloc<int32_t>(nk);
    a.top_w = dv.alloc<float>(nk);
  }
  if (c.conv_w) {
    a.conv_w = dv.put(c.conv_w, static_cast<int64_t>(c.conv_dim) * c.conv_k);
    a.conv_state = dv.put(c.conv_state, nstate);
    a.u = dv.alloc<float>(nu);
    a.conv_hist = dv.alloc<float>(nstate + nu);
    a.conv_k = c.conv_k;
  }
  const unsigned nb = r::proj(kStream, a);
  finish("gemv_rows");
  if (c.rlogits) get(c.top_idx, a.top_idx, nk), get(c.top_w, a.top_w, nk);
  for (int s = 0; s < nseg; ++s) {
    const int64_t n = M * c.segs[s].w0.out * (c.segs[s].routed ? c.top_k : 1);
    if (a.seg[s].y) get(c.segs[s].y, a.seg[s].y, n);
    if (a.seg[s].yb) get(c.segs[s].yb, reinterpret_cast<const uint16_t*>(a.seg[s].yb), n);
  }
  get(c.h_out, dh, nx);
  if (c.conv_w) get(c.u, a.u, nu), get(c.conv_state, a.conv_state, nstate), get(c.conv_hist, a.conv_hist, nstate + nu);
  if (c.amax) {
    int32_t* dtok = dv.alloc<int32_t>(M);
    sample::argmax_from_block_keys(kStream, damax, static_cast<int>(nb), dtok, static_cast<int>(M));
    finish("gemv_rows argmax");
    if (c.tokens) get(c.tokens, dtok, M);
    c.amax->resize(static_cast<size_t>(nb) * M);
    get(c.amax->data(), damax, static_cast<int64_t>(nb) * M);
  }
  return nb;
}

void moe_combine_rows(const float* yx, const float* ysh, const float* top_w, const float* sgate, int M, int k, int H,
                      float* x) {
  Dev dv;
  rows::CombineArgs a;
  a.M = M, a.k = k, a.H = H;
  a.yx = dv.put(yx, static_cast<int64_t>(M) * k * H);
  a.ysh = ysh ? dv.put(ysh, static_cast<int64_t>(M) * H) : nullptr;
  a.top_w = dv.put(top_w, static_cast<int64_t>(M) * k);
  a.sgate = sgate ? dv.put(sgate, M) : nullptr;
  float* dx = dv.put(x, static_cast<int64_t>(M) * H);
  a.x = dx;
  rows::moe_combine(kStream, a);
  finish("moe_combine_rows");
  get(x, dx, static_cast<int64_t>(M) * H);
}

bool gemv_rows_fits(const Linear& w) {
  DLinear d;
  d.p = linear_params(w);
  return rows::fits(d);
}


int32_t sample_launch(const float* logits, int32_t V, const SampleOptions& o, uint8_t* seen, int32_t* counts,
                      int64_t guard, float uniform, float* x_out, float* logits_after) {
  if (o.bias_ids.size() != o.bias_vals.size())
    throw std::invalid_argument("[cuda_ops.sample_launch] bias_ids and bias_vals differ in length");
  Dev dv;
  const sample::Options opt = sample::options_of(o);
  sample::Args a;
  a.logits = dv.put(logits, V);
  a.x = dv.alloc<float>(V + guard);
  a.work = dv.alloc<float>(sample::workspace_floats(V));  // NaN: partials read before they are written show
  a.opt = dv.put(&opt, 1);
  a.bias_ids = o.bias_ids.empty() ? nullptr : dv.put(o.bias_ids);
  a.bias_vals = o.bias_vals.empty() ? nullptr : dv.put(o.bias_vals);
  uint8_t* dseen = dv.put(seen, V + guard);
  int32_t* dcounts = dv.put(counts, V + guard);
  a.seen = dseen;
  a.counts = dcounts;
  a.uniform = dv.put(&uniform, 1);
  int32_t* dtok = dv.alloc<int32_t>(1);
  a.token = dtok;
  a.vocab = V;
  sample::launch(kStream, a);
  finish("sample_launch");
  int32_t token = -1;
  get(&token, dtok, 1);
  get(x_out, a.x, V + guard);
  get(seen, dseen, V + guard);
  get(counts, dcounts, V + guard);
  get(logits_after, a.logits, V);
  return token;
}

int32_t sample_draw(const float* logits, int32_t V, const SampleOptions& o, float uniform) {
  sample::DeviceSampler sampler;  // declared first: its buffers outlive the draw's
  sampler.begin(kStream, o, V);
  Dev dv;
  int32_t* dtok = dv.alloc<int32_t>(1);
  sampler.draw(kStream, dv.put(logits, V), dv.put(&uniform, 1), dtok);
  finish("sample_draw");
  int32_t token = -1;
  get(&token, dtok, 1);
  return token;
}

}  // namespace lily::cuda::ops
