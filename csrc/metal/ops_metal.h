// One encode function per kernel family of metal/*.metal: picks the specialisation (the pipeline name
// spells it: gemv_q4, gemm_glu_q4_f32_bm16, deltanet_scan_norm_nk4, attn_decode_nd8_h8, ...), binds buffers by
// the indices of the kernel signature, fills the params.h struct and chooses grid and threadgroup sizes.
// The same code drives the Apple device and the emulated one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/params.h"
#include "metal/device.h"

namespace lily::metal {

// A linear weight [E?, out, in] on the device in its checkpoint format.
struct DevLinear {
  BufRef w, s, b;              // codes or dense matrix; scales, biases (dense: bound to w, unused)
  kp::LinearParams args{};
  std::string fmt;             // "q4" | "q8" | "bf16" | "f32"
  int64_t out = 0, in = 0, experts = 0;
};

// Device routing results for a chunk of S rows (MoE prefill).
struct RouteBufs {
  BufRef ids, wts, counts, base, tile_expert, tile_row0, tile_rows, n_tiles, sorted_row, sorted_w, inv;
};

class Ops {
 public:
  // kv_bf16: the KV cache holds bf16 (the *_kvbf16 attention kernels), else fp32.
  // The prefill GEMMs run on Metal 4 tensor ops (gemm_tensor.metal) when the device has them, else on
  // simdgroup matrices (gemm.metal, every machine).
  Ops(Device& dev, bool kv_bf16)
      : dev_(dev), kvs_(kv_bf16 ? "_kvbf16" : ""), tensor_ops_(dev.has_tensor_ops()) {}

  // Rows at or below this use the row-parallel GEMV; above, the GEMM. (The GEMV reads the weights once for up to
  // kDecodeRows rows; where it overtakes the GEMM between 4 and 8 rows is unmeasured without a Mac.)
  static constexpr int kGemvMaxRows = 4;
  // Input rows one decode threadgroup serves (gemv_<fmt>_m<NM>, moe_*_decode_<fmt>_m<NM>: each weight chunk read and
  // dequantized once for all of them); more rows run in groups of kDecodeRows, then the rest.
  static constexpr int kDecodeRows = 8;
  // Backend::exact_rows: every linear runs the GEMV, whose rows are each computed as a one-row step computes them
  // (row m of an NM-row launch is bit-equal to a one-row launch on it).
  bool exact_rows = false;
  // Decode attention: keys per split-K part.
  static constexpr int kSplitLen = 256;

  // y[S, out] (+)= x[S, in] W^T. x_stride / y_stride in floats (0: in / out).
  void linear(Encoder& e, const DevLinear& W, BufRef x, BufRef y, int S, bool accumulate, int x_stride = 0,
              int y_stride = 0);
  // y[S, out] = silu(x Wg^T) * (x Wu^T), GEMM.
  void linear_glu(Encoder& e, const DevLinear& Wg, const DevLinear& Wu, BufRef x, BufRef y, int S);
  // Grouped expert GEMM over the block map: y[p] = A[row(p)] W_e^T (GLU when Wu) for pairs p < pairs.
  void grouped(Encoder& e, const DevLinear& W, const DevLinear* Wu, BufRef a, int lda, bool gather,
               const RouteBufs& r, BufRef y, int pairs, int bm, int max_tiles);

  // y[s, :dim] = RMSNorm(x[s, :dim]; w); x_stride / y_stride in floats between rows (0: dim), so a norm can write
  // one half of a concatenation.
  void rms_norm(Encoder& e, BufRef x, BufRef w, BufRef y, int S, int dim, float eps, int x_stride = 0,
                int y_stride = 0);
  void embed(Encoder& e, const DevLinear& E, BufRef ids, BufRef x, int S);
  // y[s, :dim] = src[ids[s], :dim] for fp32 rows (the embed kernel over an fp32 table): with src offset to a row
  // and ids pointing at a 0, a one-row device copy.
  void copy_rows(Encoder& e, BufRef src, BufRef ids, BufRef y, int S, int dim);
  void argmax(Encoder& e, BufRef logits, int V, BufRef tokens, int slot);
  // Device sampling (sample.metal; semantics of csrc/cuda/sample.cuh): tokens[a.token_slot] = the draw from
  // logits [V] with uniform [1]; seen [V] u8 and counts [V] i32 record it. x [V] f32 and work
  // (sample_work_bytes(V)) are scratch. Three dispatches with barriers (greedy skips sample_weigh).
  struct SampleBufs {
    BufRef logits, x, work, bias_ids, bias_vals, seen, counts, uniform, tokens;
  };
  void sample(Encoder& e, const kp::SampleArgs& a, const SampleBufs& b);
  static size_t sample_work_bytes(int V);
  static constexpr int kSampleSpan = 2048;  // row entries per grid threadgroup (sample.metal kSampleSpan)

  void deltanet_conv(Encoder& e, const kp::DeltaNetParams& p, BufRef qkv, BufRef conv_w, BufRef conv_state, BufRef u);
  // Fused gated RMSNorm when the head fits one threadgroup (Dv <= 128); else scan + deltanet_gated_norm.
  void deltanet_scan(Encoder& e, const kp::DeltaNetParams& p, BufRef u, BufRef b, BufRef a, BufRef a_log,
                BufRef dt_bias, BufRef state, BufRef z, BufRef norm_w, BufRef y);

  // The DeltaNet recurrence in its chunked form (deltanet_chunk.metal: WY/UT, chunk 64, simdgroup matrices;
  // deltanet_chunk_prep + deltanet_chunk_state, then deltanet_gated_norm). Same state and outputs as deltanet_scan; scratch holds
  // deltanet_chunk_scratch_bytes(p) bytes (W, U, P, Qg, Kd, LG per value head and chunk).
  void deltanet_scan_chunked(Encoder& e, const kp::DeltaNetParams& p, BufRef u, BufRef b, BufRef a, BufRef a_log,
                        BufRef dt_bias, BufRef state, BufRef z, BufRef norm_w, BufRef y, BufRef scratch);
  static size_t deltanet_chunk_scratch_bytes(const kp::DeltaNetParams& p);
  // The chunked kernels run 256 threads per threadgroup (8 simdgroups, one 8-row tile each); false where the
  // device allows fewer for these register-heavy pipelines (then auto runs the sequential form and a forced
  // chunked form throws std::runtime_error).
  bool deltanet_chunked_fits(const kp::DeltaNetParams& p);
  // Which form runs a chunk of p.S rows (backend flag deltanet_form, as CUDA's): 0 auto (chunked from
  // kScanChunkMinRows rows), 1 sequential (deltanet_scan), 2 chunked (deltanet_scan_chunked).
  enum ScanForm : int { kScanAuto = 0, kScanSequential = 1, kScanChunked = 2 };
  // The crossover cannot be measured without a Mac, so it is CUDA's (csrc/cuda/deltanet.cuh), whose reasoning
  // carries over: the chunked form costs two dispatches plus ceil(S / 64) dependent chunk steps, the sequential
  // one a dependent step per token. Measure it on Apple hardware (benchmarks/bench_metal.py) and set it here.
  static constexpr int64_t kScanChunkMinRows = 128;
  static int scan_pick(const kp::DeltaNetParams& p, int form);

  void attn_prep(Encoder& e, const kp::AttentionParams& p, BufRef qg, BufRef k, BufRef v, BufRef q_norm,
                 BufRef k_norm, BufRef rope, BufRef q, BufRef k_cache, BufRef v_cache);
  void attn_prefill(Encoder& e, const kp::AttentionParams& p, BufRef q, BufRef qg, BufRef k_cache,
                    BufRef v_cache, BufRef out);
  // ml / po must hold Hq * parts(T) partials; returns after encoding both passes (barrier inside).
  void attn_decode(Encoder& e, const kp::AttentionParams& p, BufRef q, BufRef qg, BufRef k_cache, BufRef v_cache,
                   BufRef ml, BufRef po, BufRef out);
  static int attn_parts(int64_t T) { return static_cast<int>((T + kSplitLen - 1) / kSplitLen); }

  // Pipeline name of the prefill GEMM for a weight format, GLU or not, and row tile: the tensor-op kernel
  // (half tiles) where the device has tensor ops and it is instantiated, else the simdgroup-matrix one.
  std::string gemm_kernel(const std::string& fmt, bool glu, int bm) const;
  bool tensor_ops() const { return tensor_ops_; }

  // Routing of S rows: top-k, histogram, offsets + block map, scatter (barriers inside).
  void route(Encoder& e, BufRef logits, const RouteBufs& r, int S, int E, int k, bool norm, int bm, int max_tiles);
  void moe_combine(Encoder& e, BufRef x, BufRef yd, BufRef ysh, BufRef sg, const RouteBufs& r, int S, int H, int k);
  void moe_topk(Encoder& e, BufRef logits, BufRef ids, BufRef wts, int S, int E, int k, bool norm);
  // The fused MoE decode chains over rows <= kDecodeRows rows (each expert the rows chose streamed once for them):
  // act [rows, k+1, act_stride] = silu(h Wg^T) * (h Wu^T) per (row, slot), slot k the shared expert, from h [rows, H]
  // and ids [rows, k]; then x [rows, H] += the rows' weighted sums (wts [rows, k], sg_logit [rows]), k <= 8.
  void moe_gate_up_decode(Encoder& e, const DevLinear& g, const DevLinear& u, const DevLinear& sg,
                          const DevLinear& su, BufRef h, BufRef ids, BufRef act, int k, int act_stride, int rows = 1);
  void moe_down_decode(Encoder& e, const DevLinear& d, const DevLinear& sd, BufRef act, BufRef ids, BufRef wts,
                       BufRef sg_logit, BufRef x, int k, int act_stride, int rows = 1);

 private:
  Pipeline* pipe(const std::string& name) { return dev_.pipeline(name); }
  void go(Encoder& e, const std::string& kernel, Size3 grid, Size3 tg);
  Device& dev_;
  std::string kvs_;  // kernel-name suffix of the KV element type
  bool tensor_ops_;
};

}  // namespace lily::metal
