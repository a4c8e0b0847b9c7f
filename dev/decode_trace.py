"""The greedy decode step as it runs, launch by launch (CUPTI through torch.profiler over the recorded step graph):
each launch's start, end and its *marginal* time, end - the previous launch's end, which is what it adds to the
step under programmatic dependent launch (a launch starts early and waits, so its own duration over-counts).
Launches are labelled by their role in the layer (DeltaNet: in, step, out, moe_entry, experts, down; attention:
qkv, prep, attn, combine, o, then the MoE's three), and the marginal times summed by role: where the step's time
goes in place, not kernel by kernel alone (decode_step_profile.py under ncu is that view). Also times the same number of
steps unprofiled, to show what the profiler itself adds.

    python3 dev/decode_trace.py --lengths 4096,131072 --steps 8 [--json out.json]      (H200, ~1 min)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
from bench_cuda_util import kernel_family  # noqa: E402
from lily import _lily  # noqa: E402
from lily.config import ModelConfig  # noqa: E402
from lily.testing.fast_synthetic import conditioned_weights  # noqa: E402
from lily.testing.synthetic import config_dict  # noqa: E402

DELTANET = ["dn_in", "dn_step", "dn_out"]
ATTENTION = ["attn_qkv", "attn_prep", "attn", "attn_combine", "attn_o"]
MOE = ["moe_entry", "moe_experts", "moe_down"]
# the MoE entry and the experts' gate/up in one launch: --moe-launches 2
MOE_OWN_ROUTING = ["moe_entry_experts", "moe_down"]
# the whole MoE sub-block in one launch: --moe-launches 1
MOE_ONE_LAUNCH = ["moe"]


def label_step(names: list[str], moe: list[str] = MOE) -> list[str]:
    """Roles of one step's launches (embed first, argmax last), from the kernel names' sequence; `moe`: the MoE's
    launches."""
    out, i = [], 0
    if names and names[0].startswith("embed"):
        out.append("embed")
        i = 1
    while i < len(names):
        nxt = names[i + 1] if i + 1 < len(names) else ""
        if nxt.startswith("deltanet_step"):
            roles = DELTANET + moe
        elif nxt.startswith("prep") or nxt.startswith("attn"):
            # the prep may be in the attention's launch (exp_attention_prep_front), the split combine in the
            # o-projection's (exp_gemv_combine_front)
            prep = nxt.startswith("prep")
            j = i + (3 if prep else 2)
            combine = j < len(names) and names[j].startswith("attn_combine")
            roles = [r for r in ATTENTION if (prep or r != "attn_prep") and (combine or r != "attn_combine")] + moe
        elif nxt.startswith("gemv"):  # the step in another launch (the in-projection's tail, the out-projection's front)
            roles = ["dn_in", "dn_out"] + moe
        else:  # past the layers: the head, and the greedy step's argmax last
            out += [n.split("_")[0] if n.startswith("argmax") else "head" for n in names[i:]]
            break
        out += roles
        i += len(roles)
    return out[: len(names)]


def trace(eng, st, tok: int, steps: int):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.decode_greedy(st, tok, steps)
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name
                  and "emset" not in e.name), key=lambda e: e.time_range.start)
    # one step = from an embed launch to the next
    starts = [i for i, e in enumerate(evs) if kernel_family(e.name).startswith("embed")]
    per_step = [evs[a:b] for a, b in zip(starts, starts[1:] + [len(evs)])]
    return per_step


def analyse(per_step, moe: list[str] = MOE) -> dict:
    roles: dict[str, list[float]] = {}
    durs: dict[str, list[float]] = {}
    periods, launches = [], []
    for k, st in enumerate(per_step[1:-1], start=1):  # whole steps only, the first and last left out
        names = [kernel_family(e.name) for e in st]
        labels = label_step(names, moe)
        prev_end = per_step[k - 1][-1].time_range.end
        periods.append(st[-1].time_range.end - prev_end)
        launches.append(len(st))
        for e, lab in zip(st, labels):
            roles.setdefault(lab, []).append(e.time_range.end - prev_end)
            durs.setdefault(lab, []).append(e.time_range.end - e.time_range.start)
            prev_end = e.time_range.end
    n = max(len(periods), 1)
    table = {lab: {"launches_per_step": len(v) / n, "marginal_us_per_step": sum(v) / n,
                   "marginal_us_median": float(np.median(v)), "duration_us_median": float(np.median(durs[lab]))}
             for lab, v in roles.items()}
    return {"step_us": float(np.median(periods)) if periods else 0.0, "launches": launches[0] if launches else 0,
            "roles": table}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default="")
    ap.add_argument("--moe-launches", type=int, choices=(1, 2, 3), default=3,
                    help="launches per MoE layer: 3 (entry, experts, down), 2 (own routing: entry + experts, down), "
                         "1 (the MoE launch)")
    a = ap.parse_args()
    moe = {3: MOE, 2: MOE_OWN_ROUTING, 1: MOE_ONE_LAUNCH}[a.moe_launches]
    cfg = ModelConfig.from_dict(config_dict("full"))
    tensors, quant = conditioned_weights(cfg)
    lengths = [int(x) for x in a.lengths.split(",")]
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=max(lengths) + 64, backend="cuda")
    result = {}
    for L in lengths:
        toks = np.random.default_rng(0).integers(0, cfg.vocab_size, L).astype(np.int32)
        st = eng.new_state()
        tok = int(np.argmax(eng.forward(st, toks, logits="last")[-1]))
        eng.decode_greedy(st, tok, 6)  # both step graphs recorded
        t0 = time.perf_counter()
        eng.decode_greedy(st, tok, 32)
        plain_us = (time.perf_counter() - t0) / 32 * 1e6
        per_step = trace(eng, st, tok, a.steps)
        res = analyse(per_step, moe)
        if len(per_step) > 2:  # one whole step's first launches and its last, raw
            one, prev = per_step[1], per_step[0][-1].time_range.end
            labels = label_step([kernel_family(e.name) for e in one], moe)
            for j, (e, lab) in enumerate(zip(one, labels)):
                if j < 16 or j >= len(one) - 4:
                    print(f"  {j:3d} {lab:13s} start {e.time_range.start - prev:+7.2f} end {e.time_range.end - prev:+7.2f}"
                          f"  {kernel_family(e.name)}")
                prev = e.time_range.end
        res["unprofiled_step_us"] = plain_us
        result[L] = res
        print(f"\n== greedy decode at {L}: {res['launches']} launches per step, step {res['step_us']:.1f} us "
              f"under the profiler, {plain_us:.1f} us unprofiled ({1e6 / plain_us:.1f} tok/s)")
        print(f"{'role':14s} {'per step':>8s} {'marginal us/step':>17s} {'share':>6s} {'marginal med':>12s} "
              f"{'duration med':>12s}")
        tot = sum(r["marginal_us_per_step"] for r in res["roles"].values())
        for lab, r in sorted(res["roles"].items(), key=lambda kv: -kv[1]["marginal_us_per_step"]):
            print(f"{lab:14s} {r['launches_per_step']:8.0f} {r['marginal_us_per_step']:17.1f} "
                  f"{r['marginal_us_per_step'] / tot:6.1%} {r['marginal_us_median']:12.2f} {r['duration_us_median']:12.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
