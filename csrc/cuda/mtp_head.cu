// The MTP head's own pieces (mtp_head.cuh).
#include "cuda/mtp_head.cuh"

#include <stdexcept>
#include <string>

#include "cuda/embed_norm.cuh"
#include "cuda/gemm.cuh"

namespace lily::cuda {

float* MtpHead::grow(Buffer& b, int64_t floats) {
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  if (b.bytes() < bytes) b = Buffer(mem_, bytes);
  return b.as<float>();
}

void MtpHead::keep_hidden(const float* x, const float* final_norm, int64_t S) {
  rms_norm(st_, x, final_norm, cfg_.rms_eps, S, cfg_.hidden, grow(hid_, S * cfg_.hidden));
  kept_ = S;
}

const float* MtpHead::hidden(int64_t row) const {
  if (row < 0 || row >= kept_)
    throw std::logic_error("[lily] backend 'cuda': no kept hidden row " + std::to_string(row));
  return hid_.as<float>() + row * cfg_.hidden;
}

void MtpHead::embed(const DeviceMtpWeights& w, const DLinear& E, const int32_t* ids,
                    const std::vector<const float*>& rows, float* x) {
  const int64_t H = cfg_.hidden, n = static_cast<int64_t>(rows.size());
  float* t = grow(t_, n * H);
  cuda::embed(st_, E, ids, n, t);
  // [RMSNorm(E[id]) | RMSNorm(h)] as bf16 rows of 2H, each half normed in place from its source row (n <= 9)
  bf16* cat = reinterpret_cast<bf16*>(grow(cat_, n * H));  // n * 2H bf16
  for (int64_t i = 0; i < n; ++i) {
    rms_norm(st_, t + i * H, w.norm_embed, cfg_.rms_eps, 1, H, cat + 2 * i * H);
    rms_norm(st_, rows[i], w.norm_hidden, cfg_.rms_eps, 1, H, cat + 2 * i * H + H);
  }
  linear(st_, w.fc, cat, 2 * H, n, x, H, /*accumulate=*/false);
}

void MtpHead::head(const DeviceMtpWeights& w, const DLinear& lm_head, const float* x, int64_t n, float* logits) {
  const int64_t H = cfg_.hidden;
  bf16* hb = reinterpret_cast<bf16*>(grow(normed_, n * H));
  rms_norm(st_, x, w.norm, cfg_.rms_eps, n, H, hb);
  linear(st_, lm_head, hb, H, n, logits, cfg_.vocab, /*accumulate=*/false);
  rms_norm(st_, x + (n - 1) * H, w.norm, cfg_.rms_eps, 1, H, grow(draft_, H));
  has_draft_ = true;
}

}  // namespace lily::cuda
