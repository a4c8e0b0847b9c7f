"""Sampled decoding on the CPU: the draws in the extension (the token stream's own, since issue 46.6) against the
host Sampler drawing each step from the logits row handed to Python (lock-step, the path before it; also what
`LILY_DEVICE_SAMPLING=0` / `Session.device_sampling = False` selects today).

Model.generate of one prompt, T 0.7, top-p 0.9, top-k 50, a seed, the end tokens banned so every run makes --tokens
tokens, speculative decoding off; the two modes alternate --repeats times (the best run of each counts). Both must
give the same tokens (one seed, one text), else the run fails.

    python benchmarks/cpu_sampled_decode.py        # bundled model; writes benchmarks/results/cpu_sampled_decode.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lily
from lily.bench import git_sha, hardware

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(model, tokens: int, host: bool) -> tuple[float, list[int]]:
    """Decode tok/s (first token to last) and the tokens, with the draws on the host (lock-step) or in the stream."""
    s = model.session()
    s.device_sampling = not host
    ban = {t: -100.0 for t in model.stop_token_ids}
    ids, first, t_end = [], None, 0.0
    for c in s.generate(PROMPT, stream=True, max_tokens=tokens, temperature=0.7, top_p=0.9, top_k=50, seed=7,
                        logit_bias=ban, speculative=False):
        ids.append(c.token_id)
        if first is None:
            first = time.perf_counter()
        t_end = time.perf_counter()
    return (len(ids) - 1) / (t_end - first), ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = lily.load(backend="cpu")
    run(model, 16, False)  # warm-up
    best = {"extension": 0.0, "host": 0.0}
    seen = {}
    for _ in range(args.repeats):
        for mode in ("host", "extension"):
            tps, ids = run(model, args.tokens, mode == "host")
            best[mode] = max(best[mode], tps)
            seen[mode] = ids
    same = seen["host"] == seen["extension"]
    print(f"sampled decode, {args.tokens} tokens, best of {args.repeats}: host draws {best['host']:.0f} tok/s, "
          f"extension draws {best['extension']:.0f} tok/s ({best['extension'] / best['host']:.2f}x); same tokens: {same}")
    out = {"benchmark": "cpu_sampled_decode", "hardware": hardware(model), "git_sha": git_sha(), "model": "bundled",
           "settings": {**vars(args), "temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 7, "threads": model.engine.threads},
           "host_tok_s": round(best["host"], 1), "extension_tok_s": round(best["extension"], 1),
           "speedup": round(best["extension"] / best["host"], 3), "same_tokens": same,
           "command": "python benchmarks/cpu_sampled_decode.py " + " ".join(sys.argv[1:])}
    path = ROOT / "benchmarks" / "results" / "cpu_sampled_decode.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
