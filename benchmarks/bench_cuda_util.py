"""Helpers of bench_cuda.py: hardware ceilings measured in the run, bytes and FLOPs per token from the config,
kernel time by family (CUPTI via torch.profiler), the plot and the short table."""
from __future__ import annotations

import re
import time

import numpy as np

from lily.testing.weights import GROUP, default_quant_bits, linear_modules


# ---- ceilings -----------------------------------------------------------------------------------------------
def measure_ceilings(device: str = "cuda") -> tuple[float, float, str]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matrix rate in FLOP/s, device name).
    device "cuda": 4 GiB device copy and 8192^3 bf16 matmul via torch; "cpu": NumPy stand-ins for the dry run."""
    if device != "cuda":
        a = np.ones(1 << 26, np.float32)
        b = np.empty_like(a)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter(); np.copyto(b, a); ts.append(time.perf_counter() - t0)  # noqa: E702
        m = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
        t0 = time.perf_counter()
        for _ in range(4):
            m @ m
        return 2 * a.nbytes / float(np.median(ts)), 4 * 2 * 1024**3 / (time.perf_counter() - t0), "cpu"
    import torch
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        b.copy_(a)
    ts = []
    for _ in range(5):
        e0.record(); b.copy_(a); e1.record(); e1.synchronize()  # noqa: E702
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
    e1.record(); e1.synchronize()  # noqa: E702
    flops = 10 * 2 * 8192**3 / (e0.elapsed_time(e1) / 1e3)
    name = torch.cuda.get_device_name()
    del m
    torch.cuda.empty_cache()
    return bw, flops, name


# ---- cost model ---------------------------------------------------------------------------------------------
class CostModel:
    """Bytes read per decoded token and FLOPs per prefilled token, from the config (docs/model.md §6):
    weights: every module's codes + scales + biases, experts scaled by top_k / E, the embedding one row;
    DeltaNet state fp32 read + written; KV bf16 read over the context; prefill FLOPs 2 x active matrix
    parameters (no embedding, no head) + attention QK^T and PV over the causal triangle (average context L/2)."""

    def __init__(self, cfg):
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        w_bytes, mat_params = 0.0, 0.0
        for mod, shape in linear_modules(cfg).items():
            bits = default_quant_bits(mod, shape)
            rows, n_in = int(np.prod(shape[:-1])), shape[-1]
            b = rows * n_in * bits / 8 + rows * (n_in // GROUP) * 4 if bits else rows * n_in * 2
            frac = 1.0
            if ".switch_mlp." in mod:
                frac = k / E
            if mod == "model.embed_tokens":
                frac = 1.0 / shape[0]
            w_bytes += b * frac
            if mod not in ("model.embed_tokens", "lm_head"):
                mat_params += rows * n_in * frac
        self.weight_bytes = w_bytes
        n_lin = sum(not cfg.is_attention(i) for i in range(cfg.num_hidden_layers))
        n_att = cfg.num_hidden_layers - n_lin
        self.deltanet_state_bytes = 2 * 4 * n_lin * cfg.linear_num_value_heads * cfg.linear_key_head_dim * \
            cfg.linear_value_head_dim
        self.kv_bytes_per_token = n_att * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
        self.matrix_flops = 2 * mat_params
        self.attn_flops_per_ctx = n_att * cfg.num_attention_heads * cfg.head_dim * 4
        self.deltanet_flops = n_lin * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4

    def decode_bytes(self, ctx: int) -> float:
        return self.weight_bytes + self.deltanet_state_bytes + self.kv_bytes_per_token * ctx

    def prefill_flops_per_token(self, length: int) -> float:
        return self.matrix_flops + self.deltanet_flops + self.attn_flops_per_ctx * length / 2

    def as_dict(self) -> dict:
        return {"weight_bytes_per_token": self.weight_bytes, "deltanet_state_bytes": self.deltanet_state_bytes,
                "kv_bytes_per_context_token": self.kv_bytes_per_token, "matrix_flops_per_token": self.matrix_flops,
                "attention_flops_per_token_per_context": self.attn_flops_per_ctx,
                "deltanet_flops_per_token": self.deltanet_flops}


# ---- kernel profile -----------------------------------------------------------------------------------------
def kernel_family(name: str) -> str:
    """A kernel's base name: 'void lily::cuda::proj_kernel<4, true>(lily::ProjParams)' -> 'proj_kernel';
    memcpy/memset events keep their kind ('Memcpy DtoH'). Robust to new kernels: no fixed list."""
    if name.startswith(("Memcpy", "Memset")):
        return " ".join(name.split()[:2])
    s = re.sub(r"^(void|__global__)\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth, base = 0, []
    for ch in s:  # drop template arguments and the parameter list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            base.append(ch)
    out = "".join(base).strip().split("::")[-1].split()[-1] if "".join(base).strip() else name[:40]
    return out or name[:40]


def kernel_profile(fn, steps: int) -> dict:
    """Kernel time by family over `steps` calls of fn(i) (CUPTI via torch.profiler) and launches per call.
    Sorted by time; each family {launches_per_step, us_per_step, share}. '_total' holds the sums."""
    from torch.profiler import ProfilerActivity, profile
    fn(0)  # graph capture / first-use costs stay out of the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fn(i + 1)
    fam: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        fam.setdefault(kernel_family(ev.name), []).append(t)
    total = sum(sum(v) for v in fam.values())
    out = {k: {"launches_per_step": len(v) / steps, "us_per_step": sum(v) / steps, "share": sum(v) / max(total, 1e-9)}
           for k, v in sorted(fam.items(), key=lambda kv: -sum(kv[1]))}
    out["_total"] = {"launches_per_step": sum(len(v) for v in fam.values()) / steps, "us_per_step": total / steps,
                     "share": 1.0}
    return out


def format_profile(title: str, prof: dict, top: int = 10) -> str:
    lines = [f"{title}: family, launches/step, us/step, share"]
    for k, v in list(prof.items())[:top + 1]:
        lines.append(f"  {k[:28]:28s} {v['launches_per_step']:7.1f} {v['us_per_step']:9.1f} {v['share']:6.3f}")
    return "\n".join(lines)


# ---- plot and table -----------------------------------------------------------------------------------------
def plot_sweep(rows: list[dict], title: str, path) -> bool:
    """Prefill and decode tok/s vs length (log x), one line per engine."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib not installed")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    engines = sorted({r["engine"] for r in rows if r.get("tok_s")})
    for ax, phase in zip(axes, ("prefill", "decode")):
        for e in engines:
            r = sorted((x for x in rows if x["engine"] == e and x["phase"] == phase and x.get("tok_s")),
                       key=lambda x: x["tokens"])
            if r:
                ax.plot([x["tokens"] for x in r], [x["tok_s"] for x in r], "o-", label=e)
                for x in r:
                    ax.annotate(f"{x['tok_s']:.0f}", (x["tokens"], x["tok_s"]), textcoords="offset points",
                                xytext=(0, 4), ha="center", fontsize=6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens" if phase == "prefill" else "context tokens")
        ax.set_ylabel("tokens/s")
        ax.set_title(phase)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def llamacpp_rows(path, cost: "CostModel", bw: float, mflops: float) -> list[dict]:
    """The llama.cpp peer's llama-bench results (../shared/peers/llamacpp/run_h200.sh: llamacpp_h200.json) as this
    benchmark's rows: engine "llama.cpp", prefill rows for n_gen == 0 (tokens = n_prompt), decode rows for n_gen > 0
    (tokens = n_depth, the context the tg128 run starts from), with the same fractions of the ceilings as lily's."""
    import json as _json
    d = _json.loads(open(path).read())
    meta = d.get("meta", {})
    rows = []
    for x in d.get("results", []):
        decode = int(x.get("n_gen", 0)) > 0
        L = int(x["n_depth"] if decode else x["n_prompt"])
        r = {"engine": "llama.cpp", "phase": "decode" if decode else "prefill", "tokens": L, "tok_s": float(x["avg_ts"]),
             "stddev_tok_s": float(x.get("stddev_ts", 0.0)), "n_ubatch": x.get("n_ubatch"),
             "note": f"llama-bench {meta.get('type', x.get('type_k', ''))} -fa 1 -ngl 99, "
                     + (f"tg{x['n_gen']} at depth {L}" if decode else f"pp{L} ubatch {x.get('n_ubatch')}")}
        r["ms"] = 1e3 / r["tok_s"] if decode else 1e3 * L / r["tok_s"]
        if decode:
            r["frac_bandwidth"] = cost.decode_bytes(L) * r["tok_s"] / bw
        else:
            r["frac_matrix_rate"] = cost.prefill_flops_per_token(L) * r["tok_s"] / mflops
        rows.append(r)
    return rows


def add_llamacpp(rows: list[dict], settings: dict, path, cost: "CostModel", bw: float, mflops: float) -> None:
    """The peer's rows (replacing any earlier llama.cpp rows), the ratios on lily's rows, its meta in the settings."""
    import json as _json
    rows[:] = [r for r in rows if r["engine"] != "llama.cpp"] + llamacpp_rows(path, cost, bw, mflops)
    add_peer_ratios(rows)
    settings["peer"] = {"llama.cpp": _json.loads(open(path).read()).get("meta", {})}


def add_peer_ratios(rows: list[dict]) -> None:
    """ratio_to_llamacpp on each lily row with a llama.cpp row of the same phase and length."""
    peer = {(r["phase"], r["tokens"]): r["tok_s"] for r in rows if r["engine"] == "llama.cpp" and r.get("tok_s")}
    for r in rows:
        p = peer.get((r["phase"], r["tokens"]))
        if r["engine"].startswith("lily") and r.get("tok_s") and p:
            r["ratio_to_llamacpp"] = r["tok_s"] / p


def short_table(rows: list[dict]) -> str:
    """phase, tokens, lily tok/s, MLX-LM tok/s, ratio, fraction of the limit: one line per (phase, length)."""
    by = {}
    for r in rows:
        by.setdefault((r["phase"], r["tokens"]), {})[r["engine"]] = r
    lines = [f"{'phase':7s} {'tokens':>6s} {'lily tok/s':>11s} {'mlx-lm':>9s} {'ratio':>7s} {'of limit':>8s} "
             f"{'greedy':>8s} {'of limit':>8s} {'llama.cpp':>9s} {'ratio':>7s}"]
    for (ph, n) in sorted(by, key=lambda k: (k[0] != "prefill", k[1])):
        d = by[(ph, n)]
        lily = next((v for k, v in d.items() if k.startswith("lily") and "greedy" not in k), None)
        mlx = d.get("mlx-lm")
        lt = f"{lily['tok_s']:11.1f}" if lily and lily.get("tok_s") else f"{(lily or {}).get('note', '-')[:11]:>11s}"
        mt = f"{mlx['tok_s']:9.1f}" if mlx and mlx.get("tok_s") else f"{(mlx or {}).get('note', '-')[:9]:>9s}"
        ratio = f"{lily['ratio_to_mlx']:6.1f}x" if lily and lily.get("ratio_to_mlx") else f"{'-':>7s}"
        frac = (lily or {}).get("frac_bandwidth", (lily or {}).get("frac_matrix_rate"))
        # the llama.cpp ratio against lily's greedy step (the device argmax: llama-bench's tg is greedy too) where
        # there is one, else against the row above
        gr = d.get("lily-cuda-greedy")
        gt = f"{gr['tok_s']:8.1f}" if gr and gr.get("tok_s") else f"{'-':>8s}"
        gf = f"{round(gr['frac_bandwidth'], 3)!s:>8s}" if gr and gr.get("frac_bandwidth") else f"{'-':>8s}"
        lc = d.get("llama.cpp")
        lct = f"{lc['tok_s']:9.1f}" if lc and lc.get("tok_s") else f"{'-':>9s}"
        base = gr if gr and gr.get("ratio_to_llamacpp") else lily
        lr = f"{base['ratio_to_llamacpp']:6.2f}x" if base and base.get("ratio_to_llamacpp") else f"{'-':>7s}"
        lines.append(f"{ph:7s} {n:6d} {lt} {mt} {ratio} {frac if frac is None else round(frac, 3)!s:>8s} {gt} {gf} "
                     f"{lct} {lr}")
    return "\n".join(lines)
