"""A speculative stream among streams decoded together (issue 45): should it keep drafting? Bundled model, CPU.
Per N streams (1 speculative + N-1 plain, greedy, distinct chat prompts, stop tokens banned, T tokens each), until the
speculative stream (stream 0) is done: all streams' tokens per second (agg) and its own (own), three ways (best of R,
interleaved):
  join    : the speculative stream stops drafting and joins with one row (speculative auto's rule) = N plain streams
  batched : it keeps drafting with k and its 1 + k verify rows join the forward (an explicit k)
  alone   : it keeps drafting with k and verifies alone in its next() beside the batched plain rows
Every run's tokens are checked against plain decoding of each prompt.

    python benchmarks/speculative_in_batch.py [T tokens] [R repeats] [k,k,...]     # bundled model, CPU

Prints a line per (N, k) and writes benchmarks/results/speculative_in_batch_cpu_bundled.json (hardware, git sha,
settings, rows {streams, k, mode, aggregate_tok_s, own_tok_s, acceptance})."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import lily
from lily.bench import git_sha, hardware

T = int(sys.argv[1]) if len(sys.argv) > 1 else 128
R = int(sys.argv[2]) if len(sys.argv) > 2 else 3
KS = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2,3").split(",")]
m = lily.load(backend="cpu")
eng = m.engine
ban = list(m.stop_token_ids)
topics = ["a dragon", "a ship", "a garden", "a robot", "a river", "a city", "a clock", "a forest"]
prompts = [np.asarray(m.apply_chat_template([{"role": "user", "content": f"Write a long story about {t}."}],
                                            tokenize=True), np.int32) for t in topics]


def opened(i, k):
    st = eng.new_state()
    p = prompts[i]
    eng.forward(st, p[:-1], logits="none")
    return eng.open_stream(st, int(p[-1]), T, device=True, batch=True, temperature=0.0, bias_ids=ban,
                           bias_vals=[-100.0] * len(ban), speculative=k, adaptive=False)


def run(n, k, mode):
    streams = [opened(0, k if mode != "join" else 0)] + [opened(i, 0) for i in range(1, n)]
    together = streams if mode != "alone" else streams[1:]
    out = [[] for _ in streams]
    t0 = time.perf_counter()
    first_done = None  # (seconds, tokens of all streams) when the speculative stream (stream 0) is done
    while not all(s.ended for s in streams):
        if len(together) > 1:
            eng.step_streams(together)
        for i, s in enumerate(streams):
            if not s.ended and (t := s.next()) >= 0:
                out[i].append(t)
        if first_done is None and streams[0].ended:
            first_done = (time.perf_counter() - t0, sum(len(o) for o in out))
    st = streams[0].spec_stats
    for s in streams:
        s.close()
    return first_done, out, st


rows = []
for n in (1, 2, 4, 8):
    for k in KS:
        best = {}
        stats = None
        for _ in range(R):
            for mode in ("join", "batched", "alone"):
                if n == 1 and mode == "alone":
                    continue
                (dt, toks), out, st = run(n, k, mode)
                if dt < best.get(mode, (1e9,))[0]:
                    best[mode] = (dt, toks)
                if mode == "batched":
                    stats = st
                if "tokens" not in best:
                    best["tokens"] = out
                elif out != best["tokens"]:
                    sys.exit(f"n={n} k={k} {mode}: tokens differ from the join run")
        acc = stats["accepted"] / max(stats["drafted"], 1)
        # until the speculative stream is done: all streams' tokens / s (aggregate) and its own T tokens / s
        line = f"N={n} k={k}: " + ", ".join(f"{mode} {best[mode][1] / best[mode][0]:7.1f} agg {T / best[mode][0]:6.1f} own"
                                             for mode in ("join", "batched", "alone") if mode in best)
        print(line + f"  (speculative stream: {acc:.0%} of drafts accepted, {stats['verifies']} verifies)", flush=True)
        rows += [{"streams": n, "k": k, "mode": mode, "aggregate_tok_s": round(best[mode][1] / best[mode][0], 1),
                  "own_tok_s": round(T / best[mode][0], 1), "acceptance": round(acc, 3)}
                 for mode in ("join", "batched", "alone") if mode in best]

out = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "speculative_in_batch_cpu_bundled.json"
out.write_text(json.dumps({"benchmark": "speculative_in_batch", "hardware": hardware(m), "git_sha": git_sha(),
                           "settings": {"tokens": T, "repeats": R, "k": KS, "threads": eng.threads}, "rows": rows,
                           "command": "python benchmarks/speculative_in_batch.py " + " ".join(sys.argv[1:])},
                          indent=1) + "\n")
print(f"wrote {out}")
