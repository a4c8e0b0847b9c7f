// lily._lily.cuda_ops, the decode GEMV family: the one-row launch (gemv_proj, gemv_moe_down) and the M-row one
// (gemv_rows, moe_combine_rows) of cuda/ops_table.h, numpy in / numpy out, behind bindings_cuda_front.h's front door
// (the module and the rest of its ops: bindings_cuda_ops.cpp). Built where the CUDA backend is.
#ifdef LILY_HAVE_CUDA
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <tuple>

#include "bindings_cuda_front.h"

namespace lily::cuda_ops_front {
namespace {

namespace ops = lily::cuda::ops;

// A segment dict's mode (0 store, 1 accumulate, 2 dual, 3 conv), routed flag and weights: w1 the dual segment's up,
// both stacked [E, out, cols] when routed.
struct SegmentWeights {
  int mode, routed;
  lily::Linear w0, w1;
};
SegmentWeights segment_weights(const char* op, const nb::dict& d, std::vector<Any>& keep) {
  SegmentWeights s;
  s.mode = nb::cast<int>(d["mode"]);
  s.routed = d.contains("routed") ? nb::cast<int>(d["routed"]) : 0;
  s.w0 = weight(op, "w0", d["w0"], s.routed != 0, keep);
  s.w1 = s.mode == 2 ? weight(op, "w1", d["w1"], s.routed != 0, keep) : s.w0;
  return s;
}


// proj(segments=[{w0, w1?, mode, routed?, slots?, y0?}], in_, ...): see the docstring at registration.
nb::dict gemv_proj(nb::list segments, int64_t in, int xmode, std::optional<U16> x, std::optional<F32> xf,
                   std::optional<F32> nw, double eps, bool h_out, std::optional<F32> route_logits, int top_k,
                   bool norm_topk, std::optional<F32> conv_w, std::optional<F32> conv_state, bool head) {
  const char* op = "gemv_proj";
  std::vector<Any> keep;
  std::vector<F32> keep32;
  ops::ProjCall c;
  c.xmode = xmode, c.in = in, c.eps = static_cast<float>(eps);
  if (x) c.xb = x->data(), check(op, "x", *x, {in});
  if (xf) c.xf = xf->data(), check(op, "xf", *xf, {in});
  if (nw) c.nw = nw->data(), check(op, "nw", *nw, {in});
  require(xmode == 0 ? c.xb != nullptr : c.xf != nullptr && c.nw != nullptr, op,
          "xmode 0 reads x (bf16 [in]), xmode 1 xf and nw (fp32 [in])");
  nb::dict res;
  std::vector<nb::object> ys;
  for (nb::handle h : segments) {
    nb::dict d = nb::borrow<nb::dict>(h);
    ops::ProjSegment s;
    const SegmentWeights sw = segment_weights(op, d, keep);
    s.mode = sw.mode, s.routed = sw.routed, s.w0 = sw.w0, s.w1 = sw.w1;
    s.slots = d.contains("slots") ? nb::cast<int>(d["slots"]) : 1;
    const int64_t n = int64_t{s.slots} * s.w0.out;
    if (d.contains("y0") && !d["y0"].is_none()) {
      keep32.push_back(nb::cast<F32>(d["y0"]));  // kept: a converted copy lives as long as its handle
      check(op, "y0", keep32.back(), {n});
      s.y0 = keep32.back().data();
    }
    if (s.mode == 0 || s.mode == 1) {
      auto [y, py] = out<float>({s.slots, s.w0.out});
      s.y = py, ys.push_back(y);
    } else if (s.mode == 2) {
      auto [y, py] = out<uint16_t>({s.slots, s.w0.out});
      s.yb = py, ys.push_back(y);
    } else {
      ys.push_back(nb::none());
    }
    c.segs.push_back(s);
  }
  if (h_out) {
    auto [h, ph] = out<uint16_t>({in});
    c.h_out = ph, res["h_out"] = h;
  }
  if (route_logits) {
    c.E = static_cast<int>(check(op, "route_logits", *route_logits, {-1})[0]);
    require(top_k >= 1 && top_k <= c.E, op, "top_k must be in 1 .. E");
    c.rlogits = route_logits->data(), c.top_k = top_k, c.norm_topk = norm_topk ? 1 : 0;
    auto [idx, pidx] = out<int32_t>({top_k});
    auto [w, pw] = out<float>({top_k});
    c.top_idx = pidx, c.top_w = pw, res["top_idx"] = idx, res["top_w"] = w;
  }
  if (conv_w) {
    require(conv_state.has_value() && !c.segs.empty() && c.segs[0].mode == 3, op,
            "the conv epilogue: segment 0 in mode 3, conv_w fp32 [C, K] and conv_state fp32 [K-1, C]");
    const std::vector<int64_t> cs = check(op, "conv_w", *conv_w, {c.segs[0].w0.out, -1});
    check(op, "conv_state", *conv_state, {cs[1] - 1, cs[0]});
    c.conv_w = conv_w->data(), c.conv_dim = static_cast<int>(cs[0]), c.conv_k = static_cast<int>(cs[1]);
    auto [st, pst] = copy_of(*conv_state);
    auto [u, pu] = out<float>({cs[0]});
    c.conv_state = pst, c.u = pu, res["conv_state"] = st, res["u"] = u;
  }
  std::vector<unsigned long long> amax;
  int32_t token = -1;
  if (head) c.head = true, c.amax = &amax, c.token = &token;
  const unsigned blocks = ops::gemv_proj(c);
  nb::list yl;
  for (auto& y : ys) yl.append(y);
  res["y"] = yl, res["blocks"] = blocks;
  if (head) {
    auto [keys, pk] = out<uint64_t>({static_cast<int64_t>(amax.size())});
    std::copy(amax.begin(), amax.end(), pk);
    res["amax"] = keys, res["token"] = token;
  }
  return res;
}

// gemv_rows(segments=[{w0, w1?, mode, y0?}], in_, x [M, in] | xf [M, in] + nw, ...): see the docstring at registration.
nb::dict gemv_rows(nb::list segments, int64_t in, int xmode, std::optional<U16> x, std::optional<F32> xf,
                   std::optional<F32> nw, double eps, bool h_out, bool head, std::optional<F32> conv_w,
                   std::optional<F32> conv_state, std::optional<F32> route_logits, int top_k, bool norm_topk,
                   std::optional<I32> top_idx) {
  const char* op = "gemv_rows";
  std::vector<Any> keep;  // (weights' converted copies)
  std::vector<F32> keep32;
  ops::RowsCall c;
  c.xmode = xmode, c.in = in, c.eps = static_cast<float>(eps);
  if (x) c.rows = static_cast<int>(check(op, "x", *x, {-1, in})[0]), c.xb = x->data();
  if (xf) c.rows = static_cast<int>(check(op, "xf", *xf, {-1, in})[0]), c.xf = xf->data();
  if (nw) c.nw = nw->data(), check(op, "nw", *nw, {in});
  require(xmode == 0 ? c.xb != nullptr : c.xf != nullptr && c.nw != nullptr, op,
          "xmode 0 reads x (bf16 [M, in]), xmode 1 xf (fp32 [M, in]) and nw (fp32 [in])");
  const int64_t M = c.rows;
  nb::dict res;
  if (route_logits) {
    c.E = static_cast<int>(check(op, "route_logits", *route_logits, {M, -1})[1]);
    require(top_k >= 1 && top_k <= c.E, op, "top_k must be 1 to E");
    c.rlogits = route_logits->data(), c.top_k = top_k, c.norm_topk = norm_topk ? 1 : 0;
    nb::object ti, tw;
    std::tie(ti, c.top_idx) = out<int32_t>({M, top_k});
    std::tie(tw, c.top_w) = out<float>({M, top_k});
    res["top_idx"] = ti, res["top_w"] = tw;
  }
  require(!(route_logits && top_idx), op, "route_logits (choose the experts) or top_idx (given), not both");
  if (top_idx) {
    top_k = static_cast<int>(check(op, "top_idx", *top_idx, {M, -1})[1]);
    c.route_idx = top_idx->data(), c.top_k = top_k;
  }
  std::vector<nb::object> ys;
  std::vector<U16> xs;  // (the segments' own inputs, kept)
  xs.reserve(segments.size());
  for (nb::handle h : segments) {
    nb::dict d = nb::borrow<nb::dict>(h);
    ops::RowsSegment s;
    const bool routed = d.contains("routed") && nb::cast<int>(d["routed"]) != 0;
    require(!routed || route_logits || top_idx, op,
            "a routed segment needs route_logits fp32 [M, E] and top_k, or top_idx int32 [M, k]");
    const SegmentWeights sw = segment_weights(op, d, keep);
    s.mode = sw.mode, s.routed = sw.routed, s.w0 = sw.w0, s.w1 = sw.w1;
    s.xrouted = d.contains("xrouted") ? nb::cast<int>(d["xrouted"]) : 0;
    if (d.contains("x") && !d["x"].is_none()) {
      xs.push_back(nb::cast<U16>(d["x"]));
      if (s.xrouted) check(op, "segment x", xs.back(), {M, top_k, in});
      else check(op, "segment x", xs.back(), {M, in});
      s.xb = xs.back().data();
    }
    if (s.routed && top_idx) {
      c.E = static_cast<int>(s.w0.experts);
      for (int64_t i = 0; i < M * top_k; ++i)
        require(top_idx->data()[i] >= 0 && top_idx->data()[i] < c.E, op, "top_idx out of range");
    }
    require(!s.routed || (s.w0.experts == c.E && s.w1.experts == c.E), op, "a routed segment's weights hold E experts");
    if (d.contains("y0") && !d["y0"].is_none())  // (kept: a converted copy lives as long as its handle)
      check(op, "y0", keep32.emplace_back(nb::cast<F32>(d["y0"])), {M, s.w0.out}), s.y0 = keep32.back().data();
    if (s.mode == 2 && s.routed) std::tie(ys.emplace_back(), s.yb) = out<uint16_t>({M, top_k, s.w0.out});
    else if (s.routed) std::tie(ys.emplace_back(), s.y) = out<float>({M, top_k, s.w0.out});
    else if (s.mode == 2) std::tie(ys.emplace_back(), s.yb) = out<uint16_t>({M, s.w0.out});
    else if (s.mode == 3) ys.emplace_back(nb::none());
    else std::tie(ys.emplace_back(), s.y) = out<float>({M, s.w0.out});
    if (s.mode == 3) {
      require(conv_w && conv_state, op, "a conv segment (mode 3) needs conv_w fp32 [C, K] and conv_state fp32 [K-1, C]");
      c.conv_dim = static_cast<int>(s.w0.out);
      c.conv_k = static_cast<int>(check(op, "conv_w", *conv_w, {s.w0.out, -1})[1]);
      check(op, "conv_state", *conv_state, {c.conv_k - 1, s.w0.out});
      c.conv_w = conv_w->data();
      nb::object st, u, hist;
      std::tie(st, c.conv_state) = copy_of(*conv_state);
      std::tie(u, c.u) = out<float>({M, s.w0.out});
      std::tie(hist, c.conv_hist) = out<float>({c.conv_k - 1 + M, s.w0.out});
      res["conv_state"] = st, res["u"] = u, res["conv_hist"] = hist;
    }
    c.segs.push_back(s);
  }
  std::vector<unsigned long long> amax;
  nb::object tokens = nb::none();
  if (head) c.amax = &amax, std::tie(tokens, c.tokens) = out<int32_t>({M});
  nb::object hh = nb::none();
  if (h_out) std::tie(hh, c.h_out) = out<uint16_t>({M, in});
  const unsigned blocks = ops::gemv_rows(c);
  nb::list yl;
  for (auto& y : ys) yl.append(y);
  res["y"] = yl, res["blocks"] = blocks, res["h_out"] = hh;
  if (head) {
    auto [keys, pk] = out<uint64_t>({static_cast<int64_t>(blocks), M});
    std::copy(amax.begin(), amax.end(), pk), res["amax"] = keys;
    res["tokens"] = tokens;
  }
  return res;
}

nb::object gemv_moe_down(const F32& x, const U16& act, const U16& sact, const I32& ids, const F32& w, double sgate,
                         nb::handle wd, nb::handle ws) {
  const char* op = "gemv_moe_down";
  std::vector<Any> keep;
  const lily::Linear Wd = weight(op, "wd", wd, true, keep), Ws = weight(op, "ws", ws, false, keep);
  const int64_t k = check(op, "ids", ids, {-1})[0];
  check(op, "w", w, {k});
  check(op, "act", act, {k, Wd.in});
  check(op, "sact", sact, {Ws.in});
  check(op, "x", x, {Wd.out});
  require(Ws.out == Wd.out, op, "wd and ws must have the same output rows");
  for (int64_t j = 0; j < k; ++j)
    require(ids.data()[j] >= 0 && ids.data()[j] < Wd.experts, op, "expert id out of range");
  auto [xo, px] = copy_of(x);
  ops::gemv_moe_down(Wd, Ws, act.data(), sact.data(), ids.data(), w.data(), static_cast<float>(sgate),
                     static_cast<int>(k), px);
  return xo;
}

bool gemv_fits(nb::handle w) {
  std::vector<Any> keep;
  return ops::gemv_fits(weight("gemv_fits", "w", w, false, keep));
}

nb::object moe_combine_rows(const F32& yx, std::optional<F32> ysh, const F32& top_w, std::optional<F32> sgate,
                            const F32& x) {
  const char* op = "moe_combine_rows";
  const std::vector<int64_t> s = check(op, "yx", yx, {-1, -1, -1});
  const int64_t M = s[0], k = s[1], H = s[2];
  check(op, "top_w", top_w, {M, k});
  check(op, "x", x, {M, H});
  require(M >= 1 && M <= 8 && k >= 1 && k <= 16, op, "M 1 to 8 rows and k 1 to 16 slots");
  if (ysh) check(op, "ysh", *ysh, {M, H}), require(sgate.has_value(), op, "ysh needs sgate [M]");
  if (sgate) check(op, "sgate", *sgate, {M});
  auto [xo, px] = copy_of(x);
  ops::moe_combine_rows(yx.data(), ysh ? ysh->data() : nullptr, top_w.data(), sgate ? sgate->data() : nullptr,
                        static_cast<int>(M), static_cast<int>(k), static_cast<int>(H), px);
  return xo;
}

bool gemv_rows_fits(nb::handle w) {
  std::vector<Any> keep;
  return ops::gemv_rows_fits(weight("gemv_rows_fits", "w", w, false, keep)); }

}  // namespace

void register_gemv_ops(nb::module_& m) {
  m.def("gemv_proj", &gemv_proj, "segments"_a, "in_"_a, "xmode"_a = 0, "x"_a = nb::none(), "xf"_a = nb::none(),
        "nw"_a = nb::none(), "eps"_a = 1e-6, "h_out"_a = false, "route_logits"_a = nb::none(), "top_k"_a = 0,
        "norm_topk"_a = true, "conv_w"_a = nb::none(), "conv_state"_a = nb::none(), "head"_a = false,
        "One decode GEMV launch. segments: dicts {w0, w1 (dual), mode (0 store, 1 accumulate onto y0, 2 dual, 3 conv), "
        "routed, slots, y0}; xmode 0: x bf16 [in], 1: RMSNorm of xf fp32 [in] with nw and eps (h_out: its bf16 row). "
        "route_logits fp32 [E] + top_k: the routing prologue; conv_w, conv_state: the conv epilogue of segment 0; "
        "head: the greedy head's block keys and token. -> dict(y=[per segment], blocks, h_out, top_idx, top_w, u, "
        "conv_state, amax, token)");
  m.def("gemv_moe_down", &gemv_moe_down, "x"_a, "act"_a, "sact"_a, "ids"_a, "w"_a, "sgate"_a, "wd"_a, "ws"_a,
        "x fp32 [H] + routed experts' down of act bf16 [k, I] + sigmoid(sgate) shared down of sact bf16 [Is]");
  m.def("gemv_rows", &gemv_rows, "segments"_a, "in_"_a, "xmode"_a = 0, "x"_a = nb::none(), "xf"_a = nb::none(),
        "nw"_a = nb::none(), "eps"_a = 1e-6, "h_out"_a = false, "head"_a = false, "conv_w"_a = nb::none(),
        "conv_state"_a = nb::none(), "route_logits"_a = nb::none(), "top_k"_a = 0, "norm_topk"_a = true,
        "top_idx"_a = nb::none(),
        "gemv_proj over M = 1..8 rows: x bf16 / xf fp32 [M, in], y0 and outputs [M, out], amax [blocks, M]; a conv "
        "segment (mode 3): conv_w fp32 [C, K], conv_state fp32 [K-1, C] -> u [M, C], conv_state, conv_hist [K-1+M, C]; "
        "a routed dual segment (routed=1, stacked experts): route_logits fp32 [M, E] + top_k -> y bf16 [M, top_k, out], "
        "top_idx, top_w [M, top_k]; the experts' down: a routed store segment with xrouted=1 and x bf16 [M, top_k, in], "
        "top_idx int32 [M, top_k] given -> y fp32 [M, top_k, out]; a segment's own rows: x bf16 [M, in]");
  m.def("moe_combine_rows", &moe_combine_rows, "yx"_a, "ysh"_a, "top_w"_a, "sgate"_a, "x"_a,
        "x fp32 [M, H] + sum_j top_w[m, j] yx[m, j] + sigmoid(sgate[m]) ysh[m]: yx [M, k, H], ysh [M, H] or None");
  m.def("gemv_rows_fits", &gemv_rows_fits, "w"_a, "whether the M-row decode GEMV takes this weight");
  m.def("gemv_fits", &gemv_fits, "w"_a, "whether the decode GEMV takes this weight");
  m.def("gemv_head_blocks", &ops::gemv_head_blocks, "rows"_a);
}

}  // namespace lily::cuda_ops_front
#endif  // LILY_HAVE_CUDA
