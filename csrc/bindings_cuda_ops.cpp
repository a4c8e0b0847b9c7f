// lily._lily.cuda_ops: the CUDA op table (cuda/ops_table.h) for the kernel tests (tests/kernels/ops_cuda.py and
// test_cuda_*.py), numpy in / numpy out. A binding file like bindings.cpp (the decode GEMV family's ops:
// bindings_cuda_gemv.cpp; the front door both use: bindings_cuda_front.h); built where the CUDA backend is. Every op checks shapes and dtypes at the front door ("[cuda_ops.OP] ..."), then
// runs the product's launch functions; outputs come back with the kernels' NaN / -1 poison wherever they wrote nothing.
// Weights travel as tuples w = (weight, scales, biases, bits, group) in the checkpoint formats of lily.quant: bits 4/8
// with codes uint32 [E?, out, in*bits/32] and bf16 (uint16) scales / biases [E?, out, in/group], or bits 0 with dense
// bf16 (uint16) or float32 [E?, out, in] and scales = biases = None. bf16 activations are uint16 bit patterns.
// Built into every extension; without LILY_HAVE_CUDA (no nvcc at build time) register_cuda_ops adds nothing.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace nb = nanobind;

#ifndef LILY_HAVE_CUDA
void register_cuda_ops(nb::module_&) {}
#else
#include "bindings_cuda_front.h"

using namespace nb::literals;
namespace ops = lily::cuda::ops;
namespace kp = lily::kp;

namespace {

using namespace lily::cuda_ops_front;

// ---- norm / linear ----

nb::object embed(const I32& ids, nb::handle w) {
  std::vector<Any> keep;
  const lily::Linear E = weight("embed", "w", w, false, keep);
  const int64_t S = check("embed", "ids", ids, {-1})[0];
  for (int64_t s = 0; s < S; ++s) require(ids.data()[s] >= 0 && ids.data()[s] < E.out, "embed", "id out of range");
  auto [x, px] = out<float>({S, E.in});
  ops::embed(E, ids.data(), S, px);
  return x;
}

nb::object rms_norm(const F32& x, const F32& w, double eps, int x_offset, bool fp32) {
  const int64_t n = check("rms_norm", "w", w, {-1})[0];
  const int64_t rows = check("rms_norm", "x", x, {-1, n})[0];
  require(x_offset >= 0 && x_offset < 64, "rms_norm", "x_offset in 0 .. 63");
  require(!fp32 || x_offset == 0, "rms_norm", "fp32 output takes x_offset 0");
  if (fp32) {
    auto [y, py] = out<float>({rows, n});
    ops::rms_norm_f32(x.data(), w.data(), static_cast<float>(eps), rows, n, py);
    return y;
  }
  auto [y, py] = out<uint16_t>({rows, n});
  ops::rms_norm(x.data(), w.data(), static_cast<float>(eps), rows, n, x_offset, py);
  return y;
}

nb::object linear(const U16& x, nb::handle w, std::optional<F32> y0, int64_t ldy, int impl, int sb_offset) {
  std::vector<Any> keep;
  const lily::Linear W = weight("linear", "w", w, false, keep);
  const std::vector<int64_t> s = check("linear", "x", x, {-1, -1});
  require(s[1] >= W.in, "linear", "x rows must hold in = " + std::to_string(W.in) + " values (a longer row: padded)");
  if (ldy == 0) ldy = W.out;
  require(ldy >= W.out, "linear", "ldy must be >= out");
  if (y0) check("linear", "y0", *y0, {s[0], ldy});
  auto [y, py] = out<float>({s[0], ldy});
  ops::linear(W, x.data(), s[0], s[1], y0 ? y0->data() : nullptr, ldy, impl, sb_offset, py);
  return y;
}

nb::object linear_silu_mul(const U16& x, nb::handle w0, nb::handle w1, int64_t ldy, int impl, int sb_offset) {
  std::vector<Any> keep;
  const lily::Linear W0 = weight("linear_silu_mul", "w0", w0, false, keep);
  const lily::Linear W1 = weight("linear_silu_mul", "w1", w1, false, keep);
  require(W1.out == W0.out && W1.in == W0.in && W1.kind == W0.kind, "linear_silu_mul", "w0 and w1 differ");
  const std::vector<int64_t> s = check("linear_silu_mul", "x", x, {-1, -1});
  require(s[1] >= W0.in, "linear_silu_mul", "x rows must hold in values");
  if (ldy == 0) ldy = W0.out;
  require(ldy >= W0.out, "linear_silu_mul", "ldy must be >= out");
  auto [y, py] = out<uint16_t>({s[0], ldy});
  ops::linear_silu_mul(W0, W1, x.data(), s[0], s[1], ldy, impl, sb_offset, py);
  return y;
}

nb::list linear_concat(const U16& x, nb::handle w, std::vector<int64_t> rows, std::vector<int64_t> pads,
                       bool concatenated) {
  std::vector<Any> keep;
  const lily::Linear W = weight("linear_concat", "w", w, false, keep);
  const int64_t S = check("linear_concat", "x", x, {-1, W.in})[0];
  require(pads.size() == rows.size(), "linear_concat", "one pad per part");
  std::vector<int64_t> ldy;
  std::vector<float*> ys;
  nb::list res;
  for (size_t i = 0; i < rows.size(); ++i) {
    ldy.push_back(rows[i] + pads[i]);
    auto [y, py] = out<float>({S, ldy.back()});
    res.append(y);
    ys.push_back(py);
  }
  ops::linear_concat(W, rows, ldy, concatenated, x.data(), S, ys);
  return res;
}

nb::tuple grouped(const U16& h, const U16& act_in, nb::handle w0, nb::handle w1, nb::handle w2,
                  const I32& tile_expert, const I32& tile_row0, const I32& tile_rows, int n_tiles, const I32& a_rows,
                  const I32& y_rows, const F32& scale, int tile, int impl) {
  const char* op = "grouped";
  std::vector<Any> keep;
  const lily::Linear W0 = weight(op, "w0", w0, true, keep), W1 = weight(op, "w1", w1, true, keep),
                     W2 = weight(op, "w2", w2, true, keep);
  const int64_t S = check(op, "h", h, {-1, W0.in})[0];
  const int64_t P = check(op, "a_rows", a_rows, {-1})[0];
  check(op, "y_rows", y_rows, {P});
  check(op, "scale", scale, {P});
  check(op, "act_in", act_in, {P, W2.in});
  const int64_t mt = check(op, "tile_expert", tile_expert, {-1})[0];
  check(op, "tile_row0", tile_row0, {mt});
  check(op, "tile_rows", tile_rows, {mt});
  require(n_tiles >= 0 && n_tiles <= mt, op, "n_tiles must be within the tile map");
  for (int t = 0; t < n_tiles; ++t)
    require(tile_row0.data()[t] >= 0 && tile_rows.data()[t] >= 1 && tile_rows.data()[t] <= tile &&
                tile_row0.data()[t] + tile_rows.data()[t] <= P && tile_expert.data()[t] >= 0 &&
                tile_expert.data()[t] < W0.experts,
            op, "tile " + std::to_string(t) + " is outside the pairs or experts");
  for (int64_t p = 0; p < P; ++p)
    require(a_rows.data()[p] >= 0 && a_rows.data()[p] < S && y_rows.data()[p] >= 0 && y_rows.data()[p] < P, op,
            "a_rows / y_rows out of range");
  const ops::HostTileMap map{n_tiles, mt, tile_expert.data(), tile_row0.data(), tile_rows.data()};
  auto [act, pact] = out<uint16_t>({P, W0.out});
  auto [d, pd] = out<uint16_t>({P, W2.out});
  ops::grouped(W0, W1, W2, map, P, a_rows.data(), y_rows.data(), scale.data(), h.data(), S, act_in.data(), tile, impl,
               pact, pd);
  return nb::make_tuple(act, d);
}

nb::object experts_gate_up(const U16& x, nb::handle w0, nb::handle w1, const I32& ids) {
  std::vector<Any> keep;
  const lily::Linear W0 = weight("experts_gate_up", "w0", w0, true, keep);
  const lily::Linear W1 = weight("experts_gate_up", "w1", w1, true, keep);
  check("experts_gate_up", "x", x, {W0.in});
  const int64_t k = check("experts_gate_up", "ids", ids, {-1})[0];
  for (int64_t j = 0; j < k; ++j)
    require(ids.data()[j] >= 0 && ids.data()[j] < W0.experts, "experts_gate_up", "expert id out of range");
  auto [act, pact] = out<uint16_t>({k, W0.out});
  ops::experts_gate_up(W0, W1, ids.data(), static_cast<int>(k), x.data(), pact);
  return act;
}

nb::object experts_down(const U16& act_in, nb::handle w2, const I32& ids, const F32& w) {
  std::vector<Any> keep;
  const lily::Linear W2 = weight("experts_down", "w2", w2, true, keep);
  const int64_t k = check("experts_down", "ids", ids, {-1})[0];
  check("experts_down", "w", w, {k});
  check("experts_down", "act_in", act_in, {k, W2.in});
  for (int64_t j = 0; j < k; ++j)
    require(ids.data()[j] >= 0 && ids.data()[j] < W2.experts, "experts_down", "expert id out of range");
  auto [d, pd] = out<uint16_t>({k, W2.out});
  ops::experts_down(W2, ids.data(), w.data(), static_cast<int>(k), act_in.data(), pd);
  return d;
}

// ---- MoE ----

kp::MoeParams moe_params(int64_t S, int64_t E, int top_k, bool norm, int64_t H = 0, int64_t I = 0) {
  return kp::MoeParams{static_cast<int32_t>(H), static_cast<int32_t>(E), top_k, static_cast<int32_t>(I), 0,
                       norm ? 1 : 0, S};
}

nb::tuple moe_route(const F32& logits, int top_k, bool norm_topk_prob) {
  const std::vector<int64_t> s = check("moe_route", "logits", logits, {-1, -1});
  require(top_k >= 1 && top_k <= s[1], "moe_route", "top_k must be in 1 .. E");
  auto [ids, pids] = out<int32_t>({s[0], top_k});
  auto [w, pw] = out<float>({s[0], top_k});
  ops::moe_route(moe_params(s[0], s[1], top_k, norm_topk_prob), logits.data(), pids, pw);
  return nb::make_tuple(ids, w);
}

nb::dict moe_sort(const I32& top_idx, const F32& top_w, int n_experts, int tile_rows) {
  const std::vector<int64_t> s = check("moe_sort", "top_idx", top_idx, {-1, -1});
  check("moe_sort", "top_w", top_w, s);
  for (size_t i = 0; i < top_idx.size(); ++i)
    require(top_idx.data()[i] >= 0 && top_idx.data()[i] < n_experts, "moe_sort", "expert id out of range");
  const kp::MoeParams p = moe_params(s[0], n_experts, static_cast<int>(s[1]), true);
  const int64_t P = s[0] * s[1], mt = ops::moe_sort_max_tiles(p, tile_rows);
  auto [row, prow] = out<int32_t>({P});
  auto [id, pid] = out<int32_t>({P});
  auto [w, pw] = out<float>({P});
  auto [nt, pnt] = out<int32_t>({1});
  auto [te, pte] = out<int32_t>({mt});
  auto [t0, pt0] = out<int32_t>({mt});
  auto [tr, ptr] = out<int32_t>({mt});
  ops::moe_sort(p, top_idx.data(), top_w.data(), tile_rows, ops::HostSort{prow, pid, pw, pnt, pte, pt0, ptr});
  nb::dict d;
  d["pair_row"] = row, d["pair_id"] = id, d["pair_w"] = w, d["n_tiles"] = nt;
  d["tile_expert"] = te, d["tile_row0"] = t0, d["tile_rows"] = tr;
  return d;
}

nb::object moe_experts(const U16& h, const I32& top_idx, const F32& top_w, nb::handle gate, nb::handle up,
                       nb::handle down, int tile_rows, bool host_count) {
  const char* op = "moe_experts";
  std::vector<Any> keep;
  const lily::Linear G = weight(op, "gate", gate, true, keep), U = weight(op, "up", up, true, keep),
                     D = weight(op, "down", down, true, keep);
  require(U.experts == G.experts && U.out == G.out && U.in == G.in && D.experts == G.experts && D.in == G.out &&
              D.out == G.in,
          op, "gate / up [E, I, H] and down [E, H, I] disagree");
  const int64_t S = check(op, "h", h, {-1, G.in})[0];
  const int64_t k = check(op, "top_idx", top_idx, {S, -1})[1];
  check(op, "top_w", top_w, {S, k});
  for (size_t i = 0; i < top_idx.size(); ++i)
    require(top_idx.data()[i] >= 0 && top_idx.data()[i] < G.experts, op, "expert id out of range");
  auto [d, pd] = out<uint16_t>({S * k, G.in});
  ops::moe_experts(moe_params(S, G.experts, static_cast<int>(k), true, G.in, G.out), G, U, D, h.data(),
                   top_idx.data(), top_w.data(), tile_rows, host_count, pd);
  return d;
}

nb::object moe_combine(const F32& x, const F32& sh, const F32& gate, const U16& d) {
  const std::vector<int64_t> s = check("moe_combine", "x", x, {-1, -1});
  check("moe_combine", "sh", sh, s);
  check("moe_combine", "gate", gate, {s[0]});
  const int64_t P = check("moe_combine", "d", d, {-1, s[1]})[0];
  require(s[0] > 0 && P % s[0] == 0, "moe_combine", "d must hold k rows per token");
  auto [xo, px] = copy_of(x);
  ops::moe_combine(moe_params(s[0], 0, static_cast<int>(P / s[0]), true, s[1]), sh.data(), gate.data(), d.data(), px);
  return xo;
}

// ---- DeltaNet ----

kp::DeltaNetParams dn_params(int64_t S, int k_heads, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K, double norm_eps) {
  return kp::DeltaNetParams{k_heads, static_cast<int32_t>(Hv), static_cast<int32_t>(Dk), static_cast<int32_t>(Dv),
                            static_cast<int32_t>(K), static_cast<int32_t>(2 * k_heads * Dk + Hv * Dv),
                            static_cast<float>(norm_eps), 1e-6f, S};
}

nb::tuple deltanet_conv(const F32& qkv, const F32& conv_w, const F32& conv_state, int k_heads, int64_t k_dim,
                        int64_t v_heads, int64_t v_dim, int misalign) {
  const char* op = "deltanet_conv";
  // (the conv and its q/k normalisation do not pair value heads with key heads: any counts are valid here)
  require(k_heads > 0 && v_heads > 0, op, "k_heads and v_heads must be positive");
  require(misalign >= 0 && misalign <= 3, op, "misalign is 0 (none), 1 (qkv), 2 (conv_state) or 3 (u)");
  const int64_t C = 2 * k_heads * k_dim + v_heads * v_dim;
  const int64_t S = check(op, "qkv", qkv, {-1, C})[0];
  const int64_t K = check(op, "conv_w", conv_w, {C, -1})[1];
  require(K >= 2, op, "conv_w needs at least two taps");
  check(op, "conv_state", conv_state, {K - 1, C});
  const kp::DeltaNetParams p = dn_params(S, k_heads, v_heads, k_dim, v_dim, K, 1e-6);
  auto [u, pu] = out<float>({S, C});
  auto [st, pst] = copy_of(conv_state);
  ops::deltanet_conv(p, qkv.data(), conv_w.data(), pst, misalign, pu);
  return nb::make_tuple(u, st);
}

// The scan's shapes from ssm [Hv, Dv, Dk] and u [S, C]; checks b, a [S, Hv] and dt_bias, a_log [Hv].
kp::DeltaNetParams scan_params(const char* op, const F32& u, const F32& b, const F32& a, const F32& dt_bias,
                               const F32& a_log, const F32& ssm, int k_heads, double norm_eps) {
  const std::vector<int64_t> st = check(op, "ssm", ssm, {-1, -1, -1});
  const int64_t Hv = st[0], Dv = st[1], Dk = st[2];
  require(k_heads > 0 && Hv % k_heads == 0, op, "v heads (ssm.shape[0]) must be a multiple of k_heads");
  const int64_t S = check(op, "u", u, {-1, 2 * k_heads * Dk + Hv * Dv})[0];
  check(op, "b", b, {S, Hv});
  check(op, "a", a, {S, Hv});
  check(op, "dt_bias", dt_bias, {Hv});
  check(op, "a_log", a_log, {Hv});
  return dn_params(S, k_heads, Hv, Dk, Dv, 4, norm_eps);
}

nb::tuple deltanet_scan(const F32& u, const F32& b, const F32& a, const F32& dt_bias, const F32& a_log, const F32& ssm,
                        int k_heads, int variant) {
  const kp::DeltaNetParams p = scan_params("deltanet_scan", u, b, a, dt_bias, a_log, ssm, k_heads, 1e-6);
  auto [y, py] = out<float>({p.S, int64_t{p.v_heads} * p.v_dim});
  auto [st, pst] = copy_of(ssm);
  ops::deltanet_scan(p, u.data(), b.data(), a.data(), dt_bias.data(), a_log.data(), pst, variant, py);
  return nb::make_tuple(y, st);
}

nb::tuple deltanet_scan_norm(const F32& u, const F32& b, const F32& a, const F32& dt_bias, const F32& a_log,
                             const F32& z, const F32& norm_w, const F32& ssm, int k_heads, int variant,
                             double norm_eps) {
  const char* op = "deltanet_scan_norm";
  const kp::DeltaNetParams p = scan_params(op, u, b, a, dt_bias, a_log, ssm, k_heads, norm_eps);
  check(op, "z", z, {p.S, int64_t{p.v_heads} * p.v_dim});
  check(op, "norm_w", norm_w, {p.v_dim});
  auto [o, po] = out<uint16_t>({p.S, int64_t{p.v_heads} * p.v_dim});
  auto [st, pst] = copy_of(ssm);
  ops::deltanet_scan_norm(p, u.data(), b.data(), a.data(), dt_bias.data(), a_log.data(), z.data(), norm_w.data(), pst,
                          variant, po);
  return nb::make_tuple(o, st);
}

int deltanet_scan_pick(int64_t S) { return ops::deltanet_scan_pick(dn_params(S, 1, 1, 32, 32, 4, 1e-6)); }

nb::object deltanet_gated_norm(const F32& y, const F32& z, const F32& w, double eps) {
  const int64_t Dv = check("deltanet_gated_norm", "w", w, {-1})[0];
  const std::vector<int64_t> s = check("deltanet_gated_norm", "y", y, {-1, -1});
  check("deltanet_gated_norm", "z", z, s);
  require(Dv > 0 && s[1] % Dv == 0, "deltanet_gated_norm", "y's row length must be a multiple of w's length");
  auto [o, po] = out<uint16_t>(s);
  ops::deltanet_gated_norm(dn_params(s[0], 1, s[1] / Dv, 32, Dv, 4, eps), y.data(), z.data(), w.data(), po);
  return o;
}

nb::tuple deltanet_step(const F32& u, const F32& b, const F32& a, const F32& dt_bias, const F32& a_log,
                        const F32& ssm, const F32& z, const F32& norm_w, const I32& head_done, int k_heads,
                        double norm_eps) {
  const char* op = "deltanet_step";
  const std::vector<int64_t> st = check(op, "ssm", ssm, {-1, -1, -1});
  const int64_t Hv = st[0], Dv = st[1], Dk = st[2];
  require(k_heads > 0 && Hv % k_heads == 0, op, "v heads (ssm.shape[0]) must be a multiple of k_heads");
  const kp::DeltaNetParams p = dn_params(1, k_heads, Hv, Dk, Dv, 4, norm_eps);
  check(op, "u", u, {p.conv_dim});
  for (auto* v : {&b, &a, &dt_bias, &a_log}) check(op, "b, a, dt_bias and a_log", *v, {Hv});
  check(op, "z", z, {Hv * Dv});
  check(op, "norm_w", norm_w, {Dv});
  check(op, "head_done", head_done, {Hv});
  auto [y, py] = out<float>({Hv * Dv});
  auto [o, po] = out<uint16_t>({Hv * Dv});
  auto [s1, ps] = copy_of(ssm);
  auto [done, pdone] = copy_of(head_done);
  ops::deltanet_step(p, u.data(), b.data(), a.data(), dt_bias.data(), a_log.data(), ps, z.data(), norm_w.data(), pdone,
                     py, po);
  return nb::make_tuple(y, o, s1, done);
}

nb::tuple deltanet_step_rows(const F32& u, const F32& b, const F32& a, const F32& dt_bias, const F32& a_log,
                             const F32& ssm, const F32& z, const F32& norm_w, const I32& head_done, int k_heads,
                             double norm_eps, bool keep_rows) {
  const char* op = "deltanet_step_rows";
  const std::vector<int64_t> st = check(op, "ssm", ssm, {-1, -1, -1});
  const int64_t Hv = st[0], Dv = st[1], Dk = st[2];
  require(k_heads > 0 && Hv % k_heads == 0, op, "v heads (ssm.shape[0]) must be a multiple of k_heads");
  const int64_t M = check(op, "u", u, {-1, 2 * k_heads * Dk + Hv * Dv})[0];
  require(M >= 1 && M <= 8, op, "u must hold 1 to 8 rows");
  const kp::DeltaNetParams p = dn_params(M, k_heads, Hv, Dk, Dv, 4, norm_eps);
  for (auto* v : {&b, &a}) check(op, "b and a", *v, {M, Hv});
  for (auto* v : {&dt_bias, &a_log}) check(op, "dt_bias and a_log", *v, {Hv});
  check(op, "z", z, {M, Hv * Dv});
  check(op, "norm_w", norm_w, {Dv});
  check(op, "head_done", head_done, {Hv});
  auto [y, py] = out<float>({M, Hv * Dv});
  auto [o, po] = out<uint16_t>({M, Hv * Dv});
  auto [s1, ps] = copy_of(ssm);
  auto [done, pdone] = copy_of(head_done);
  nb::object rows = nb::none();
  float* prows = nullptr;
  if (keep_rows) std::tie(rows, prows) = out<float>({M, Hv, Dv, Dk});
  ops::deltanet_step_rows(p, u.data(), b.data(), a.data(), dt_bias.data(), a_log.data(), ps, z.data(), norm_w.data(),
                          pdone, py, po, prows);
  return nb::make_tuple(y, o, s1, done, rows);
}

// ---- attention ----

kp::AttentionParams attn_params(const char* op, int64_t S, int64_t pos0, int n_heads, int n_kv_heads, int head_dim,
                                int rotary_dim, double rope_theta, double eps) {
  require(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, op, "n_heads must be a multiple of n_kv_heads");
  require(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, op, "rotary_dim must be even, <= head_dim");
  require(pos0 >= 0 && S >= 1, op, "pos0 >= 0 and at least one row");
  return kp::AttentionParams{n_heads, n_kv_heads, head_dim, rotary_dim, static_cast<float>(rope_theta),
                             static_cast<float>(eps), 1.f / std::sqrt(static_cast<float>(head_dim)), 0, pos0, S};
}

nb::tuple attention_prep(const F32& qg, const F32& k, const F32& v, const F32& q_norm, const F32& k_norm,
                         const U16& k_cache, const U16& v_cache, int64_t pos0, int n_heads, int n_kv_heads,
                         int head_dim, int rotary_dim, double rope_theta, double eps, bool dpos) {
  const char* op = "attention_prep";
  const int64_t D = head_dim, row = int64_t{n_kv_heads} * D;
  const int64_t S = check(op, "qg", qg, {-1, 2 * n_heads * D})[0];
  const kp::AttentionParams p = attn_params(op, S, pos0, n_heads, n_kv_heads, head_dim, rotary_dim, rope_theta, eps);
  check(op, "k", k, {S, row});
  check(op, "v", v, {S, row});
  check(op, "q_norm", q_norm, {D});
  check(op, "k_norm", k_norm, {D});
  const int64_t cap = check(op, "k_cache", k_cache, {-1, row})[0];
  check(op, "v_cache", v_cache, {cap, row});
  require(pos0 + S <= cap, op, "the cache must hold rows 0 .. pos0+S-1");
  auto [q, pq] = out<float>({S, n_heads * D});
  auto [kc, pkc] = copy_of(k_cache);
  auto [vc, pvc] = copy_of(v_cache);
  ops::attention_prep(p, qg.data(), k.data(), v.data(), q_norm.data(), k_norm.data(), cap, dpos, pq, pkc, pvc);
  return nb::make_tuple(q, kc, vc);
}

nb::object attention(const F32& q, const F32& qg, const U16& k_cache, const U16& v_cache, int64_t pos0, int n_heads,
                     int n_kv_heads, int head_dim, int64_t plan_pos0, bool tc_decode, bool wgmma, bool dpos) {
  const char* op = "attention";
  const int64_t D = head_dim, row = int64_t{n_kv_heads} * D;
  const int64_t S = check(op, "q", q, {-1, n_heads * D})[0];
  const kp::AttentionParams p = attn_params(op, S, pos0, n_heads, n_kv_heads, head_dim, 0, 1e4, 1e-6);
  check(op, "qg", qg, {S, 2 * n_heads * D});
  const int64_t cap = check(op, "k_cache", k_cache, {-1, row})[0];
  check(op, "v_cache", v_cache, {cap, row});
  require(pos0 + S <= cap && plan_pos0 < cap, op, "the cache must hold rows 0 .. pos0+S-1 (and the plan's position)");
  auto [o, po] = out<uint16_t>({S, n_heads * D});
  ops::attention(p, q.data(), qg.data(), k_cache.data(), v_cache.data(), cap, plan_pos0, tc_decode, wgmma, dpos, po);
  return o;
}

kp::AttentionParams shape_params(int64_t S, int64_t pos0, int n_heads, int n_kv_heads, int head_dim) {
  return attn_params("attention", S, pos0, n_heads, n_kv_heads, head_dim, 0, 1e4, 1e-6);
}

// ---- the device sampler ----

lily::SampleOptions sample_options(double temperature, int64_t top_k, double top_p, double min_p, double rep,
                                   double presence, double frequency, std::vector<int32_t> bias_ids,
                                   std::vector<float> bias_vals, int64_t V) {
  require(bias_ids.size() == bias_vals.size(), "sample", "bias_ids and bias_vals differ in length");
  for (int32_t id : bias_ids) require(id >= 0 && id < V, "sample", "bias id out of range");
  return lily::sample_options(temperature, top_k, top_p, min_p, rep, presence, frequency, std::move(bias_ids),
                              std::move(bias_vals));
}

nb::dict sample_launch(const F32& logits, double uniform, const U8& seen, const I32& counts, double temperature,
                       int64_t top_k, double top_p, double min_p, double repetition_penalty, double presence_penalty,
                       double frequency_penalty, std::vector<int32_t> bias_ids, std::vector<float> bias_vals) {
  const int64_t V = check("sample_launch", "logits", logits, {-1})[0];
  const int64_t n = check("sample_launch", "seen", seen, {-1})[0];
  require(V >= 1 && n >= V, "sample_launch", "seen / counts [V + guard] with V >= 1");
  check("sample_launch", "counts", counts, {n});
  const lily::SampleOptions o = sample_options(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                               frequency_penalty, std::move(bias_ids), std::move(bias_vals), V);
  auto [s, ps] = copy_of(seen);
  auto [c, pc] = copy_of(counts);
  auto [x, px] = out<float>({n});
  auto [lg, plg] = out<float>({V});
  const int32_t tok = ops::sample_launch(logits.data(), static_cast<int32_t>(V), o, ps, pc, n - V,
                                         static_cast<float>(uniform), px, plg);
  nb::dict d;
  d["token"] = tok, d["x"] = x, d["seen"] = s, d["counts"] = c, d["logits"] = lg;
  return d;
}

int32_t sample_draw(const F32& logits, double uniform, double temperature, int64_t top_k, double top_p, double min_p,
                    double repetition_penalty, double presence_penalty, double frequency_penalty,
                    std::vector<int32_t> bias_ids, std::vector<float> bias_vals, std::optional<U8> seen,
                    std::optional<I32> counts) {
  const int64_t V = check("sample_draw", "logits", logits, {-1})[0];
  require(V >= 1, "sample_draw", "logits is empty");
  lily::SampleOptions o = sample_options(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                         frequency_penalty, std::move(bias_ids), std::move(bias_vals), V);
  if (seen) check("sample_draw", "seen", *seen, {V}), o.seen.assign(seen->data(), seen->data() + V);
  if (counts) check("sample_draw", "counts", *counts, {V}), o.counts.assign(counts->data(), counts->data() + V);
  return ops::sample_draw(logits.data(), static_cast<int32_t>(V), o, static_cast<float>(uniform));
}

}  // namespace

// Called from bindings.cpp's module definition where the CUDA backend is built.
void register_cuda_ops(nb::module_& parent) {
  nb::module_ m = parent.def_submodule(
      "cuda_ops", "The CUDA kernels one by one, numpy in / numpy out (tests/kernels): inputs copied to the device, "
                  "the engine's launch functions, outputs copied back (poisoned with NaN / -1 first).");
  m.def("sm_count", &ops::sm_count, "streaming multiprocessors of the current device");
  m.def("device_is_sm90", &ops::device_is_sm90, "Hopper (the wgmma kernels' architecture)");
  m.def("embed", &embed, "ids"_a, "w"_a, "ids int32 [S] -> rows of W fp32 [S, in]");
  m.def("rms_norm", &rms_norm, "x"_a, "w"_a, "eps"_a, "x_offset"_a = 0, "fp32"_a = false,
        "x fp32 [rows, n], w [n] -> bf16 [rows, n] (fp32: fp32 [rows, n]); x_offset: x that many floats past an "
        "aligned start");
  m.def("linear", &linear, "x"_a, "w"_a, "y0"_a = nb::none(), "ldy"_a = 0, "impl"_a = 0, "sb_offset"_a = 0,
        "x bf16 [S, ldx] -> fp32 [S, ldy] = x W^T (+ y0); impl 0 engine dispatch, 1 wmma fallback, 2 mma GEMM");
  m.def("linear_silu_mul", &linear_silu_mul, "x"_a, "w0"_a, "w1"_a, "ldy"_a = 0, "impl"_a = 0, "sb_offset"_a = 0,
        "x bf16 [S, ldx] -> bf16 [S, ldy] = silu(x W0^T) * (x W1^T)");
  m.def("linear_concat", &linear_concat, "x"_a, "w"_a, "rows"_a, "pads"_a, "concatenated"_a,
        "x bf16 [S, in] against the row parts of W -> [fp32 [S, rows_i + pads_i]]; concatenated=False: each part "
        "alone");
  m.def("grouped", &grouped, "h"_a, "act_in"_a, "w0"_a, "w1"_a, "w2"_a, "tile_expert"_a, "tile_row0"_a,
        "tile_rows"_a, "n_tiles"_a, "a_rows"_a, "y_rows"_a, "scale"_a, "tile"_a, "impl"_a = 0,
        "grouped gate/up of h bf16 [S, H] and down of act_in bf16 [P, Kd] over a tile map -> (act bf16 [P, I], "
        "d bf16 [P, D])");
  m.def("experts_gate_up", &experts_gate_up, "x"_a, "w0"_a, "w1"_a, "ids"_a, "x bf16 [H] -> act bf16 [k, I]");
  m.def("experts_down", &experts_down, "act_in"_a, "w2"_a, "ids"_a, "w"_a, "act_in bf16 [k, I] -> d bf16 [k, H]");
  m.def("moe_route", &moe_route, "logits"_a, "top_k"_a, "norm_topk_prob"_a,
        "logits fp32 [S, E] -> (ids int32 [S, k], weights fp32 [S, k])");
  m.def("moe_sort", &moe_sort, "top_idx"_a, "top_w"_a, "n_experts"_a, "tile_rows"_a,
        "the pairs grouped by expert and the tile map (dict of arrays)");
  m.def("moe_experts", &moe_experts, "h"_a, "top_idx"_a, "top_w"_a, "gate"_a, "up"_a, "down"_a, "tile_rows"_a = 0,
        "host_count"_a = false, "h bf16 [S, H] -> d bf16 [S*k, H] (sort + grouped gate/up + down)");
  m.def("moe_combine", &moe_combine, "x"_a, "sh"_a, "gate"_a, "d"_a,
        "x fp32 [S, H] + sigmoid(gate) sh + sum of d's k rows per token");
  m.def("deltanet_conv", &deltanet_conv, "qkv"_a, "conv_w"_a, "conv_state"_a, "k_heads"_a, "k_dim"_a, "v_heads"_a,
        "v_dim"_a, "misalign"_a = 0,
        "qkv fp32 [S, C], conv_w [C, K], conv_state [K-1, C] -> (u [S, C]: conv + SiLU, q/k l2-normalised; state')");
  m.def("deltanet_scan", &deltanet_scan, "u"_a, "b"_a, "a"_a, "dt_bias"_a, "a_log"_a, "ssm"_a, "k_heads"_a,
        "variant"_a, "the prefill scan (variant 0 seq8, 1 seq16, 2 chunked, 3 auto) -> (y fp32 [S, Hv*Dv], ssm')");
  m.def("deltanet_scan_norm", &deltanet_scan_norm, "u"_a, "b"_a, "a"_a, "dt_bias"_a, "a_log"_a, "z"_a, "norm_w"_a,
        "ssm"_a, "k_heads"_a, "variant"_a, "norm_eps"_a = 1e-6,
        "the scan with the gated norm (variant 0 chunk+norm, 1 auto+norm, 2 seq+norm, 3 chunk then gated_norm) "
        "-> (out bf16 [S, Hv*Dv], ssm')");
  m.def("deltanet_scan_pick", &deltanet_scan_pick, "S"_a, "the form auto runs at S rows: 1 sequential, 2 chunked");
  m.def("deltanet_gated_norm", &deltanet_gated_norm, "y"_a, "z"_a, "w"_a, "eps"_a = 1e-6,
        "y, z fp32 [S, Hv*Dv], w [Dv] -> bf16 [S, Hv*Dv]");
  m.def("deltanet_step", &deltanet_step, "u"_a, "b"_a, "a"_a, "dt_bias"_a, "a_log"_a, "ssm"_a, "z"_a, "norm_w"_a,
        "head_done"_a, "k_heads"_a, "norm_eps"_a = 1e-6,
        "one token: u [C] (q, k not normalised) -> (y fp32 [Hv*Dv], out bf16 [Hv*Dv], ssm', head_done')");
  m.def("deltanet_step_rows", &deltanet_step_rows, "u"_a, "b"_a, "a"_a, "dt_bias"_a, "a_log"_a, "ssm"_a, "z"_a,
        "norm_w"_a, "head_done"_a, "k_heads"_a, "norm_eps"_a = 1e-6, "keep_rows"_a = true,
        "deltanet_step over M = 1..8 rows u [M, C]; also the state after each row fp32 [M, Hv, Dv, Dk] (or None)");
  m.def("attention_prep", &attention_prep, "qg"_a, "k"_a, "v"_a, "q_norm"_a, "k_norm"_a, "k_cache"_a, "v_cache"_a,
        "pos0"_a, "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "rotary_dim"_a, "rope_theta"_a, "eps"_a,
        "dpos"_a = false, "-> (q fp32 [S, Hq*D], k_cache', v_cache' bf16 [cap, Hkv*D])");
  m.def("attention", &attention, "q"_a, "qg"_a, "k_cache"_a, "v_cache"_a, "pos0"_a, "n_heads"_a, "n_kv_heads"_a,
        "head_dim"_a, "plan_pos0"_a = -1, "tc_decode"_a = false, "wgmma"_a = true, "dpos"_a = false,
        "-> o bf16 [S, Hq*D]; plan_pos0 >= 0: the split plan at that position (the decode step's capacity)");
  m.def("attention_splits", [](int64_t S, int64_t pos0, int Hq, int Hkv, int D, int64_t plan_pos0) {
          return ops::attention_splits(shape_params(S, pos0, Hq, Hkv, D), plan_pos0);
        }, "S"_a, "pos0"_a, "n_heads"_a, "n_kv_heads"_a, "head_dim"_a, "plan_pos0"_a = -1);
  m.def("attention_wgmma_supported", [](int64_t S, int Hq, int Hkv, int D) {
          return ops::attention_wgmma_supported(shape_params(S, 0, Hq, Hkv, D));
        }, "S"_a, "n_heads"_a, "n_kv_heads"_a, "head_dim"_a);
  m.def("attention_decode_tc_supported", [](int Hq, int Hkv, int D) {
          return ops::attention_decode_tc_supported(shape_params(1, 0, Hq, Hkv, D));
        }, "n_heads"_a, "n_kv_heads"_a, "head_dim"_a);
  lily::cuda_ops_front::register_gemv_ops(m);
  m.def("sample_launch", &sample_launch, "logits"_a, "uniform"_a, "seen"_a, "counts"_a, "temperature"_a = 1.0,
        "top_k"_a = 0, "top_p"_a = 1.0, "min_p"_a = 0.0, "repetition_penalty"_a = 1.0, "presence_penalty"_a = 0.0,
        "frequency_penalty"_a = 0.0, "bias_ids"_a = std::vector<int32_t>{}, "bias_vals"_a = std::vector<float>{},
        "the sampler's three kernels with every buffer visible: seen uint8 / counts int32 [V + guard] -> dict(token, "
        "x fp32 [V + guard] the processed row, seen', counts', logits (the raw row read back))");
  m.def("sample_draw", &sample_draw, "logits"_a, "uniform"_a, "temperature"_a = 1.0, "top_k"_a = 0, "top_p"_a = 1.0,
        "min_p"_a = 0.0, "repetition_penalty"_a = 1.0, "presence_penalty"_a = 0.0, "frequency_penalty"_a = 0.0,
        "bias_ids"_a = std::vector<int32_t>{}, "bias_vals"_a = std::vector<float>{}, "seen"_a = nb::none(),
        "counts"_a = nb::none(), "the engine's draw (DeviceSampler begin + draw), options as lily._lily.sample_draw");
}
#endif  // LILY_HAVE_CUDA
