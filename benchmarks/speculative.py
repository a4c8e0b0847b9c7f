"""Speculative decoding with the MTP head: plain vs speculative decode speed, acceptance, and the verify's cost.

Two parts, on any backend whose engine runs the head (Engine.has_mtp):
1. The model (default: the bundled one, with its trained head): `lily bench`'s speculative runs
   (lily.bench.speculative_runs: one greedy chat reply, plain, speculative at k = 1..4 drafts per step with the
   fallback off, and the default automatic mode; decode tok/s, drafts accepted, tokens per verify, whether the
   tokens equal plain decoding's; the run fails if they do not).
2. The step's cost by k on the same shapes with a head that drafts what its trunk says (lily.testing.
   drafting_weights at trunk_scale 0: every draft verifies, so one speculative step makes k + 1 tokens): the cost
   of a step with k drafts in plain steps, c(k) = (k + 1) * t_plain / t_token(k), and the speed-up it implies at
   mean tokens per verify 1.5, 2, 2.5 and 3: tau / c(k). (Random weights accept nothing: this part measures cost,
   not the model's acceptance; part 1 measures that.)

    python benchmarks/speculative.py                      # bundled model, CPU
    python benchmarks/speculative.py --model PATH --backend cuda --mtp SOURCE

Writes benchmarks/results/speculative_<tag>.json (hardware, git sha, settings, figures) and a PNG.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from lily.bench import git_sha, hardware, speculative_runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TAUS = (1.5, 2.0, 2.5, 3.0)


def cost_part(cfg, backend: str, ks: list[int], tokens: int, repeats: int) -> dict:
    """c(k): a speculative step's cost in plain steps, on a head whose every draft verifies (cfg: ModelConfig)."""
    from lily import _lily
    from lily.testing import drafting_weights
    t, q = drafting_weights(cfg, 1, 0.0)
    eng = _lily.Engine(cfg.to_dict(), t, q, threads=0, max_context=4096,
                       **({"backend": backend} if backend != "cpu" else {}))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 64).astype(np.int32)

    def run(k: int) -> tuple[float, dict]:
        best, stats = None, {}
        for _ in range(repeats):
            st = eng.new_state()
            first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
            t0 = time.perf_counter()
            if k == 0:
                eng.decode_greedy(st, first, tokens)
            else:
                s = eng.open_stream(st, first, tokens, speculative=k, adaptive=False, temperature=0.0)
                while s.next() >= 0:
                    pass
                s.close()
                stats = s.spec_stats
            dt = (time.perf_counter() - t0) / tokens
            best = dt if best is None else min(best, dt)
        return best, stats

    t_plain, _ = run(0)
    out = {"plain_us_per_token": t_plain * 1e6, "k": {}}
    for k in ks:
        t_tok, stats = run(k)
        tpv = (stats["accepted"] + stats["verifies"]) / stats["verifies"]
        c = tpv * t_tok / t_plain
        out["k"][k] = {"us_per_token": t_tok * 1e6, "tokens_per_verify": tpv, "step_cost_in_plain_steps": c,
                       "implied_speedup": {str(tau): tau / c for tau in TAUS}}
        print(f"  k={k}: step = {c:.2f} plain steps ({tpv:.2f} tok/verify); implied speed-up "
              + ", ".join(f"{tau}: {tau / c:.2f}x" for tau in TAUS), flush=True)
    return out


def rows_part(model, context: int, ks: list[int], repeats: int = 20) -> dict:
    """A verify's main-model cost on any backend, head or not: the forward of k + 1 rows at `context` against one
    decode step there, r(k) = t(k + 1 rows) / t(step), and the speed-up it implies at tau tokens per verify if
    drafting were free: tau / r(k) (the head's k rows, one layer each, come on top). Today's forward of few rows is
    the prefill path (not the exact-rows verify)."""
    eng = model.engine
    rng = np.random.default_rng(0)
    st = eng.new_state()
    eng.forward(st, rng.integers(0, model.vocab_size, context).astype(np.int32), logits="none")
    snap = st.snapshot()

    def timed(n: int) -> float:
        ts = []
        for _ in range(repeats):
            st.restore(snap)
            ids = rng.integers(0, model.vocab_size, n).astype(np.int32)
            t0 = time.perf_counter()
            eng.forward(st, ids, logits="all" if n > 1 else "last")
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    timed(1)  # warm-up (graphs, first-use allocations)
    step = timed(1)
    out = {"context": context, "step_ms": step * 1e3, "k": {}}
    print(f"  one decode step at {context}: {step * 1e3:.3f} ms", flush=True)
    for k in ks:
        t = timed(k + 1)
        r = t / step
        out["k"][k] = {"rows_ms": t * 1e3, "cost_in_steps": r, "implied_speedup": {str(tau): tau / r for tau in TAUS}}
        print(f"  k={k}: {k + 1} rows = {t * 1e3:.3f} ms = {r:.2f} steps; implied speed-up "
              + ", ".join(f"{tau}: {tau / r:.2f}x" for tau in TAUS), flush=True)
    return out


def plot(path: Path, result: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[speculative] matplotlib is not installed: no PNG plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["model"]["rows"]
    names = [r["mode"].replace("speculative ", "") for r in rows]
    a.bar(names, [r["decode_tok_s"] for r in rows], color=["grey"] + ["tab:blue"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        if r["verify_steps"]:
            a.text(i, r["decode_tok_s"], f"{r['tokens_per_verify']:.2f}\ntok/verify", ha="center", va="bottom",
                   fontsize=8)
    a.set_ylabel("decode tok/s (greedy)")
    a.set_title(f"{result['model_name']} on {result['backend']}: plain vs speculative")
    cost = result["cost"]["k"]
    ks = sorted(int(k) for k in cost)
    for tau in TAUS:
        b.plot(ks, [cost[k]["implied_speedup"][str(tau)] for k in ks], marker="o", label=f"{tau} tok/verify")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_xlabel("drafts per step k")
    b.set_ylabel("implied speed-up over plain")
    b.set_title("step cost c(k) -> speed-up at accepted lengths")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder or repo id (default: the bundled model)")
    ap.add_argument("--mtp", default=None, help="where to take the MTP head from (lily.load's mtp=)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per reply")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case (median; the step cost: fastest)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--rows-only", type=int, default=0, metavar="CONTEXT",
                    help="only the main model's cost of k + 1 rows against a step at this context (any backend, "
                         "no head needed); writes speculative_rows_<tag>.json")
    a = ap.parse_args(argv)
    import lily
    ks = [int(k) for k in a.ks.split(",")]
    model = lily.load(a.model, backend=a.backend, mtp=a.mtp)
    if a.rows_only:
        name = Path(model.path).name if a.model else "bundled"
        print(f"[speculative] rows: {name} on {model.backend}", flush=True)
        result = {"model_name": name, "backend": model.backend, "hardware": hardware(), "git_sha": git_sha(),
                  "rows": rows_part(model, a.rows_only, ks)}
        out = RESULTS / f"speculative_rows_{a.tag or model.backend + '_' + name}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[speculative] wrote {out}")
        return 0
    if not model.engine.has_mtp:
        print(f"[speculative] {model.path} on {a.backend}: the engine runs no MTP head; nothing to measure")
        return 1
    name = Path(model.path).name if a.model else "bundled"
    tag = a.tag or f"{a.backend}_{name}"
    print(f"[speculative] {name} on {model.backend}, {a.tokens} tokens", flush=True)
    runs = speculative_runs(model, ks, a.tokens, a.repeats, log=print)
    for r in runs["rows"]:
        print(f"  {r['mode']:18s} {r['decode_tok_s']:8.1f} tok/s ({r['speedup']:.2f}x)  acceptance "
              f"{r['acceptance']:.2f}  tok/verify {r['tokens_per_verify']:.2f}  {r['status'] or ''}", flush=True)
    if not all(r["same_tokens"] for r in runs["rows"]):
        raise SystemExit("[speculative] a speculative run parted from plain decoding: not exact")
    result = {"model_name": name, "backend": model.backend, "hardware": hardware(), "git_sha": git_sha(),
              "settings": {"tokens": a.tokens, "ks": ks, "repeats": a.repeats, "threads": model.threads,
                           "greedy": True},
              "model": runs}
    print("[speculative] step cost with a head whose drafts all verify (lily.testing.drafting_weights)", flush=True)
    result["cost"] = cost_part(model.config, model.backend, ks, a.tokens, a.repeats)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"speculative_{tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[speculative] wrote {out}" + (f" and {out.with_suffix('.png').name}"
                                          if plot(out.with_suffix(".png"), result) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
