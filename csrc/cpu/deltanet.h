// Gated DeltaNet core (docs/model.md §4.3 steps 3-8, without the projections).
#pragma once
#include "cpu/thread_pool.h"
#include "kernels/params.h"

namespace lily::cpu {

// qkv: [S, C] pre-conv projections, channels [q: Hk*Dk | k: Hk*Dk | v: Hv*Dv]
// z: [S, Hv*Dv]; b, a: [S, Hv]
// conv_w: [C, K]; dt_bias, a_log: [Hv]; norm_w: [Dv]
// conv_state: [K-1, C] previous pre-conv rows, oldest first (updated)
// ssm: [Hv, Dv, Dk] fp32 recurrent state (updated)
// u: scratch [S, C]
// y: [S, Hv*Dv] output = RMSNorm(o; norm_w) * SiLU(z)
// ssm_rows [S, Hv*Dv*Dk] / conv_rows [S, (K-1)*C], when given: the state after each row (the speculative
// verify's rows to roll back to, Backend::keep_state_rows).
void deltanet_forward(ThreadPool& pool, const kp::DeltaNetParams& p, const float* qkv, const float* z,
                      const float* b, const float* a, const float* conv_w, const float* dt_bias,
                      const float* a_log, const float* norm_w, float* conv_state, float* ssm, float* u, float* y,
                      float* ssm_rows = nullptr, float* conv_rows = nullptr);

}  // namespace lily::cpu
