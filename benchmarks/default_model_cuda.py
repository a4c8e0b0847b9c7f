"""The bundled trained model on the CUDA backend vs the CPU backend: teacher-forced agreement on held-out
text (a trained model, so the bf16-activation envelope is meaningful), plus a greedy sample.

    python3 benchmarks/default_model_cuda.py --json OUT.json     (needs a CUDA device)
"""
import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

import lily


def perplexity(logits, tokens):
    lg = logits[:-1].astype(np.float64)
    y = tokens[1:]
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
    return float(np.exp(np.mean(lse - lg[np.arange(len(y)), y])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    text = Path(__file__).resolve().parents[1].joinpath("tests/data/default_model_heldout.txt").read_text()
    cpu = lily.load(backend="cpu")
    cuda = lily.load(backend="cuda")
    tokens = np.asarray(cpu.tokenize(text)[: args.positions], np.int32)
    t0 = time.perf_counter(); lc = cpu.logits(tokens); tc = time.perf_counter() - t0
    t0 = time.perf_counter(); lg = cuda.logits(tokens); tg = time.perf_counter() - t0
    row = {
        "positions": int(tokens.size),
        "top1_cuda_vs_cpu": float(np.mean(lc.argmax(-1) == lg.argmax(-1))),
        "ppl_cpu": perplexity(lc, tokens), "ppl_cuda": perplexity(lg, tokens),
        "rel_rms": float(np.sqrt(np.mean((lg - lc) ** 2) / np.mean(lc ** 2))),
        "seconds_cpu": tc, "seconds_cuda": tg,
    }
    row["ppl_ratio"] = row["ppl_cuda"] / row["ppl_cpu"]
    sample = cuda.generate("The list type", max_tokens=60, temperature=0, stream=False)
    row["greedy_sample_cuda"] = str(sample)
    row["greedy_sample_cpu"] = str(cpu.generate("The list type", max_tokens=60, temperature=0, stream=False))
    row["greedy_equal"] = row["greedy_sample_cuda"] == row["greedy_sample_cpu"]
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    out = {"benchmark": "default_model_cuda_vs_cpu", "git_sha": sha, "rows": [row],
           "settings": {"model": "lily bundled default", "cuda_kv": "bf16", "cpu": "fp32"}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    for k, v in row.items():
        print(f"{k:22s} {v if not isinstance(v, float) else f'{v:.6g}'}")


if __name__ == "__main__":
    main()
