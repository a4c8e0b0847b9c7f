// The CUDA op table of the kernel tests (tests/kernels, bound as lily._lily.cuda_ops by bindings_cuda_ops.cpp): each
// entry takes host arrays, copies them to the device, runs the product's launch functions (csrc/cuda/*.cuh, the ones
// the engine calls) on the legacy default stream, waits, and copies the outputs back. Every device output is filled
// with 0xFF bytes first (NaN in fp32 and bf16, -1 in int32), so an element a kernel skips comes back NaN / -1.
// Plain C++ (no CUDA headers): the binding file compiles without the toolkit's headers.
//
// Legend: S rows, H hidden, E experts, k routed experts per row, P = S*k pairs, C conv channels, K conv taps,
// cap KV cache rows, Hq/Hkv query/KV heads, D head dim, Hk/Hv key/value heads, Dk/Dv their dims, V vocab.
// bf16 values travel as uint16 bit patterns. Weights are lily::Linear views of host memory (core/tensor.h).
#pragma once
#include <cstdint>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "kernels/params.h"

namespace lily::cuda::ops {

// ---- the device ----
int sm_count();
bool device_is_sm90();

// ---- norm family (embed_norm.cuh, deltanet.cuh) ----
// ids int32 [S] -> x fp32 [S, E.in] (rows of the dequantized table).
void embed(const Linear& E, const int32_t* ids, int64_t S, float* x);
// x fp32 [rows, n], w fp32 [n] -> y bf16 [rows, n]. x_offset: x starts that many floats past a 256-byte aligned
// allocation (an offset that is not a multiple of 4 takes the unaligned loop path).
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t n, int x_offset, uint16_t* y);
// The same, y fp32 [rows, n] (the MTP head's hidden rows).
void rms_norm_f32(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y);

// ---- linear family (gemm.cuh) ----
// Which GEMM a prefill product takes: the engine's dispatch, the wmma fallback (force_gemm_fallback), or the mma.sync
// GEMM launched directly (its plain tile rows; one row included, which linear() sends to the GEMV).
enum GemmImpl : int { kGemmAuto = 0, kGemmFallback = 1, kGemmMma = 2 };
// y fp32 [S, ldy] (=|+=) x W^T for x bf16 [S, ldx]. y0 (nullable): y's values before the call, and the product is
// accumulated onto them; else y starts poisoned. sb_offset: the scales / biases start that many bf16 past a 256-byte
// aligned allocation (their address parity).
void linear(const Linear& W, const uint16_t* x, int64_t S, int64_t ldx, const float* y0, int64_t ldy, int impl,
            int sb_offset, float* y);
// y bf16 [S, ldy] = bf16(silu(x W0^T) * (x W1^T)).
void linear_silu_mul(const Linear& W0, const Linear& W1, const uint16_t* x, int64_t S, int64_t ldx, int64_t ldy,
                     int impl, int sb_offset, uint16_t* y);
// The parts of a concatenated weight W (its consecutive row ranges of rows[i] rows) against x bf16 [S, in]:
// y[i] fp32 [S, ldy[i]]. concatenated: one linear_concat over the whole W, else over the parts alone (the twin).
void linear_concat(const Linear& W, const std::vector<int64_t>& rows, const std::vector<int64_t>& ldy,
                   bool concatenated, const uint16_t* x, int64_t S, const std::vector<float*>& y);

// A tile map of sorted (token, expert) pairs (gemm.cuh GroupMap) in host memory: n_tiles tiles in use of
// max_tiles entries (the entries past n_tiles are never read).
struct HostTileMap {
  int32_t n_tiles = 0;
  int64_t max_tiles = 0;
  const int32_t *tile_expert = nullptr, *tile_row0 = nullptr, *tile_rows = nullptr;  // [max_tiles]
};
// The grouped (MoE) products over a tile map of tile_rows rows per tile:
//   act bf16 [P, I] = bf16(silu(h[a_rows[p]] W0[e]^T) * (h[a_rows[p]] W1[e]^T))        h bf16 [S, H]
//   d bf16 [P, D]: d[y_rows[p]] = bf16(scale[p] * (act_in[p] W2[e]^T))                act_in bf16 [P, Kd]
// a_rows, y_rows int32 [P], scale fp32 [P]; impl kGemmAuto or kGemmFallback.
void grouped(const Linear& W0, const Linear& W1, const Linear& W2, const HostTileMap& map, int64_t P,
             const int32_t* a_rows, const int32_t* y_rows, const float* scale, const uint16_t* h, int64_t S,
             const uint16_t* act_in, int tile_rows, int impl, uint16_t* act, uint16_t* d);
// The unfused decode experts (one token): act bf16 [k, I] = bf16(silu(x W0[ids[j]]^T) * (x W1[ids[j]]^T)), x bf16
// [H]; d bf16 [k, H] = bf16(w[j] * (act_in[j] W2[ids[j]]^T)), act_in bf16 [k, I].
void experts_gate_up(const Linear& W0, const Linear& W1, const int32_t* ids, int k, const uint16_t* x, uint16_t* act);
void experts_down(const Linear& W2, const int32_t* ids, const float* w, int k, const uint16_t* act_in, uint16_t* d);

// ---- MoE family (moe.cuh) ----
// logits fp32 [S, E] -> idx int32 [S, k], w fp32 [S, k].
void moe_route(const kp::MoeParams& p, const float* logits, int32_t* idx, float* w);
// moe_sort's outputs in host memory: pair_row, pair_id int32 [P], pair_w fp32 [P], n_tiles int32 [1], tile_expert,
// tile_row0, tile_rows int32 [moe_sort_max_tiles].
struct HostSort {
  int32_t *pair_row, *pair_id;
  float* pair_w;
  int32_t *n_tiles, *tile_expert, *tile_row0, *tile_rows;
};
int64_t moe_sort_max_tiles(const kp::MoeParams& p, int tile_rows);
void moe_sort(const kp::MoeParams& p, const int32_t* top_idx, const float* top_w, int tile_rows, const HostSort& out);
// moe_experts (sort + grouped gate/up + down) of h bf16 [S, H] -> d bf16 [P, H] (row s*k + j: token s's pair j);
// tile_rows 0: the engine's choice; host_count: the ablation that reads the tile count on the host.
void moe_experts(const kp::MoeParams& p, const Linear& gate, const Linear& up, const Linear& down, const uint16_t* h,
                 const int32_t* top_idx, const float* top_w, int tile_rows, bool host_count, uint16_t* d);
// x fp32 [S, H] += sigmoid(gate[s]) sh[s] + sum_j d[s*k + j]; sh fp32 [S, H], gate fp32 [S], d bf16 [P, H].
void moe_combine(const kp::MoeParams& p, const float* sh, const float* gate, const uint16_t* d, float* x);

// ---- DeltaNet family (deltanet.cuh) ----
// qkv fp32 [S, C], conv_w fp32 [C, K], conv_state fp32 [K-1, C] (updated in place) -> u fp32 [S, C].
// misalign 1 / 2 / 3: qkv / conv_state / u one float past a 16-byte boundary (the channel-per-thread path).
void deltanet_conv(const kp::DeltaNetParams& p, const float* qkv, const float* conv_w, float* conv_state, int misalign,
                   float* u);
// The prefill scan forms on u fp32 [S, C] (q, k l2-normalised), b, a fp32 [S, Hv], dt_bias, a_log fp32 [Hv];
// ssm fp32 [Hv, Dv, Dk] updated in place; y fp32 [S, Hv*Dv].
enum ScanVariant : int { kScanSeq8 = 0, kScanSeq16 = 1, kScanChunk = 2, kScanAutoForm = 3 };
void deltanet_scan(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a, const float* dt_bias,
                   const float* a_log, float* ssm, int variant, float* y);
// The scan with the gated norm: out bf16 [S, Hv*Dv]; z fp32 [S, Hv*Dv], norm_w fp32 [Dv]. Variants: deltanet_scan_norm
// with the chunked form, with auto (its own scratch), with the sequential form, and the chunked scan followed by
// deltanet_gated_norm as two calls.
enum ScanNormVariant : int { kNormChunk = 0, kNormAuto = 1, kNormSeq = 2, kNormSplit = 3 };
void deltanet_scan_norm(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, const float* z, const float* norm_w, float* ssm,
                        int variant, uint16_t* out);
// The form deltanet_scan's auto picks at p.S (cuda::DeltaNetScanForm: 1 sequential, 2 chunked).
int deltanet_scan_pick(const kp::DeltaNetParams& p);
// out bf16 [S, Hv*Dv] = bf16(RMSNorm(y per head; w) * silu(z)); y, z fp32 [S, Hv*Dv], w fp32 [Dv].
void deltanet_gated_norm(const kp::DeltaNetParams& p, const float* y, const float* z, const float* w, uint16_t* out);
// One token (p.S == 1): u fp32 [C] (q, k not yet normalised), b, a fp32 [Hv], ssm fp32 [Hv, Dv, Dk] updated,
// z fp32 [Hv*Dv], norm_w fp32 [Dv], head_done int32 [Hv] (the counters, in and out) -> y fp32 [Hv*Dv],
// out bf16 [Hv*Dv].
void deltanet_step(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a, const float* dt_bias,
                   const float* a_log, float* ssm, const float* z, const float* norm_w, int32_t* head_done, float* y,
                   uint16_t* out);

// M = p.S rows (1..8) of the step: u fp32 [M, C], b, a fp32 [M, Hv], z fp32 [M, Hv*Dv], ssm updated to the state
// after the last row -> y fp32 [M, Hv*Dv], out bf16 [M, Hv*Dv], state_rows fp32 [M, Hv, Dv, Dk] (the state after each
// row; nullptr: not kept).
void deltanet_step_rows(const kp::DeltaNetParams& p, const float* u, const float* b, const float* a,
                        const float* dt_bias, const float* a_log, float* ssm, const float* z, const float* norm_w,
                        int32_t* head_done, float* y, uint16_t* out, float* state_rows);

// ---- attention family (attention.cuh) ----
// qg fp32 [S, Hq, 2D], k, v fp32 [S, Hkv*D], norms fp32 [D]; k_cache, v_cache bf16 [cap, Hkv*D] updated in place
// (rows p.pos0 .. p.pos0 + S - 1) -> q fp32 [S, Hq*D]. dpos: the position read from the device (the decode graphs; the
// launch's p.pos0 is then 0).
void attention_prep(const kp::AttentionParams& p, const float* qg, const float* k, const float* v, const float* q_norm,
                    const float* k_norm, int64_t cap, bool dpos, float* q, uint16_t* k_cache, uint16_t* v_cache);
// o bf16 [S, Hq*D] of q fp32 [S, Hq*D], qg fp32 [S, Hq, 2D] over the caches bf16 [cap, Hkv*D] (keys 0..pos0+t).
// plan_pos0 < 0: the split plan of p itself (prefill, attention_plan); else of p at that position (the decode step's
// plan for its capacity: plan_pos0 = cap - 1). tc_decode, wgmma, dpos: as attention()'s arguments.
void attention(const kp::AttentionParams& p, const float* q, const float* qg, const uint16_t* k_cache,
               const uint16_t* v_cache, int64_t cap, int64_t plan_pos0, bool tc_decode, bool wgmma, bool dpos,
               uint16_t* o);
// The split count attention() runs with those arguments (what the plan says).
int attention_splits(const kp::AttentionParams& p, int64_t plan_pos0);
bool attention_wgmma_supported(const kp::AttentionParams& p);
bool attention_decode_tc_supported(const kp::AttentionParams& p);

// ---- the decode GEMV (gemv.cuh) ----
// One segment of a proj launch: weight w0 (w1: the up projection of a dual segment), output mode (gemv::OMode),
// `slots` copies over routed experts. Outputs: y fp32 [slots, out] (store; accumulate starts from y0), yb bf16
// [slots, out] (dual); a conv segment (mode 3) writes the ProjCall's u and conv state instead.
struct ProjSegment {
  Linear w0, w1;
  int mode = 0, routed = 0, slots = 1;
  const float* y0 = nullptr;
  float* y = nullptr;
  uint16_t* yb = nullptr;
};
struct ProjCall {
  std::vector<ProjSegment> segs;
  int xmode = 0;  // gemv::XMode: 0 bf16 input xb [in], 1 RMSNorm of xf fp32 [in] with nw fp32 [in] and eps
  int64_t in = 0;
  float eps = 0.f;
  const uint16_t* xb = nullptr;
  const float *xf = nullptr, *nw = nullptr;
  uint16_t* h_out = nullptr;  // xmode 1: the normed row bf16 [in] (block 0 writes it)
  // routing prologue (when top_k > 0): softmax top-k of rlogits fp32 [E] -> top_idx int32 [k], top_w fp32 [k]
  const float* rlogits = nullptr;
  int E = 0, top_k = 0, norm_topk = 0;
  int32_t* top_idx = nullptr;
  float* top_w = nullptr;
  // conv epilogue: conv_w fp32 [C, K], conv_state fp32 [K-1, C] in place -> u fp32 [C]
  const float* conv_w = nullptr;
  float* conv_state = nullptr;
  float* u = nullptr;
  int conv_dim = 0, conv_k = 0;
  // greedy head (one store segment): the blocks' argmax keys (amax, resized to the launch's blocks) and the token
  // sample::argmax_from_block_keys reduces them to
  bool head = false;
  std::vector<unsigned long long>* amax = nullptr;
  int32_t* token = nullptr;
};
// Returns the blocks launched (gemv::proj).
unsigned gemv_proj(const ProjCall& c);
// x fp32 [H] += sum_j w[j] (act[j] Wd[ids[j]]^T) + sigmoid(sgate) (sact Ws^T); act bf16 [k, I], sact bf16 [Is].
void gemv_moe_down(const Linear& wd, const Linear& ws, const uint16_t* act, const uint16_t* sact, const int32_t* ids,
                   const float* w, float sgate, int k, float* x);
bool gemv_fits(const Linear& w);
int64_t gemv_head_blocks(int64_t rows);

// ---- the M-row decode GEMV (gemv_rows.cuh) ----
// One segment: weight w0 (w1: the up projection of a dual segment), output mode (rows::OMode); outputs y fp32 [M, out]
// (store; accumulate starts from y0 [M, out]) or yb bf16 [M, out] (dual).
struct RowsSegment {
  Linear w0, w1;
  int mode = 0;
  int routed = 0;  // a dual segment over stacked experts: yb bf16 [M, top_k, out], slot j of row m its expert's
  // own input rows bf16 [M, in] ([M, top_k, in] with xrouted: a routed store segment, the experts' down, whose y is
  // fp32 [M, top_k, out])
  const uint16_t* xb = nullptr;
  int xrouted = 0;
  const float* y0 = nullptr;
  float* y = nullptr;
  uint16_t* yb = nullptr;
};
struct RowsCall {
  std::vector<RowsSegment> segs;
  int rows = 1;   // M
  int xmode = 0;  // rows::XMode: 0 bf16 xb [M, in], 1 RMSNorm of xf fp32 [M, in] with nw fp32 [in] and eps
  int64_t in = 0;
  float eps = 0.f;
  const uint16_t* xb = nullptr;
  const float *xf = nullptr, *nw = nullptr;
  uint16_t* h_out = nullptr;                        // xmode 1: the normed rows bf16 [M, in]
  std::vector<unsigned long long>* amax = nullptr;  // one store segment: the blocks' keys [blocks, M] (resized)
  int32_t* tokens = nullptr;                        // with amax: each row's argmax from its keys [M] (on the device)
  // the conv segment's epilogue (mode 3): conv_w fp32 [C, K], conv_state fp32 [K-1, C] in place -> u fp32 [M, C],
  // conv_hist fp32 [K-1+M, C] (the state before the rows, then each row's product)
  const float* conv_w = nullptr;
  float* conv_state = nullptr;
  float *u = nullptr, *conv_hist = nullptr;
  int conv_dim = 0, conv_k = 0;
  // routing (a routed segment): softmax top-k of rlogits fp32 [M, E] -> top_idx int32 [M, top_k], top_w fp32
  const float* rlogits = nullptr;
  int E = 0, top_k = 0, norm_topk = 0;
  int32_t* top_idx = nullptr;
  float* top_w = nullptr;
  const int32_t* route_idx = nullptr;  // instead of rlogits: the routing [M, top_k] (the experts' down), E experts
};
// Returns the blocks launched (rows::proj).
// x fp32 [M, H] += sum_j top_w[m, j] yx[m, j] + sigmoid(sgate[m]) ysh[m]; yx [M, k, H], ysh [M, H] (null: none).
void moe_combine_rows(const float* yx, const float* ysh, const float* top_w, const float* sgate, int M, int k, int H,
                      float* x);
unsigned gemv_rows(const RowsCall& c);
bool gemv_rows_fits(const Linear& w);

// ---- the device sampler (sample.cuh) ----
// One draw through sample::launch with every buffer visible: logits fp32 [V]; seen uint8, counts int32 [V + guard]
// (updated in place; entries past V must stay as they were); x_out fp32 [V + guard] the processed-logits scratch
// (poisoned first, entries past V must stay poisoned); logits_after fp32 [V]: the raw row read back (the kernels must
// leave it as it was). Returns the token. Options as DeviceSampler::begin maps them (o.seen / o.counts unused).
int32_t sample_launch(const float* logits, int32_t V, const SampleOptions& o, uint8_t* seen, int32_t* counts,
                      int64_t guard, float uniform, float* x_out, float* logits_after);
// One draw the engine's way: DeviceSampler::begin (o.seen / o.counts: [V] or empty) then DeviceSampler::draw.
int32_t sample_draw(const float* logits, int32_t V, const SampleOptions& o, float uniform);

}  // namespace lily::cuda::ops
