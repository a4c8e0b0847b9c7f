"""Full-size correctness for cuda_check.py --full DIR: whole-model logits of the CUDA engine against the CPU engine
(fp32, the executable spec) on the checkpoint of benchmarks/full_checkpoint.py, teacher-forced over T (192)
positions, judged against the rounding envelope of docs/numerics.md (the NumPy reference with bf16 rounding of every
matrix product's operands vs the CPU engine), plus ENVELOPE_SLACK_* (1 point of top-1).

The envelope at full size: the reference dequantizes lazily, one layer at a time (all 256 experts of a module
at once, in threads, rounded to bf16, freed when the next layer starts): ~3 GB of RAM instead of 140 GB.
Its cost is the dequantization (~35 G weights, ~40-60 s on 16 cores) plus the per-token expert loop
(T x 8 x 40 matvecs, ~0.2 ms each: ~40 s at T = 192); --env-positions P (default 96) runs it on the first P
positions only (the CUDA and CPU engines still run all T; the envelope comparison uses the same P rows).
CPU engine at full size: 192 positions read each expert's weights once per 256-row chunk: ~10-20 s on 16 cores.

--explore-conditioning: the envelope (top-1, rel RMS) for a grid of conditioning knobs on a reduced-width
40-layer config on the CPU (no GPU), to choose lily.testing.fast_synthetic's defaults.
"""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lily.quant import bf16_to_f32, dequantize, round_bf16
from lily.reference import Bf16Matrix


def _dequant_bf16(t, q, module, threads):
    w, s, b = t[module + ".weight"], t[module + ".scales"], t[module + ".biases"]
    bits, group = q[module]
    if w.ndim == 3 or w.shape[0] >= 4096:  # split the leading dim over threads (numpy releases the GIL)
        n = w.shape[0]
        out = np.empty((*w.shape[:-1], w.shape[-1] * 32 // bits), np.float32)
        spans = [(i, min(n, i + max(1, n // threads))) for i in range(0, n, max(1, n // threads))]

        def work(sp):
            lo, hi = sp
            out[lo:hi] = round_bf16(dequantize(w[lo:hi], s[lo:hi], b[lo:hi], bits, group))
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, spans))
        return out
    return round_bf16(dequantize(w, s, b, bits, group))


def layer_cached_bf16_reference(cfg, tensors, quant, max_context, threads=0):
    """ReferenceEngine whose linears are bf16-rounded and dequantized per layer (cache dropped at each new layer)."""
    from lily.reference import ReferenceEngine
    ref = ReferenceEngine(cfg, tensors, quant, max_context=max_context)
    w = ref.weights
    threads = threads or min(16, os.cpu_count() or 1)
    cache: dict[str, Bf16Matrix] = {}
    cur = {"layer": None}

    def linear(module):
        m = re.match(r"model\.layers\.(\d+)\.", module)
        layer = int(m.group(1)) if m else module
        if layer != cur["layer"] and m:
            for k in [k for k in cache if k.startswith("model.layers.")]:
                del cache[k]
            cur["layer"] = layer
        if module not in cache:
            if module in quant:
                a = _dequant_bf16(tensors, quant, module, threads)
            else:
                x = tensors[module + ".weight"]
                a = round_bf16(bf16_to_f32(x) if x.dtype == np.uint16 else np.asarray(x, np.float32))
            cache[module] = Bf16Matrix(a)
        return cache[module]

    w.linear = linear
    return ref


def envelope_figures(cpu_logits, env_logits, out_logits, toks):
    """top-1, perplexity ratio, rel RMS of the envelope and of the engine under test, against the CPU engine."""
    from lily.testing.metrics import perplexity, rel_rms, top1_agreement
    p_cpu = perplexity(cpu_logits, toks)
    return ({"top1": top1_agreement(env_logits, cpu_logits), "ppl_ratio": perplexity(env_logits, toks) / p_cpu,
             "rel_rms": rel_rms(env_logits, cpu_logits)},
            {"top1": top1_agreement(out_logits, cpu_logits), "ppl_ratio": perplexity(out_logits, toks) / p_cpu,
             "rel_rms": rel_rms(out_logits, cpu_logits)})


def reduced_40_layer_config(hidden=256, experts=32):
    """Real layer count and head shapes (16 q heads x 256, 2 kv, DeltaNet 16/32 heads x 128) at small width."""
    from lily.config import ModelConfig
    from lily.testing.synthetic import config_dict
    d = dict(config_dict("full"))
    d.update(hidden_size=hidden, vocab_size=2048, num_experts=experts, moe_intermediate_size=128,
             shared_expert_intermediate_size=128)
    return ModelConfig.from_dict(d)


def explore_conditioning(T=48, grid=((0.1, 2.0), (0.1, 4.0), (0.05, 4.0), (0.2, 4.0)), embed_stds=(1.0, 0.022)):
    """Print the envelope (bf16 reference vs CPU fp32) for each (embed_std, residual_scale, router_gain)."""
    from lily import _lily
    from lily.testing.fast_synthetic import conditioned_weights
    cfg = reduced_40_layer_config()
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, T).astype(np.int32)
    res = []
    for es in embed_stds:
        for rs, rg in grid:
            t0 = time.time()
            tensors, quant = conditioned_weights(cfg, 1, embed_std=es, residual_scale=rs, router_gain=rg)
            cpu = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=T + 4, backend="cpu")
            ref = layer_cached_bf16_reference(cfg, tensors, quant, T + 4)
            c = cpu.forward(cpu.new_state(), toks, logits="all")
            e = ref.forward(ref.new_state(), toks, logits="all")
            env, _ = envelope_figures(c, e, e, toks)
            res.append((es, rs, rg, env))
            print(f"embed_std {es:5.3f} residual_scale {rs:4.2f} router_gain {rg:3.1f}: envelope top1 "
                  f"{env['top1']:.3f} ppl ratio {env['ppl_ratio']:.5f} rel_rms {env['rel_rms']:.3e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    return res


def check_full(folder, T, env_positions, results, threads=0, backend="cuda"):
    """Append the full-size case to results (cuda_check.py's row format); prints every figure.
    backend: the engine under test ("cpu" only to dry-run this code without a GPU)."""
    from lily import _lily
    from lily.checkpoint import load_checkpoint
    from lily.config import ModelConfig
    from lily.testing.tolerances import ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1
    t0 = time.time()
    ck = load_checkpoint(folder, progress=False)
    cfg = ck.config if isinstance(ck.config, ModelConfig) else ModelConfig.from_dict(ck.config)
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, T).astype(np.int32)
    times = {"read_s": time.time() - t0}
    t0 = time.time()
    gpu = _lily.Engine(cfg.to_dict(), ck.tensors, ck.quant, max_context=T + 8, backend=backend)
    out = gpu.forward(gpu.new_state(), toks, logits="all")
    times["cuda_s"] = time.time() - t0
    del gpu
    t0 = time.time()
    cpu = _lily.Engine(cfg.to_dict(), ck.tensors, ck.quant, threads=threads, max_context=T + 8, backend="cpu")
    ref_cpu = cpu.forward(cpu.new_state(), toks, logits="all")
    times["cpu_s"] = time.time() - t0
    del cpu
    print(f"[full] cuda {times['cuda_s']:.1f}s, cpu {times['cpu_s']:.1f}s for {T} positions", flush=True)
    P = min(env_positions, T)
    t0 = time.time()
    ref = layer_cached_bf16_reference(cfg, ck.tensors, ck.quant, P + 8, threads)
    env = ref.forward(ref.new_state(), toks[:P], logits="all")
    times["envelope_s"] = time.time() - t0
    del ref
    e, o = envelope_figures(ref_cpu[:P], env, out[:P], toks[:P])
    _, all_t = envelope_figures(ref_cpu, ref_cpu, out, toks)
    ok = (bool(np.all(np.isfinite(out))) and o["top1"] >= e["top1"] - ENVELOPE_SLACK_TOP1
          and abs(o["ppl_ratio"] - 1) <= abs(e["ppl_ratio"] - 1) + ENVELOPE_SLACK_PPL)
    row = {"config": "full_checkpoint", "check": f"logits vs cpu (teacher forced, first {P})", "pass": ok,
           "tokens": T, "env_positions": P, "top1": o["top1"], "ppl_ratio": o["ppl_ratio"], "rel_rms": o["rel_rms"],
           "env_top1": e["top1"], "env_ppl_ratio": e["ppl_ratio"], "env_rel_rms": e["rel_rms"],
           f"all{T}_top1": all_t["top1"], f"all{T}_ppl_ratio": all_t["ppl_ratio"], f"all{T}_rel_rms": all_t["rel_rms"],
           "slack_top1": ENVELOPE_SLACK_TOP1, "slack_ppl": ENVELOPE_SLACK_PPL, **times}
    print(f"[full] envelope (bf16 reference vs cpu, {P} pos): top1 {e['top1']:.4f} ppl {e['ppl_ratio']:.5f} "
          f"rel_rms {e['rel_rms']:.3e} ({times['envelope_s']:.0f}s)\n[full] cuda vs cpu ({P} pos): top1 "
          f"{o['top1']:.4f} ppl {o['ppl_ratio']:.5f} rel_rms {o['rel_rms']:.3e}; all {T}: top1 {all_t['top1']:.4f} "
          f"ppl {all_t['ppl_ratio']:.5f} rel_rms {all_t['rel_rms']:.3e} -> {'PASS' if ok else 'FAIL'}", flush=True)
    results.append(row)
