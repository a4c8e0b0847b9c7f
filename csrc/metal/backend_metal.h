// The Metal backend: lily's Backend interface over the narrow device layer (metal/device.h), so the same
// code runs on Apple GPUs and, in CI, on the emulated device. fp32 activations and state, bf16 (or fp32)
// KV cache;
// weights stay in their checkpoint format in wrapped (not copied) host memory.
//
// A prefill chunk is encoded into one command buffer (routing included: no host round trip inside a
// chunk) and submitted when the next chunk starts or the host needs data. A decode step (the engine's
// begin_step .. end_step, core/backend.h) is one command buffer too: two token slots, two logits slots and
// two command buffers alternate, the device draws each token into the next step's slot, and the
// engine's token loop encodes step n + 1 while step n runs (the host waits only for a token it returns).
//
// make_backend("metal", ..., options) takes these BackendOptions (strings; std::invalid_argument names an
// unknown option or a bad value):
//   kv_bf16            "1" (default): bf16 KV cache, "0": fp32
//   cache_dir          where compiled kernels are cached (default: $LILY_CACHE_DIR/metal, else ~/Library/Caches/
//                      lily/metal on Apple, $XDG_CACHE_HOME/lily/metal or ~/.cache/lily/metal elsewhere)
//   inject_compile_error  a kernel file ("gemv" or "gemv.metal") whose embedded text gets a syntax error before
//                      compiling (tests, and a Mac user checking the fallback; also LILY_METAL_INJECT_COMPILE_ERROR):
//                      the device then raises the "Metal unavailable" error naming it (kernel_sources.h)
//   use_metallib       Apple: "1" (default) prefer a build-time lily.metallib if the extension has one; "0":
//                      compile the embedded sources
//   pipeline_cache     Apple: "1" (default) cache pipelines in an MTLBinaryArchive under cache_dir; "0": do not
//   emu_runtime_compile  "1": the emulated device compiles the embedded sources at first use through
//                      tools/msl/mslc.py (the runtime-compile path Apple takes with newLibraryWithSource)
//   emu_kernel_libs    instead: ';'-separated prebuilt emulator builds of metal/*.metal (tools/msl/mslc.py, one
//                      per file). One of the two is required on Linux, where the backend runs only on the
//                      emulated device (for tests); every emu_* option is refused on macOS (Apple device).
//   emu_toolchain, emu_python, emu_jobs  the runtime compile's mslc.py (default: $LILY_MSLC, else this source
//                      tree's), interpreter (default: $LILY_PYTHON, else this process) and parallel compilers (2)
//   emu_schedule       "-1" (default: the three schedules rotate per dispatch), "0", "1" or "2"
//   emu_threads        host threads the emulator runs one dispatch on (default "2")
//   emu_max_threads    the per-pipeline thread limit to emulate (default "1024"; Apple lowers it for
//                      register-heavy kernels, so a lower value exercises the backend's fallbacks)
//   emu_tensor_ops     "1": the device reports Metal 4 tensor ops (tensor-op GEMMs); "0" (default): not
//   emu_check_hazards  "1" (default): report a missing encoder barrier; "0": do not
//   emu_drop_barrier_before  a kernel name prefix: a planted bug (tests/metal/test_planted_bugs.py), the
//                      barrier before each such dispatch is ignored, as if the backend had left it out
#pragma once
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "metal/device.h"
#include "metal/ops_metal.h"
#include "metal/sampler_metal.h"

namespace lily::metal {

// Host address -> device buffer, for memory the backend allocated or wrapped (State arrays, weights).
class BufferTable {
 public:
  void add(const void* p, size_t bytes, BufRef r) { m_[reinterpret_cast<uintptr_t>(p)] = Entry{bytes, r}; }
  void remove(const void* p) { m_.erase(reinterpret_cast<uintptr_t>(p)); }
  // Throws std::logic_error for memory the device does not know.
  BufRef ref(const void* p) const;

 private:
  struct Entry {
    size_t bytes;
    BufRef r;
  };
  std::map<uintptr_t, Entry> m_;
};

class MetalBackend final : public Backend {
 public:
  // kv_bf16: bf16 KV cache (20,480 B per token on the real model, docs/model.md §5), else fp32.
  MetalBackend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev, bool debug, bool kv_bf16);
  ~MetalBackend() override;

  const char* name() const override { return "metal"; }
  int threads() const override { return 1; }
  std::shared_ptr<Memory> memory() const override;
  Elem kv_elem() const override { return kv_bf16_ ? Elem::BF16 : Elem::F32; }
  int64_t default_chunk() const override { return 512; }
  void sync() override;

  void embed(const int32_t* ids, int64_t S) override;
  void deltanet_block(int layer, const RowSegments& segs) override;
  void attention_block(int layer, const RowSegments& segs) override;
  void moe_block(int layer, int64_t S) override;
  void read_residual(int64_t S, float* out) override;
  void head(int64_t row0, int64_t n, float* logits) override;

  // The MTP head (core/backend.h; docs/model.md §7): its decoder layer is layers_[cfg.n_layers], run by
  // attention_block / moe_block like any other. keep_hidden writes Scratch::hid, mtp_embed builds [embedding |
  // hidden] rows in Scratch::cat with two strided RMSNorms and runs fc into x, mtp_head keeps its last normed row
  // in draft_h_ (outside Scratch: a chained draft survives a step's poisoning). Everything is encoded, so a
  // decode step stays one command buffer; only mtp_head with logits waits for the device (as head does).
  bool has_mtp() const override { return has_mtp_; }
  void keep_hidden(int64_t S) override;
  void store_hidden(int64_t row, Buffer& dst) override;
  void mtp_embed(const int32_t* ids, int64_t n, const Buffer* prev, MtpHidden src) override;
  void mtp_head(int64_t row0, int64_t n, float* logits) override;
  // exact_rows: an S-row chunk runs the one-row step's kernels (the GEMVs and the fused MoE decode over the rows,
  // decode attention per row, the sequential DeltaNet scan), so every row is bit-equal to a one-row step
  // (the speculative verify decides what plain decoding would; batched streams return what they return alone).
  // Without it an S-row chunk runs the prefill kernels (GEMM, attn_prefill, grouped MoE), which sum in another
  // order (fp32: within ~1e-6 relative, test_metal_backend.py). batches_streams: several segments per forward,
  // each with its own state. The GEMVs and the fused MoE decode serve up to Ops::kDecodeRows rows per threadgroup,
  // each weight chunk (each chosen expert) read once for all of them, with every row bit-equal to its one-row step.
  void exact_rows(bool on) override { ops_.exact_rows = on; }
  bool batches_streams() const override { return true; }

  // Decode steps: one command buffer each. Step i reads token slot i & 1 (device-written) or the host slot
  // i & 1 (d.token >= 0), writes its logits to logits slot i & 1 and, with d.draw, its drawn token to
  // token slot (i + 1) & 1, which is also what drawn_token(i) reads: step i + 2 is the next to write it,
  // and the engine holds only the last two steps.
  bool begin_step(State& st, const DecodeStep& d) override;
  void head_step(const DecodeStep& d) override;
  void end_step(State& st, const DecodeStep& d, float* logits) override;
  // Drops a half-encoded command buffer (of a step or a prefill chunk) after a sub-block threw.
  void abandon() override;
  // Device draws: every option set (sampler_metal.h: sample.metal, the CUDA sampler's semantics; plain greedy
  // keeps the argmax kernel). Step i draws with d.uniform, which begin_step writes into uniform slot i & 1.
  bool sampler_begin(const SampleOptions& opt) override;
  int32_t drawn_token(int64_t index) override;
  bool step_logits(int64_t index, float* logits) override;
  // "device_draw" 1 (default) | 0: decline every sampler, so token streams run lock-step (tests compare both).
  // Counters: "sampler_begins" (device-mode streams begun or resumed), "copied_weight_bytes" (weight bytes
  // copied, not wrapped, for want of 16-byte alignment), "step_waits" (begin_step had to wait for an older
  // command buffer: never in a device stream unless debug), "max_inflight" (most command buffers committed and
  // not yet waited for after a step's commit: 2 when the token loop ran ahead).
  // "deltanet_form" 0 (default, auto by chunk length) | 1 sequential | 2 chunked: the DeltaNet recurrence's form
  // (Ops::scan_pick), named as on CUDA so tests force each one.
  void set_flag(const std::string& flag_name, int64_t value) override;
  int64_t flag(const std::string& flag_name) const override;
  std::map<std::string, int64_t> counters() const override;

  Device& device() { return *dev_; }
  BufRef ref(const void* p) const;

 private:
  struct LayerW;
  struct Scratch;
  class DeviceMemory;

  Encoder& enc();
  void submit(int64_t step = -1);      // commit the command buffer being encoded, if any (step: its decode step)
  void wait_inflight(size_t keep);     // wait until at most `keep` command buffers are in flight
  void wait_step(int64_t index);       // wait for decode step `index` (and everything committed before it)
  bool holds_step(int64_t index) const;
  void grow_attention_parts(int64_t keys);
  void reserve(int64_t S);
  BufRef wrap(const void* p, size_t bytes);
  DevLinear wrap_linear(const Linear& l);
  void embed_from(BufRef ids, int64_t S);
  void head_into(int64_t row0, int64_t n, BufRef logits);
  void moe_prefill(const LayerW& L, int64_t row0, int64_t S);
  void moe_decode(const LayerW& L, int64_t S);

  BufRef mtp_ids_slot(const int32_t* ids, int64_t n);

  const Config& cfg_;
  std::shared_ptr<Device> dev_;
  Ops ops_;
  bool debug_, kv_bf16_;
  bool has_mtp_;                                       // the weights carry the MTP head
  std::shared_ptr<DeviceMemory> mem_;  // also the address table of wrapped weights
  std::vector<DevBuffer*> wrapped_;
  DevLinear embed_, lm_head_;
  BufRef final_norm_, rope_;
  std::vector<LayerW> layers_;                         // cfg.n_layers, then the MTP layer (has_mtp_)
  DevLinear mtp_fc_;                                   // MTP: [H, 2H]
  BufRef mtp_norm_embed_, mtp_norm_hidden_, mtp_norm_;
  BufRef draft_h_, mtp_tok_, zero_;                    // MTP: float [H], int32 [2] (host ids per step slot), int32 0
  bool has_draft_ = false;                             // draft_h_ holds an mtp_head row
  int64_t mtp_ids_chunk_ = -1;                         // chunk_ when Scratch::mtp_ids was last written
  std::unique_ptr<Scratch> sc_;
  bool device_draw_ = true;
  int deltanet_form_ = Ops::kScanAuto;       // flag deltanet_form
  int64_t step_waits_ = 0, max_inflight_ = 0;
  int64_t sampler_begins_ = 0;       // samplers accepted (device-mode streams begun or resumed)
  int64_t copied_weight_bytes_ = 0;  // weights copied because they were not 16-byte aligned (wrap)
  std::unique_ptr<CommandBuffer> cb_;                  // being encoded
  struct Inflight {
    std::unique_ptr<CommandBuffer> cb;
    int64_t step;  // the decode step it runs, -1 for prefill work
  };
  std::deque<Inflight> inflight_;                      // committed, oldest first
  std::atomic<bool> queued_{false};                    // cb_ or inflight_ holds work (read by DeviceMemory::settle)
  int64_t chunk_ = 0;                                  // chunks started (ids ring slot)
  // Decode-step slots, outside Scratch (which a larger prefill chunk replaces and debug mode poisons): they
  // carry tokens and logits from one step to the next and to the host.
  BufRef tok_, host_tok_, step_logits_;                // int32 [2], int32 [2], float [2, V]
  BufRef uniform_;                                     // float [2]: each step's draw (DecodeStep::uniform)
  std::unique_ptr<MetalSampler> sampler_;              // made by the first sampler_begin
  bool in_step_ = false;
  DecodeStep step_;                                    // the step being encoded (embed reads its slot)
  int64_t slot_step_[2] = {-1, -1};                    // the step whose results each slot holds
  bool slot_drew_[2] = {false, false};                 // ... and whether it drew a token
};

std::unique_ptr<MetalBackend> make_metal_backend(const Config& cfg, const Weights& w, std::unique_ptr<Device> dev,
                                                 bool debug, bool kv_bf16 = true);

// make_backend("metal"): the options above pick the device (Apple, or the emulator with its settings) and the
// KV element type (backend_options.cpp).
std::unique_ptr<Backend> make_metal_backend(const Config& cfg, const Weights& w, const BackendOptions& options,
                                            bool debug);

}  // namespace lily::metal
