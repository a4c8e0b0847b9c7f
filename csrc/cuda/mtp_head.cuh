// The MTP head's own pieces on the CUDA backend (docs/model.md §7; backend_cpu.cpp holds the CPU twin): the hidden
// rows it reads (RMSNorm(x; final_norm) of the main rows, fp32), its input rows fc([RMSNorm(E[id]; norm_embed) |
// RMSNorm(h; norm_hidden)]) and its head RMSNorm(x; mtp.norm) W_lm^T; its decoder layer runs as the backend's attention
// and MoE sub-blocks. Device pointers, stream-ordered. Not yet wired (issue 43): the CUDA backend reports has_mtp()
// false until these have run on a device.
#pragma once
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/memory.h"
#include "cuda/weights_cuda.h"

namespace lily::cuda {

class MtpHead {
 public:
  MtpHead(const Config& cfg, std::shared_ptr<Memory> mem, cudaStream_t st) : cfg_(cfg), mem_(std::move(mem)), st_(st) {}
  // hid[S, H] fp32 = RMSNorm(x[S, H]; final_norm), kept until the next call.
  void keep_hidden(const float* x, const float* final_norm, int64_t S);
  // Row `row` of the kept hidden rows: fp32 [H] (device).
  const float* hidden(int64_t row) const;
  // x[n, H] = fc([RMSNorm(E[ids[i]]; norm_embed) | RMSNorm(rows[i]; norm_hidden)]); ids int32 [n] and rows[i] fp32 [H]
  // on the device.
  void embed(const DeviceMtpWeights& w, const DLinear& E, const int32_t* ids, const std::vector<const float*>& rows,
             float* x);
  // logits[n, V] (device) = RMSNorm(x[n, H]; norm) W_lm^T; the last row's normed vector is kept: draft_hidden().
  void head(const DeviceMtpWeights& w, const DLinear& lm_head, const float* x, int64_t n, float* logits);
  // The hidden row of a chained draft (the last head row), null before the first head.
  const float* draft_hidden() const { return has_draft_ ? draft_.as<float>() : nullptr; }

 private:
  float* grow(Buffer& b, int64_t floats);
  const Config& cfg_;
  std::shared_ptr<Memory> mem_;
  cudaStream_t st_;
  Buffer hid_, t_, normed_, cat_, draft_;
  int64_t kept_ = 0;
  bool has_draft_ = false;
};

}  // namespace lily::cuda
