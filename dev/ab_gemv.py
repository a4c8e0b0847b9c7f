"""A/B of the CUDA decode GEMV implementations (backend flag gemv_impl) at a 4K context on the full-size shapes.

Every round times each candidate once, in a rotated order, from the same 4K-token state (restored before each
run): 3 untimed greedy steps, then N timed greedy steps on the device (Engine.decode_greedy). Prints, per
candidate, the median and the spread (min..max) of tok/s over the rounds, and writes JSON.
    PYTHONPATH=src python3 dev/ab_gemv.py --rounds 5 --out $OUT/ab_gemv.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from lily import _lily
from lily.bench import git_sha, hardware
from lily.config import ModelConfig
from lily.testing.fast_synthetic import conditioned_weights
from lily.testing.synthetic import config_dict

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--steps", type=int, default=128)
ap.add_argument("--context", type=int, default=4096)
ap.add_argument("--candidates", default="3,0,1,2,4")
ap.add_argument("--out", default="ab_gemv.json")
args = ap.parse_args()

cfg = ModelConfig.from_dict(config_dict("full"))
tensors, quant = conditioned_weights(cfg)
eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=args.context + 4 * args.steps,
                   backend="cuda")
toks = np.random.default_rng(0).integers(0, cfg.vocab_size, args.context).astype(np.int32)
st = eng.new_state()
lg = eng.forward(st, toks, logits="last")
first = int(np.argmax(lg[-1]))
snap = st.snapshot()
cands = [int(c) for c in args.candidates.split(",")]
res: dict[int, list[float]] = {c: [] for c in cands}
for r in range(args.rounds):
    order = cands[r % len(cands):] + cands[:r % len(cands)]
    for c in order:
        eng.set_backend_flag("gemv_impl", c)
        st.restore(snap)
        eng.decode_greedy(st, first, 3)
        t0 = time.perf_counter()
        eng.decode_greedy(st, first, args.steps)
        res[c].append(args.steps / (time.perf_counter() - t0))
    print(f"round {r}: " + "  ".join(f"{c}:{res[c][-1]:.1f}" for c in cands), flush=True)
rows = [{"gemv_impl": c, "median_tok_s": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
        for c, v in res.items()]
print("\n| gemv_impl | median tok/s | min | max | spread % |\n|---:|---:|---:|---:|---:|")
for row in rows:
    print(f"| {row['gemv_impl']} | {row['median_tok_s']:.1f} | {row['min']:.1f} | {row['max']:.1f} | "
          f"{100 * (row['max'] - row['min']) / row['median_tok_s']:.1f} |")
json.dump({"hardware": hardware(), "git_sha": git_sha(), "settings": vars(args), "rows": rows},
          open(args.out, "w"), indent=1)
