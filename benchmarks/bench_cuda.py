"""Full-size CUDA benchmark: Qwen3.6-35B-A3B shapes with random 4-bit weights generated in memory (no disk),
prefill tok/s at several prompt lengths and decode tok/s at several context lengths, the fraction of the
hardware limits measured in the same run, and the decode time by kernel family (torch.profiler sees our kernels).

Decode variants (backend flag cuda_decode; each from the same restored state):
  lily-cuda          fused decode kernels, whole step as one CUDA graph (the default), logits copied to the host
  lily-cuda-nograph  the same fused kernels launched one by one
  lily-cuda-legacy   the sub-block path (engine layer loop, one kernel per op; the path before the fused kernels)
  lily-cuda-greedy   Engine.decode_greedy: graph replays with the argmax on the device, no logits copies

    python3 benchmarks/bench_cuda.py --out results_dir [--prefill-lengths 2048] [--decode-lengths 256,4096,16384]

Writes bench_cuda_decode_h200.json ({hardware, git_sha, settings, rows: [{engine, phase, tokens, tok_s, ...}]})
and a PNG (--name sets the file stem).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from lily import _lily
from lily.testing import full_config
from lily.testing.weights import GROUP, default_quant_bits, linear_modules

BF16_ONE = 0x3F80


def bf16_bits(x: float) -> np.uint16:
    return np.uint16(np.float32(x).view(np.uint32) >> 16)


def synthetic_weights(cfg, seed=0):
    """Random codes sliced from one pool (views, no copies), scales giving each linear std ~ 1/sqrt(in)
    (0.1x on residual outputs, 2x on the router), zero-mean through the bias."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**32, size=1 << 27, dtype=np.uint32)  # 512 MB
    tensors, quant = {}, {}
    for mod, shape in linear_modules(cfg).items():
        bits = default_quant_bits(mod, shape)
        std = 1.0 / np.sqrt(shape[-1])
        if mod.endswith((".out_proj", ".o_proj", ".down_proj")):
            std *= 0.1
        if mod.endswith(".mlp.gate"):
            std *= 2.0
        if bits is None:
            tensors[mod + ".weight"] = np.full(shape, bf16_bits(std), np.uint16)
            continue
        words = int(np.prod(shape[:-1])) * shape[-1] * bits // 32
        off = int(rng.integers(0, pool.size - words))
        tensors[mod + ".weight"] = pool[off:off + words].reshape(*shape[:-1], shape[-1] * bits // 32)
        levels = (1 << bits) - 1
        scale = std / (levels / np.sqrt(12.0))
        gshape = (*shape[:-1], shape[-1] // GROUP)
        tensors[mod + ".scales"] = np.full(gshape, bf16_bits(scale), np.uint16)
        tensors[mod + ".biases"] = np.full(gshape, bf16_bits(-scale * levels / 2), np.uint16)
        quant[mod] = (bits, GROUP)
    H = cfg.hidden_size
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    tensors["model.norm.weight"] = ones(H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[p + ".input_layernorm.weight"] = ones(H)
        tensors[p + ".post_attention_layernorm.weight"] = ones(H)
        if cfg.is_attention(i):
            tensors[p + ".self_attn.q_norm.weight"] = ones(cfg.head_dim)
            tensors[p + ".self_attn.k_norm.weight"] = ones(cfg.head_dim)
        else:
            a = p + ".linear_attn"
            Hv = cfg.linear_num_value_heads
            tensors[a + ".conv1d.weight"] = (0.3 * rng.standard_normal((cfg.conv_dim, cfg.linear_conv_kernel_dim, 1))
                                             ).astype(np.float32)
            tensors[a + ".dt_bias"] = np.zeros(Hv, np.float32)
            tensors[a + ".A_log"] = np.log(rng.uniform(1, 16, Hv)).astype(np.float32)
            tensors[a + ".norm.weight"] = ones(cfg.linear_value_head_dim)
    return tensors, quant


def measure_ceilings():
    """Device copy bandwidth (read + write bytes / s) and bf16 matrix rate, via torch (present on the device)."""
    import torch
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        b.copy_(a)
    ts = []
    for _ in range(5):
        e0.record(); b.copy_(a); e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    bw = 2 * n / float(np.median(ts))
    del a, b
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        m @ m
    torch.cuda.synchronize()
    e0.record()
    for _ in range(10):
        m @ m
    e1.record(); e1.synchronize()
    flops = 10 * 2 * 8192**3 / (e0.elapsed_time(e1) / 1e3)
    return bw, flops, torch.cuda.get_device_name()


def kernel_profile(fn, steps):
    """Kernel time by family over `steps` calls of fn (CUPTI via torch.profiler) and launches per call."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(i)
    fam: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name
        if "gemv_kernel" in name or "gemm_kernel" in name:
            key = ("gemv" if "gemv" in name else "gemm") + (" gate/up" if "true>" in name else "")
        else:
            key = next((k for k in ("proj_kernel", "down_kernel", "scan_dec_kernel", "finish_kernel", "scan_kernel",
                                    "attn_kernel", "attn_combine", "prep_kernel", "conv", "l2norm", "gated_norm",
                                    "route_kernel", "sort_kernel", "combine_kernel", "rms_norm", "embed", "Memcpy",
                                    "Memset") if k in name), name[:40])
        fam.setdefault(key, []).append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    total = sum(sum(v) for v in fam.values())
    return {k: {"launches_per_step": len(v) / steps, "us_per_step": sum(v) / steps, "share": sum(v) / max(total, 1e-9)}
            for k, v in sorted(fam.items(), key=lambda kv: -sum(kv[1]))}


VARIANTS = {"lily-cuda-legacy": 0, "lily-cuda-nograph": 1, "lily-cuda": 2, "lily-cuda-greedy": 2}


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def plot(rows, variants, gpu_name, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        pf = sorted((x for x in rows if x["phase"] == "prefill"), key=lambda x: x["tokens"])
        ax[0].plot([x["tokens"] for x in pf], [x["tok_s"] for x in pf], "o-", label="lily-cuda")
        for v in variants:
            r = sorted((x for x in rows if x["phase"] == "decode" and x["engine"] == v), key=lambda x: x["tokens"])
            if r:
                ax[1].plot([x["tokens"] for x in r], [x["tok_s"] for x in r], "o-", label=v)
        for i, ph in enumerate(("prefill", "decode")):
            ax[i].set_xscale("log", base=2)
            ax[i].set_xlabel("prompt tokens" if ph == "prefill" else "context tokens")
            ax[i].set_ylabel("tokens/s")
            ax[i].set_title(f"{ph} on {gpu_name}")
            ax[i].grid(True, alpha=0.3)
            ax[i].legend(fontsize=8)
        ax[1].set_ylim(bottom=0)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:
        print("plot failed:", e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="bench_cuda_decode_h200")
    ap.add_argument("--replot", default="", help="only redraw the PNG beside this JSON")
    ap.add_argument("--prefill-lengths", default="2048")
    ap.add_argument("--decode-lengths", default="256,4096,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        plot(res["rows"], list(res["settings"]["variants"]), res["hardware"]["gpu"], Path(args.replot).with_suffix(".png"))
        return
    t_start = time.time()
    cfg = full_config()
    pf_lengths = [int(x) for x in args.prefill_lengths.split(",") if x]
    dec_lengths = [int(x) for x in args.decode_lengths.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    n = args.decode_steps
    bw, mflops, gpu_name = measure_ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mflops / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.time()
    tensors, quant = synthetic_weights(cfg)
    gen_s = time.time() - t0
    t0 = time.time()
    max_ctx = max(pf_lengths + dec_lengths) + 64 + (n + 4) * (len(variants) + 1)
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, max_context=max_ctx, backend="cuda")
    load_s = time.time() - t0
    print(f"weights generated {gen_s:.1f}s, uploaded {load_s:.1f}s; fused decode supported: "
          f"{eng.backend_flag('fused_decode_supported')}", flush=True)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, max_ctx).astype(np.int32)
    eng.forward(eng.new_state(), toks[:512], logits="last")  # warm-up (allocations, module load)

    w_bytes, dn_bytes, kv_per_tok = 1.670e9, 126e6, 20480  # perf.md: bytes read per decoded token
    flops_per_tok = 4.9e9
    attn_flops = lambda ctx: cfg.num_hidden_layers // 4 * cfg.num_attention_heads * cfg.head_dim * 4 * ctx  # noqa
    rows, checks, profiles, counters = [], {}, {}, {}

    def prefill(L, st=None):
        st = st if st is not None else eng.new_state()
        t0 = time.perf_counter()
        eng.forward(st, toks[:L], logits="last")
        dt = time.perf_counter() - t0
        tok_s = L / dt
        rows.append({"engine": "lily-cuda", "phase": "prefill", "tokens": L, "tok_s": tok_s, "seconds": dt,
                     "frac_matrix_rate": (flops_per_tok + attn_flops(L / 2)) * tok_s / mflops})
        print(f"prefill L={L:6d} {tok_s:9.1f} tok/s", flush=True)
        return st

    for L in pf_lengths:
        if L not in dec_lengths:
            prefill(L)

    for L in dec_lengths:
        if time.time() - t_start > args.budget_s:
            print(f"budget reached: skipping decode at {L}+", flush=True)
            break
        st = prefill(L)
        snap = st.snapshot()
        dtoks = toks[L:L + n + 4]
        first = {}
        for v in variants:
            eng.set_backend_flag("cuda_decode", VARIANTS[v])
            st.restore(snap)
            try:
                if v == "lily-cuda-greedy":
                    eng.decode_greedy(st, int(dtoks[0]), 3)  # warm-up (graph capture)
                    st.restore(snap)
                    t0 = time.perf_counter()
                    out = eng.decode_greedy(st, int(dtoks[0]), n)
                    dt = time.perf_counter() - t0
                    first[v] = out
                else:
                    lg0 = eng.forward(st, dtoks[:1], logits="last")
                    first[v] = lg0
                    for t in dtoks[1:4]:
                        eng.forward(st, np.array([t], np.int32), logits="last")
                    t0 = time.perf_counter()
                    for t in dtoks[4:4 + n]:
                        eng.forward(st, np.array([t], np.int32), logits="last")
                    dt = time.perf_counter() - t0
            except Exception as e:  # one broken variant must not hide the others
                print(f"decode L={L} {v}: {e!r}", flush=True)
                checks[f"{v}@{L}"] = repr(e)
                continue
            dtok = n / dt
            bytes_tok = w_bytes + dn_bytes + kv_per_tok * L
            rows.append({"engine": v, "phase": "decode", "tokens": L, "tok_s": dtok, "ms_per_token": 1e3 * dt / n,
                         "frac_bandwidth": bytes_tok * dtok / bw, "cuda_decode": eng.backend_flag("cuda_decode")})
            print(f"decode  L={L:6d} {v:18s} {dtok:8.1f} tok/s ({1e3 * dt / n:.3f} ms)", flush=True)
        # Same state, same token: the graph replays the fused kernels bit for bit; the legacy path differs only
        # by summation order; greedy's first token is the argmax of the graph step's logits.
        g = first.get("lily-cuda")
        if g is not None:
            if "lily-cuda-nograph" in first:
                checks[f"graph == nograph bitwise @{L}"] = bool(np.array_equal(g, first["lily-cuda-nograph"]))
            if "lily-cuda-legacy" in first:
                checks[f"fused vs legacy rel_rms @{L}"] = rel_rms(g, first["lily-cuda-legacy"])
                checks[f"fused vs legacy top1 @{L}"] = bool(np.argmax(g) == np.argmax(first["lily-cuda-legacy"]))
            if "lily-cuda-greedy" in first:
                checks[f"greedy[0] == argmax(graph logits) @{L}"] = bool(int(first["lily-cuda-greedy"][0]) ==
                                                                        int(np.argmax(g)))
        if L == dec_lengths[0] and "lily-cuda-greedy" in first:
            # greedy chain vs forward + host argmax over 8 steps (graph path)
            eng.set_backend_flag("cuda_decode", 2)
            st.restore(snap)
            tok, chain = int(dtoks[0]), []
            for _ in range(8):
                tok = int(np.argmax(eng.forward(st, np.array([tok], np.int32), logits="last")[0]))
                chain.append(tok)
            checks[f"greedy chain == forward argmax chain (8) @{L}"] = bool(
                list(first["lily-cuda-greedy"][:8]) == chain)
        if L == 4096 or L == dec_lengths[-1] and 4096 not in dec_lengths:
            for v, mode in (("lily-cuda-nograph", 1), ("lily-cuda-legacy", 0)):
                if v not in variants:
                    continue
                eng.set_backend_flag("cuda_decode", mode)
                st.restore(snap)
                try:
                    profiles[f"{v}@{L}"] = kernel_profile(
                        lambda i: eng.forward(st, dtoks[i:i + 1], logits="last"), 4)
                except Exception as e:  # profiling is a report extra, never a reason to lose the figures
                    profiles[f"{v}@{L}"] = {"error": repr(e)}
        eng.set_backend_flag("cuda_decode", 2)
        for c in ("graph_nodes", "graph_kernels", "graph_captures", "decode_launches"):
            counters[c] = eng.backend_flag(c)
        del st, snap

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"hardware": {"gpu": gpu_name, "copy_bandwidth_Bps": bw, "bf16_matmul_flops": mflops,
                        "host": platform.node(), "cpu_count": os.cpu_count()},
           "git_sha": os.environ.get("LILY_GIT_SHA", "unknown"),
           "settings": {"config": "full_config() (Qwen3.6-35B-A3B shapes), random 4-bit g64 codes, 8-bit router",
                        "chunk": eng.default_chunk, "decode_steps": n, "variants": VARIANTS,
                        "decode_timing": "host wall clock over n steps after 3 warm-up steps, each variant from the "
                                         "same restored state; forward variants copy the logits to the host",
                        "weights_gen_s": gen_s, "upload_s": load_s, "build": _lily.build_info(),
                        "env_LILY_CUDA_DECODE": os.environ.get("LILY_CUDA_DECODE", "")},
           "rows": rows, "checks": checks, "counters": counters, "decode_profiles": profiles}
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=float))
    plot(rows, variants, gpu_name, out / f"{args.name}.png")
    for k, prof in profiles.items():
        if prof and "error" not in prof:
            print(f"\ndecode {k} by kernel family: launches/step, us/step, share")
            for fam, v in list(prof.items())[:12]:
                print(f"  {fam:24s} {v['launches_per_step']:6.1f} {v['us_per_step']:9.1f} {v['share']:.3f}")
    print("\ncounters:", counters)
    print("checks:", json.dumps(checks, default=float))
    print("\nengine              phase    tokens     tok/s   ms/tok  fraction of limit")
    for r in rows:
        frac = r.get("frac_bandwidth", r.get("frac_matrix_rate"))
        ms = f"{r['ms_per_token']:7.3f}" if "ms_per_token" in r else "      -"
        print(f"{r['engine']:19s} {r['phase']:8s} {r['tokens']:6d} {r['tok_s']:9.1f} {ms}  {frac:.3f}")


if __name__ == "__main__":
    main()
