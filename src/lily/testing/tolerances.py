"""The one tolerance table (mirrored in docs/numerics.md), which the tests and the GPU checks of benchmarks/
import. Loosening a value needs a written reason in the commit message.

Keys: (comparison, dtype) -> {metric: threshold}. rel_rms = ||a-b|| / ||b||.
"""

TOLERANCES = {
    # a fp32 backend against the fp32 NumPy reference on the same dequantized weights: only
    # summation order differs (per op and whole model through all layers)
    ("op_vs_reference", "fp32"): {"rel_rms": 1e-5},
    ("model_vs_reference", "fp32"): {"rel_rms": 1e-4, "top1": 0.99},
    # the same engine run two ways (chunked vs unchunked, prefill vs decode, snapshot/restore):
    # identical math, only chunk-dependent summation order
    ("self_consistency", "fp32"): {"rel_rms": 1e-5},
    # lily (fp32 activations) against mlx-lm run in fp32 on the same quantized weights (issue 2)
    ("model_vs_mlx", "fp32"): {"rel_rms": 1e-3, "top1": 0.99},
    # quantize-at-load of HF bf16 weights vs the MLX export of the same weights
    ("hf_vs_mlx_export", "fp32"): {"rel_rms": 1e-5},
    # a GEMM whose tiles hold A and W in half / bf16 (Metal matrix-unit paths) vs the fp32 reference:
    # one rounding of each input (measured 2e-4 for half, 2e-3 for bf16)
    ("op_vs_reference", "f16_tiles"): {"rel_rms": 2e-3},
    ("op_vs_reference", "bf16_tiles"): {"rel_rms": 8e-3},
    # a backend with a bf16 KV cache, fp32 otherwise, vs the fp32 CPU backend: the fp32 bar of docs/numerics.md
    ("model_vs_cpu", "bf16_kv"): {"rel_rms": 1e-3, "top1": 0.99},
    # the CUDA backend (bf16 matrix inputs, fp32 accumulation) vs the fp32 CPU engine, per sub-block residual
    # and per exported state array (lily.testing.cuda_checks): one bf16 rounding of every GEMM input
    ("subblock_vs_cpu", "bf16"): {"rel_rms": 3e-2},
    # the CUDA engine run two ways (decode vs prefill, chunked vs not, DeltaNet chunked vs sequential): only
    # summation order and bf16 rounding order differ (the check takes the larger of this and the envelope)
    ("self_consistency", "bf16"): {"rel_rms": 2e-2},
    # a CUDA sub-block's kernel chain (the attention core, the MoE FFN) vs the fp32 reference (tests/kernels): its input,
    # the weights in the GEMM tiles, the intermediate activations and the output each rounded to bf16 once (~1.6e-3
    # RMS each; five roundings in the MoE chain: ~4e-3 together, the attention core's q, k, v, P and o about the
    # same); a wrong expert, head, key or transposed tile moves the output by 3e-2 or more
    ("op_vs_reference", "bf16_chain"): {"rel_rms": 1.5e-2},
    # the largest gap between two experts' fp32 router logits (relative to the row's logit RMS) at which a backend
    # whose router runs on bf16 operands may pick the other one: its logits err by ~2.3e-3 of that scale (the normed
    # row and the weights each rounded once), so 2e-2 is ~9 such errors; a routing bug picks experts far apart
    ("routing_tie", "bf16"): {"logit_gap": 2e-2},
}

# The CUDA kernels one by one (tests/kernels/test_cuda_*.py, through lily._lily.cuda_ops) against lily.reference on
# the operands the kernel reads (bf16 inputs, weights as the kernel rounds them), per kind of output (each test file's
# header gives the error budget in full). tests/test_cuda_kernel_drivers_build.py checks every entry is used.
KERNEL_CHECKS = {
    # small kernels' fp32 outputs (embed, routing weights, combine, conv + l2norm, prep q, the decode scan): a few
    # fp32 roundings per element (expected 1e-7..1e-6)
    "small_fp32_rel_rms": 1e-5,
    # bf16 outputs (RMSNorm, gated norm, the k cache): one round-to-nearest, 2^-8 relative at most, checked as rel
    # RMS and per element (2^-8 |ref| + the slack times rms(ref), for fp32 error on nearly cancelled elements)
    "small_bf16_rel_rms": 2.0 ** -8,
    "small_bf16_elem_slack": 1e-5,
    # the decode GEMV's fp32 outputs: fp32 sums of 32-element units against fp64 (split-K order only)
    "gemv_rel_rms": 1e-4,
    # its SiLU(gate) * up outputs, rounded to bf16 (2^-8 relative)
    "gemv_dual_rel_rms": 8e-3,
    # its fp32 outputs of a staged input (RMSNorm): the kernel rounds the normed element to bf16 after an
    # fp32 norm (block sum order, rsqrtf), so an element near a rounding boundary may round the other way than the
    # fp64 twin's: 2^-8 of it, ~1e-4 of a 2048-term dot per such element (expected 0-2 per row)
    "gemv_staged_rel_rms": 5e-4,
    # the prefill GEMM's fp32 outputs: bf16 operands, fp32 accumulation (order only, ~1e-6): the bf16 band's low end
    "gemm_rel_rms": 2e-3,
    # its bf16 outputs (the dual SiLU(gate) * up, the MoE down's d): one more bf16 rounding (~1.1e-3)
    "gemm_bf16_rel_rms": 5e-3,
    # attention: o rounded to bf16 (~1.1e-3) and P rounded to bf16 before P V (~1e-3); one key wrongly in or out
    # of the window moves o by >= 8e-3 up to 16K keys
    "attention_rel_rms": 5e-3,
    # the sequential DeltaNet scans: an exact fp32 recurrence (expected ~1e-6)
    "deltanet_seq_rel_rms": 1e-4,
    # the chunked form: Gram and state products on TF32 operands (2^-11), ~3e-4 per product, contracted by decay
    "deltanet_chunk_rel_rms": 4e-3,
    # its gated-norm output (bf16, the norm fused into the output kernel or run after it): the y error above, at most
    # 4e-3 (the RMSNorm rescales each row, the gate weights its elements), then out's bf16 rounding, 2^-9 relative at
    # most: 4e-3 + 2^-9 = 5.95e-3
    "deltanet_chunk_norm_rel_rms": 6e-3,
    # the device sampler: fp32 masses, thresholds and CDF steps, relative
    "sample_rel": 1e-5,
    # its processed-logits scratch against the fp64 processing
    "sample_scratch_rel": 1e-6,
}

# Against mlx-lm in bf16, lily must be no worse than mlx-lm's own fp32-vs-bf16 envelope (docs/numerics.md)
# plus this slack; the envelope itself must be tight enough to mean something.
ENVELOPE_SLACK_TOP1 = 0.01
ENVELOPE_SLACK_PPL = 0.005
ENVELOPE_MIN_TOP1 = 0.90


def tol(comparison: str, dtype: str = "fp32") -> dict:
    return TOLERANCES[(comparison, dtype)]
