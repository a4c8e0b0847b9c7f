"""Whole-model checks of the CUDA engine against the CPU engine (fp32, the executable spec), judged against a
rounding envelope; shared by benchmarks/cuda_check.py (the GPU script, its table and JSON) and
tests/test_cuda_backend.py (the same checks under pytest where a device is visible).

Envelope (docs/numerics.md): the NumPy reference run with bf16 rounding where a bf16 engine rounds (every matrix
product's activation input and its dequantized weights) against the CPU engine in fp32. The CUDA engine passes
when its agreement with the CPU engine is no worse than that envelope plus ENVELOPE_SLACK_* (lily.testing.tolerances).

Checks per config (check_config): teacher-forced logits over T positions (top-1, perplexity ratio, rel RMS);
per-sub-block residuals (forward_trace); decode steps == one prefill; chunked == unchunked; logits last == all[-1];
snapshot/restore and export/import round trips; the exported KV/DeltaNet state against the CPU engine's; the device
sampler (lily.testing.cuda_sampling_checks). Rows are dicts {config, check, pass, figures...}.
Run the engines with LILY_DEBUG=1 (NaN-poisoned scratch: reads of unwritten memory show as non-finite).
"""
from __future__ import annotations

import time

import numpy as np

from .. import _lily
from ..config import ModelConfig
from ..quant import round_bf16
from ..reference import Bf16Matrix, ReferenceEngine

from .configs import tiny_config_dicts
from .cuda_sampling_checks import check_engine_sampling
from .metrics import perplexity, rel_rms, top1_agreement
from .tolerances import ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1, tol
from .weights import random_weights

# Sub-block residuals: bf16 rounding of GEMM inputs keeps each one within this of the fp32 CPU engine.
SUBBLOCK_REL_RMS = tol("subblock_vs_cpu", "bf16")["rel_rms"]
# Same engine, two paths (decode vs prefill, chunked vs not): only summation order and bf16 rounding order.
SELF_REL_RMS = tol("self_consistency", "bf16")["rel_rms"]
FORMS_TOKENS = 150  # the DeltaNet forms check: two full chunks of 64 and a partial one, whatever --tokens is


def mid_config_dict() -> dict:
    """Real per-head shapes (head_dim 256, GQA 8:1, Dk = Dv = 128, 256 experts top-8) at small width."""
    d = dict(tiny_config_dicts()["tiny"])
    d.update(hidden_size=512, num_hidden_layers=4, vocab_size=1024, num_attention_heads=16, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
             linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
             shared_expert_intermediate_size=512)  # 512: the decode bulk-copy MoE down takes it
    return d


def configs() -> dict[str, ModelConfig]:
    out = {k: ModelConfig.from_dict(v) for k, v in tiny_config_dicts().items()}
    out["mid_real_heads"] = ModelConfig.from_dict(mid_config_dict())
    return out


def bf16_reference(cfg, tensors, quant, max_context):
    ref = ReferenceEngine(cfg, tensors, quant, max_context=max_context)
    w = ref.weights
    dense = w.linear

    def linear(module):
        return Bf16Matrix(round_bf16(dense(module)))

    w.linear = linear
    return ref


def forward_decode(eng, tokens, n_prefill):
    """Prefill n_prefill tokens (all logits), then one decode step per token: logits [len(tokens), V]."""
    st = eng.new_state()
    rows = [eng.forward(st, tokens[:n_prefill], logits="all")]
    for t in tokens[n_prefill:]:
        rows.append(eng.forward(st, np.array([t], np.int32), logits="last"))
    return np.concatenate(rows), st


def check_config(name, cfg, T, results, progress=None):
    """The whole-model checks of one config into `results`; progress(line), if given, gets one line per check as
    it completes (with the seconds since the start), so a run cut short by a timeout (a sanitizer's) shows where."""
    t_start = time.time()

    def add(check, ok, **fig):
        results.append({"config": name, "check": check, "pass": bool(ok), **fig})
        if progress is not None:
            progress(f"  {name}: {check}: {'PASS' if ok else 'FAIL'} ({time.time() - t_start:.1f}s)")

    tensors, quant = random_weights(cfg, seed=11)
    max_ctx = max(T, FORMS_TOKENS) + 8
    cpu = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=max_ctx, backend="cpu")
    t0 = time.time()
    gpu = _lily.Engine(cfg.to_dict(), tensors, quant, max_context=max_ctx, backend="cuda")
    load_s = time.time() - t0
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, T).astype(np.int32)

    # Whole model, teacher forced.
    ref_cpu = cpu.forward(cpu.new_state(), toks, logits="all")
    out = gpu.forward(gpu.new_state(), toks, logits="all")
    ref16 = bf16_reference(cfg, tensors, quant, max_ctx)
    env = ref16.forward(ref16.new_state(), toks, logits="all")
    p_cpu = perplexity(ref_cpu, toks)
    env_top1, env_ppl, env_rms = top1_agreement(env, ref_cpu), perplexity(env, toks) / p_cpu, rel_rms(env, ref_cpu)
    top1, ppl, rms = top1_agreement(out, ref_cpu), perplexity(out, toks) / p_cpu, rel_rms(out, ref_cpu)
    ok = (np.all(np.isfinite(out)) and top1 >= env_top1 - ENVELOPE_SLACK_TOP1
          and abs(ppl - 1) <= abs(env_ppl - 1) + ENVELOPE_SLACK_PPL)
    add("logits vs cpu (teacher forced)", ok, tokens=T, top1=top1, ppl_ratio=ppl, rel_rms=rms, env_top1=env_top1,
        env_ppl_ratio=env_ppl, env_rel_rms=env_rms, load_s=load_s)

    # Per sub-block residual stream on the same tokens.
    n = min(T, 64)
    tr_c = cpu.forward_trace(cpu.new_state(), toks[:n])
    tr_g = gpu.forward_trace(gpu.new_state(), toks[:n])
    names = [k for k in tr_c if k != "logits"]
    errs = {k: rel_rms(tr_g[k], tr_c[k]) for k in names}
    worst = max(errs, key=errs.get)
    add("sub-block residuals vs cpu", errs[worst] <= SUBBLOCK_REL_RMS and errs["embed"] < 1e-6,
        tokens=n, worst=worst, worst_rel_rms=errs[worst], embed_rel_rms=errs["embed"],
        per_block={k: round(v, 6) for k, v in errs.items()})

    # Decode path == prefill path (same engine), 32 prefill rows then single steps.
    dec, st_dec = forward_decode(gpu, toks, 32)
    d_top1, d_rms = top1_agreement(dec, out), rel_rms(dec, out)
    add("decode == prefill (cuda)", np.all(np.isfinite(dec)) and d_rms <= max(SELF_REL_RMS, env_rms)
        and d_top1 >= env_top1 - ENVELOPE_SLACK_TOP1, tokens=T, top1=d_top1, rel_rms=d_rms)

    # The same decode without the CUDA graph (kernels launched one by one): bit for bit the graph's.
    gpu.set_backend_flag("cuda_graph", 0)
    try:
        dec_ng, _ = forward_decode(gpu, toks[:48], 32)
    finally:
        gpu.set_backend_flag("cuda_graph", 1)
    add("decode without the CUDA graph == with", bool(np.array_equal(dec_ng, dec[:48])), tokens=len(dec_ng),
        max_abs=float(np.max(np.abs(dec_ng - dec[:48]))))

    # DeltaNet prefill forms: the chunked TF32 form (its tiles pipelined over chunks) against the sequential fp32
    # scan on the same prompt, forced on every length (the default picks by length, so short runs never chunk).
    if not all(cfg.is_attention(i) for i in range(cfg.num_hidden_layers)):
        ft = np.random.default_rng(5).integers(0, cfg.vocab_size, FORMS_TOKENS).astype(np.int32)
        by_form = {}
        try:
            for form in (1, 2):
                gpu.set_backend_flag("deltanet_form", form)
                by_form[form] = gpu.forward(gpu.new_state(), ft, logits="all")
        finally:
            gpu.set_backend_flag("deltanet_form", 0)  # auto
        f_rms = rel_rms(by_form[2], by_form[1])
        add("DeltaNet chunked == sequential", np.all(np.isfinite(by_form[2])) and f_rms <= max(SELF_REL_RMS, env_rms),
            tokens=FORMS_TOKENS, rel_rms=f_rms, limit=max(SELF_REL_RMS, env_rms))

    # Chunked == unchunked; last == all[-1].
    ch = gpu.forward(gpu.new_state(), toks, logits="all", chunk_size=48)
    c_rms = rel_rms(ch, out)
    add("chunk 48 == default chunk", c_rms <= SELF_REL_RMS, rel_rms=c_rms)
    last = gpu.forward(gpu.new_state(), toks, logits="last")
    l_rms = rel_rms(last[0], out[-1])
    add("logits last == all[-1]", l_rms <= SELF_REL_RMS, rel_rms=l_rms)

    # Snapshot/restore and export/import on device state, then continue decoding.
    cut = min(40, T // 2)
    st = gpu.new_state()
    gpu.forward(st, toks[:cut], logits="none")
    snap = st.snapshot()
    a = gpu.forward(st, toks[cut:cut + 1], logits="last")
    st.restore(snap)
    b = gpu.forward(st, toks[cut:cut + 1], logits="last")
    st2 = gpu.new_state()
    st2.import_arrays(snap.export_arrays())
    c = gpu.forward(st2, toks[cut:cut + 1], logits="last")
    add("snapshot/restore, export/import", np.array_equal(a, b) and np.array_equal(a, c) and st.position == cut + 1,
        max_abs=float(np.max(np.abs(a - c))))

    # Device state exported in the contract's names/shapes, against the CPU engine's after the same tokens.
    sc = cpu.new_state()
    cpu.forward(sc, toks[:cut], logits="none")
    ec, eg = sc.export_arrays(), snap.export_arrays()
    same_keys = sorted(ec) == sorted(eg) and all(np.shape(ec[k]) == np.shape(eg[k]) for k in ec)
    s_err = max((rel_rms(eg[k], ec[k]) for k in ec if k != "position" and np.size(ec[k])), default=0.0)
    add("exported state vs cpu", same_keys and s_err <= SUBBLOCK_REL_RMS, max_rel_rms=s_err,
        nbytes_cuda=snap.nbytes, nbytes_cpu=sc.nbytes)

    check_engine_sampling(name, cfg, gpu, toks, add)
    del gpu, cpu
