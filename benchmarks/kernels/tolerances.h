// Generated from lily.testing.tolerances.KERNEL_CHECKS (python3 -m lily.testing.tolerances --header);
// edit the table there, not this file. tests/test_cuda_kernel_checks_build.py checks they agree.
#pragma once

namespace tolerances {
constexpr double small_fp32_rel_rms = 1e-05;
constexpr double small_bf16_rel_rms = 0.00390625;
constexpr double small_bf16_elem_slack = 1e-05;
constexpr double gemv_rel_rms = 0.0001;
constexpr double gemv_dual_rel_rms = 0.008;
constexpr double gemv_staged_rel_rms = 0.0005;
constexpr double gemm_rel_rms = 0.002;
constexpr double gemm_bf16_rel_rms = 0.005;
constexpr double attention_rel_rms = 0.005;
constexpr double deltanet_seq_rel_rms = 0.0001;
constexpr double deltanet_chunk_rel_rms = 0.004;
constexpr double deltanet_chunk_norm_rel_rms = 0.006;
constexpr double sample_rel = 1e-05;
constexpr double sample_scratch_rel = 1e-06;
}  // namespace tolerances
