"""Before/after on the H200 in one call (issue 17's "no slower than before, within 3 %"): two or more builds of
lily (ratios against the first), each a folder with its `lily` package and `_lily*.so`, timed in alternating
rounds (round r: the build order reversed when r is odd), each run in its own process on the same in-memory
full-size weights (lily.testing.fast_synthetic, seed 0): prefill of L random tokens (last-row logits) and greedy
decode after it (Engine.decode_greedy: the engine's loop on the device; 3 untimed steps, then --steps timed). Only
API every build has is used. Prints a table (median per build, the ratios to the first) and writes JSON.

    python3 dev/compare_builds.py --builds before=/tmp/before/src,after=src --rounds 3 --out $OUT/compare.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import numpy as np
from lily import _lily
from lily.config import ModelConfig
from lily.testing.fast_synthetic import conditioned_weights
from lily.testing.synthetic import config_dict
lengths, steps, chunk = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
cfg = ModelConfig.from_dict(config_dict("full"))
tensors, quant = conditioned_weights(cfg)
eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=max(lengths) + steps + 16, backend="cuda")
toks = np.random.default_rng(0).integers(0, cfg.vocab_size, max(lengths)).astype(np.int32)
warm = eng.new_state(); eng.forward(warm, toks[:512], logits="last"); eng.decode_greedy(warm, 1, 4); del warm
out = {}
for L in lengths:
    st = eng.new_state()
    t0 = time.perf_counter(); lg = eng.forward(st, toks[:L], logits="last", chunk_size=chunk); pf = time.perf_counter() - t0
    tok = int(np.argmax(lg[-1]))
    eng.decode_greedy(st, tok, 3)
    t0 = time.perf_counter(); ids = eng.decode_greedy(st, tok, steps); dec = time.perf_counter() - t0
    out[L] = {"prefill_tok_s": L / pf, "decode_tok_s": steps / dec, "tokens": [int(t) for t in ids]}
    del st
print("RESULT " + json.dumps(out), flush=True)
"""


def run(path: str, lengths: str, steps: int, timeout: float = 900) -> dict:
    path, *assigns = path.split("|")  # PATH|VAR=VALUE|...: environment variables of this build's process
    path, _, chunk = path.partition("#")  # PATH#N: prefill in chunks of N rows (0 / none: the backend's default)
    env = {**os.environ, **dict(a.split("=", 1) for a in assigns), "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", CHILD, lengths, str(steps), chunk or "0"], env=env, capture_output=True, text=True,
                       timeout=timeout)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"build at {path} failed (rc {r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", required=True,
                    help="name=PYTHONPATH[#CHUNK][|VAR=VALUE...],... (two or more builds; ratios against the first; "
                         "#CHUNK: the prefill chunk rows for that build, the chunk-size ablation; |VAR=VALUE: an "
                         "environment variable of that build's process, a dev patch's experiment switch)")
    ap.add_argument("--lengths", default="512,4096,32768,131072")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="compare_builds.json")
    ap.add_argument("--child-timeout", type=float, default=900, help="seconds a build's process may take per round")
    ap.add_argument("--keep-going", action="store_true",
                    help="a build that fails or times out (a kernel that hangs) is reported and left out of the later "
                         "rounds and the table, instead of ending the run (the first build must not fail)")
    args = ap.parse_args()
    builds = [tuple(b.split("=", 1)) for b in args.builds.split(",")]
    samples: dict[tuple[str, int, str], list[float]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}  # each build's greedy tokens (first round) per length
    failed: dict[str, str] = {}
    for rnd in range(args.rounds):
        for name, path in (builds if rnd % 2 == 0 else builds[::-1]):
            if name in failed:
                continue
            t0 = time.time()
            try:
                res = run(path, args.lengths, args.steps, args.child_timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if not args.keep_going or name == builds[0][0]:
                    raise
                failed[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"round {rnd} {name}: FAILED after {time.time() - t0:.0f} s, left out: {failed[name]}", flush=True)
                continue
            for L, v in res.items():
                tokens.setdefault((name, L), v.pop("tokens"))
                for k, x in v.items():
                    samples.setdefault((name, L, k), []).append(x)
            print(f"round {rnd} {name}: {time.time() - t0:.0f} s " +
                  " ".join(f"{L}:{v['prefill_tok_s']:.0f}/{v['decode_tok_s']:.1f}" for L, v in res.items()), flush=True)
    names = [n for n, _ in builds if n not in failed]
    a = names[0]
    rows = []
    print("\n| L | metric | " + " | ".join(names) + " | " + " | ".join(f"{b}/{a}" for b in names[1:]) + " |")
    print("|---:|---|" + "---:|" * (2 * len(names) - 1))
    for L in [int(x) for x in args.lengths.split(",")]:
        for k in ("prefill_tok_s", "decode_tok_s"):
            med = {n: statistics.median(samples[(n, L, k)]) for n in names}
            row = {"tokens": L, "metric": k, **{n: samples[(n, L, k)] for n in names}}
            row.update({f"ratio_{b}": med[b] / med[a] for b in names[1:]})
            rows.append(row)
            print(f"| {L} | {k} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | " +
                  " | ".join(f"{med[b] / med[a]:.3f}" for b in names[1:]) + " |")
    # The builds' greedy tokens against the first build's: a variant that keeps the arithmetic (same per-lane math,
    # same reduction order) decodes the same tokens; the first differing step says how soon a numerical one drifts.
    same = {}
    for L in [int(x) for x in args.lengths.split(",")]:
        ref = tokens[(a, L)]
        for b in names[1:]:
            t = tokens[(b, L)]
            d = next((i for i, (x, y) in enumerate(zip(ref, t)) if x != y), None)
            same[f"{b}@{L}"] = "same" if d is None else f"first differs at step {d}"
    print("greedy tokens against " + a + ": " + ", ".join(f"{k} {v}" for k, v in same.items()))
    sys.path.insert(0, builds[0][1].split("|")[0].partition("#")[0])  # lily.bench from the first build's path
    from lily.bench import git_sha, hardware
    json.dump({"benchmark": "compare_builds", "git_sha": git_sha(), "hardware": hardware(), "settings": vars(args),
               "rows": rows, "tokens_vs_first": same, "failed": failed}, open(args.out, "w"), indent=1)
    if failed:
        print("failed builds (left out): " + ", ".join(f"{k}: {v}" for k, v in failed.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
