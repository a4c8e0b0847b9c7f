"""A request joining running streams (issue 45's latency check), through `lily serve`.

While N streams decode together (`--parallel N+1`, so the newcomer joins at once), one new request arrives:
- its first token should come within its time to first token alone (the same length, nothing running) plus two
  decode steps of the batch, and one more per slice boundary (the running streams step between its slices); the
  server's own timings.ttft_ms (admission to first token) are checked, the client's (HTTP front end and delivery
  included) reported beside them;
- the running streams' largest inter-token gap during its prefill should stay within one prefill slice
  (`--prefill-slice` tokens; the slowest slice of its prompt timed alone in this process beforehand, scaled to the
  server's own prefill time alone) plus one step.
Two newcomers: a short prompt (one slice) and a long one (several slices). A step is the running streams' median
inter-token gap before the newcomer arrives.

    python benchmarks/join_latency.py                       # bundled model, CPU, 8 running streams
    python benchmarks/join_latency.py --model PATH --backend cuda --streams 8

Prints a table and writes benchmarks/results/join_latency_<tag>.json (hardware, git sha, settings, the figures).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))  # the tests' live-server helper
from _http import httpx  # noqa: E402
from _live import LiveServer  # noqa: E402

import lily  # noqa: E402
from lily.bench import git_sha, hardware  # noqa: E402


def prompt_of(model, n_tokens: int, salt: int) -> str:
    """A text of about n_tokens tokens, distinct per salt (so the prefix cache shares nothing)."""
    rng = np.random.default_rng(salt)
    words = ["river", "stone", "engine", "lamp", "harbour", "signal", "copper", "meadow", "ledger", "orbit"]
    text = f"Note {salt}: "
    while len(model.tokenize(text)) < n_tokens:
        text += " ".join(rng.choice(words, 16)) + ". "
    return text


def prompt_of_len(text: str, salt: int, n_words: int | None = None) -> str:
    """Another text of about the same length as `text` (its words after a different note number): nothing shared
    with it beyond the first few tokens, so the prefix cache gives it nothing."""
    body = text.split(": ", 1)[1] if ": " in text else text
    words = body.split(" ")
    if n_words is not None:
        words = words[:n_words]
    rng = np.random.default_rng(salt)
    return f"Note {salt}: " + " ".join(rng.permutation(words))


def solo_slices(model, text: str, slice_tokens: int) -> list[float]:
    """Seconds of each --prefill-slice piece of the prompt's prefill, alone on a fresh state (the running streams'
    gap bound: one piece plus one step)."""
    ids = np.asarray(model.tokenize(text), np.int32)
    eng = model.engine
    eng.forward(eng.new_state(), ids[:slice_tokens], logits="last")  # warm-up
    st, out = eng.new_state(), []
    for a in range(0, len(ids), slice_tokens):
        t0 = time.perf_counter()
        eng.forward(st, ids[a:a + slice_tokens], logits="last")
        out.append(time.perf_counter() - t0)
    return out


# one client, its connections kept alive: a client made per request (httpx.stream) costs ~50 ms of its own setup,
# which the first-token times would count
CLIENT = httpx.Client(timeout=600)


class Stream(threading.Thread):
    """A streaming /v1/completions request; records each chunk's arrival time and the final timings."""

    def __init__(self, srv: LiveServer, prompt: str, max_tokens: int, ban: dict[str, float]):
        super().__init__(daemon=True)
        self.srv, self.body = srv, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                    "temperature": 0, "logit_bias": ban}
        self.sent = 0.0
        self.arrivals: list[float] = []
        self.timings: dict = {}

    def run(self) -> None:
        self.sent = time.perf_counter()
        with CLIENT.stream("POST", self.srv.url + "/v1/completions", json=self.body, headers=self.srv.headers()) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    self.arrivals.append(time.perf_counter())
                if "timings" in ev:
                    self.timings = ev["timings"]


def gaps_between(streams: list[Stream], t0: float, t1: float) -> list[float]:
    """Every running stream's inter-token gaps that overlap [t0, t1]."""
    out = []
    for s in streams:
        a = np.array(s.arrivals)
        for prev, nxt in zip(a[:-1], a[1:]):
            if nxt >= t0 and prev <= t1:
                out.append(nxt - prev)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--streams", type=int, default=8, help="running streams")
    ap.add_argument("--prompt", type=int, default=64, help="running streams' prompt tokens")
    ap.add_argument("--short", type=int, default=100, help="the short newcomer's prompt tokens")
    ap.add_argument("--long", type=int, default=1800, help="the long newcomer's prompt tokens")
    ap.add_argument("--prefill-slice", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="runs per newcomer; the table shows each figure's median")
    ap.add_argument("--tag", default="cpu_bundled")
    args = ap.parse_args()

    model = lily.load(args.model, backend=args.backend) if args.model else lily.load(backend=args.backend)
    ban = {str(t): -100.0 for t in model.stop_token_ids}
    prompts = {kind: prompt_of(model, n, 7000 + i) for i, (kind, n) in enumerate((("short", args.short),
                                                                                   ("long", args.long)))}
    slice_s = {kind: solo_slices(model, p, args.prefill_slice) for kind, p in prompts.items()}
    del model  # (its tokenizer made the prompts; the server loads its own)
    # after LiveServer's own --backend: the last one counts
    extra = ["--backend", args.backend, "--parallel", str(args.streams + 1), "--prefill-slice", str(args.prefill_slice)]

    def server() -> LiveServer:
        return LiveServer(Path(args.model) if args.model else None, Path("/tmp/join_latency.log"), *extra,
                          max_context=8192)

    runs = []
    for i, (kind, n) in enumerate([("short", args.short), ("long", args.long)] * args.repeats):
        srv = server()  # a fresh server per newcomer: nothing cached, the running streams ended by stop()
        try:
            Stream(srv, prompt_of_len(prompts[kind], 999), 2, ban).run()  # warm-up
            alone = Stream(srv, prompt_of_len(prompts[kind], 998), 2, ban)  # its length, nothing running
            alone.run()
            running = [Stream(srv, prompt_of_len(prompts["short"][:args.prompt * 5], 100 * i + j, args.prompt),
                              100000, ban) for j in range(args.streams)]
            for s in running:
                s.start()
            while min(len(s.arrivals) for s in running) < 24:  # all decoding, in step
                time.sleep(0.05)
            t_ready = time.perf_counter()
            time.sleep(1.0)
            step = float(np.median(gaps_between(running, t_ready, time.perf_counter())))
            probe = Stream(srv, prompts[kind], 2, ban)
            probe.run()
            ttft, ttft_alone = probe.arrivals[0] - probe.sent, alone.arrivals[0] - alone.sent
            during = gaps_between(running, probe.sent, probe.arrivals[0])
            # the slowest piece as the server runs it: the in-process piece times scaled to the server's own prefill
            # alone (its per-request work, e.g. the prefix cache's snapshot, makes it ~10-25% slower here)
            slice_max = max(slice_s[kind]) * (alone.timings["ttft_ms"] / 1e3) / sum(slice_s[kind])
            # the worker's own view (timings.ttft_ms: from the request's admission to its first token) and the client's
            # (from sending to the first event: the HTTP front end and the delivery included)
            srv_alone, srv_join = alone.timings["ttft_ms"] / 1e3, probe.timings["ttft_ms"] / 1e3
            bound = srv_alone + (len(slice_s[kind]) + 1) * step  # a step between slices, and up to two around them
            runs.append({"newcomer": kind, "prompt_tokens": int(probe.timings["prompt_n"]),
                         "slices": len(slice_s[kind]), "step_s": round(step, 4),
                         "server_ttft_alone_s": round(srv_alone, 4), "server_ttft_s": round(srv_join, 4),
                         "ttft_bound_s": round(bound, 4), "ttft_ok": bool(srv_join <= bound),
                         "client_ttft_alone_s": round(ttft_alone, 4), "client_ttft_s": round(ttft, 4),
                         "slice_alone_max_s": round(slice_max, 4), "max_gap_s": round(max(during), 4),
                         "gap_bound_s": round(slice_max + step, 4), "gap_ok": bool(max(during) <= slice_max + step)})
        finally:
            srv.stop()
    rows = []
    for kind in ("short", "long"):
        mine = [r for r in runs if r["newcomer"] == kind]
        med = {k: float(np.median([r[k] for r in mine])) for k, v in mine[0].items() if isinstance(v, float)}
        rows.append({"newcomer": kind, "prompt_tokens": mine[0]["prompt_tokens"], "slices": mine[0]["slices"], **med,
                     "ttft_ok": med["server_ttft_s"] <= med["ttft_bound_s"],
                     "gap_ok": med["max_gap_s"] <= med["gap_bound_s"]})
    print(f"{args.streams} running streams, {args.backend}, --prefill-slice {args.prefill_slice}, "
          f"medians of {args.repeats} runs")
    print("| newcomer | prompt | slices | step ms | TTFT alone ms | TTFT joining ms | bound | client alone / joining ms "
          "| max gap ms | bound |")
    for r in rows:
        ms = lambda k: f"{r[k] * 1e3:.0f}"  # noqa: E731
        print(f"| {r['newcomer']} | {r['prompt_tokens']} | {r['slices']} | {r['step_s'] * 1e3:.1f} | "
              f"{ms('server_ttft_alone_s')} | {ms('server_ttft_s')} | {ms('ttft_bound_s')} "
              f"{'ok' if r['ttft_ok'] else 'OVER'} | {ms('client_ttft_alone_s')} / {ms('client_ttft_s')} | "
              f"{ms('max_gap_s')} | {ms('gap_bound_s')} {'ok' if r['gap_ok'] else 'OVER'} |")
    out = {"benchmark": "join_latency", "hardware": hardware(), "git_sha": git_sha(), "backend": args.backend,
           "model": args.model or "bundled", "settings": vars(args), "rows": rows, "runs": runs,
           "command": "python benchmarks/join_latency.py " + " ".join(sys.argv[1:])}
    path = ROOT / "benchmarks" / "results" / f"join_latency_{args.tag}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if all(r["ttft_ok"] and r["gap_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
