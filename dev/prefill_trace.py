"""Every kernel launch of one prefill of L tokens, in order, with its device time (CUPTI through torch.profiler),
on the in-memory full-size weights (lily.testing.fast_synthetic, seed 0), after a warm-up prefill. Prints the
launches of the first `--layers` layers one per line, then the time summed by (kernel, occurrence within its
layer kind) over all layers: which projection of which sub-block costs what (bench_cuda.py's kernel profile only
sums by kernel name). Writes the list as JSON with --json.

    python3 dev/prefill_trace.py 4096 --layers 4 --json /tmp/trace.json          (H200, ~20 s)
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
from bench_cuda_util import kernel_family  # noqa: E402
from lily import _lily  # noqa: E402
from lily.config import ModelConfig  # noqa: E402
from lily.testing.fast_synthetic import conditioned_weights  # noqa: E402
from lily.testing.synthetic import config_dict  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("L", type=int, nargs="?", default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    cfg = ModelConfig.from_dict(config_dict("full"))
    tensors, quant = conditioned_weights(cfg)
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=a.L + 16, backend="cuda")
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, a.L).astype(np.int32)
    eng.forward(eng.new_state(), toks, logits="last")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.forward(eng.new_state(), toks, logits="last")
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    rows = [{"name": kernel_family(e.name), "us": e.time_range.end - e.time_range.start, "full": e.name[:160]}
            for e in evs]
    # a layer ends at its MoE combine (the last launch of every layer): split after each combine_kernel
    layers, cur = [], []
    for r in rows:
        cur.append(r)
        if r["name"] == "combine_kernel":
            layers.append(cur)
            cur = []
    total = sum(r["us"] for r in rows)
    print(f"prefill {a.L}: {len(rows)} launches, {total / 1e3:.2f} ms summed, {len(layers)} layers")
    for i, lay in enumerate(layers[: a.layers]):
        print(f"-- layer {i}: {sum(r['us'] for r in lay):.0f} us")
        for r in lay:
            print(f"   {r['us']:8.1f}  {r['name']}")
    kinds: dict[tuple, list] = {}
    for lay in layers:
        kind = "attention" if any(r["name"].startswith("attn") for r in lay) else "deltanet"
        seen: dict[str, int] = {}
        for r in lay:
            n = seen.get(r["name"], 0)
            seen[r["name"]] = n + 1
            kinds.setdefault((kind, r["name"], n), []).append(r["us"])
    print("-- by (layer kind, kernel, occurrence in the layer): layers, us per layer, ms total")
    for (kind, name, n), v in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"   {kind:9s} {name[:26]:26s} #{n}  {len(v):3d}  {sum(v) / len(v):8.1f}  {sum(v) / 1e3:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"L": a.L, "launches": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
