"""`lily bench`: prefill and decode throughput sweeps, one request at a time, optionally against a peer engine.

    from lily.bench import run_bench
    result = run_bench(lily.load(), prefill_lengths=[256, 1024], decode_contexts=[256, 1024], repeats=3,
                       peer="mlx-lm", out="benchmarks/results/cpu_default_model")

Method (benchmarks/results/README.md): prefill tok/s at each prompt length from a fresh state (random valid token ids,
the last row's logits computed, as a real prompt does); decode tok/s at each context length (prefill to the
context untimed, two untimed steps, then `decode_steps` timed greedy single-token steps: forward + argmax fed
back). Each engine gets one untimed warm-up first; every figure is the median of `repeats`. With a peer the
two engines alternate order each round (round r: lily first when r is even), on the same checkpoint bytes.

Speculative decoding (when the model's engine runs an MTP head): one chat prompt (SPECULATIVE_PROMPT, thinking off)
decoded greedily to `speculative_tokens` tokens through `Session.generate`, plain (speculative=False), with K drafted
tokens per step for each K asked (the stream's fallback to plain steps off, so the row measures drafting itself), and
as `lily serve` and `Model.generate` run by default (auto: the default K, falling back to plain steps where drafting
does not pay); decode tok/s (first token to last) side by side, with the acceptance and the tokens per verify forward.
Greedy speculative decoding gives plain decoding's tokens: `same_tokens` says whether they were. Without a head the
result says why instead, once.

The result is a dict {benchmark, date, git_sha, hardware, settings, rows, ratios, speculative}; rows are
{engine, phase: prefill|decode, tokens, tok_s, seconds, repeats_tok_s}; speculative is {available, reason} without a
head, else {available, prompt_tokens, max_tokens, rows: [{mode, speculative, decode_tok_s, repeats_tok_s,
generated_tokens, drafted_tokens, accepted_tokens, verify_steps, acceptance, tokens_per_verify, status, same_tokens,
speedup}]}. `out` writes OUT.json and, when matplotlib is installed (it is not a dependency of lily), OUT.png.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

PEERS = ("mlx-lm",)
# the speculative-vs-plain runs' prompt: a reply long enough to fill the runs, in a model's ordinary register
SPECULATIVE_PROMPT = [{"role": "user", "content": "Explain in detail how a hash table works: hashing, buckets, "
                                                  "collisions, load factor and resizing. Then write a short Python "
                                                  "class that implements one, and walk through an example."}]


# ---- facts about the run ---------------------------------------------------------------------------------
def git_sha() -> str:
    """$LILY_GIT_SHA if set (a copied tree's .git can be stale: the lent GPU's copy reported the session's first
    commit), else `git rev-parse HEAD` of the tree this file is in, else of the working directory (an install built
    out of the tree: benchmarks run from the repository root), else "unknown"."""
    if os.environ.get("LILY_GIT_SHA"):
        return os.environ["LILY_GIT_SHA"]
    for where in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def hardware(model: Any = None) -> dict[str, Any]:
    """CPU model and cores, memory, and the GPU when the model runs on one (or one is visible)."""
    info: dict[str, Any] = {"machine": platform.machine(), "system": platform.system(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    if "cpu" not in info and platform.system() == "Darwin":
        try:
            info["cpu"] = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                         text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        from . import _lily
        bi = dict(_lily.build_info()) if hasattr(_lily, "build_info") else {}
        info["lily_build"] = {k: v for k, v in bi.items() if isinstance(v, (str, int, float, bool, list))}
        if "cuda" in (bi.get("backends") or []) and hasattr(_lily, "cuda_device_count"):
            info["cuda_devices"] = int(_lily.cuda_device_count())
    except Exception:  # noqa: BLE001 - the extension may be missing or CUDA-less; facts only
        pass
    backend = getattr(model, "backend", None)
    if backend is not None:
        info["backend"] = backend
    if backend == "cuda" or info.get("cuda_devices"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                info["gpu"] = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    if backend == "metal":
        info["gpu"] = "Apple GPU (Metal)"
    return info


# ---- engines ---------------------------------------------------------------------------------------------
class _LilyRunner:
    """lily's engine, driven directly (no tokenizer, no sampling options: greedy argmax on the host)."""

    def __init__(self, model: Any):
        self.model, self.engine, self.name = model, model.engine, f"lily-{model.backend}"
        self.state = None

    def prefill(self, ids: np.ndarray) -> None:
        self.state = self.engine.new_state()
        self.engine.forward(self.state, ids, logits="last", chunk_size=self.model.chunk_size)

    def prefill_to(self, ids: np.ndarray) -> int:
        self.state = self.engine.new_state()
        lg = self.engine.forward(self.state, ids, logits="last", chunk_size=self.model.chunk_size)
        return int(np.argmax(np.asarray(lg)[-1]))

    def step(self, token: int) -> int:
        lg = self.engine.forward(self.state, np.array([token], np.int32), logits="last",
                                 chunk_size=self.model.chunk_size)
        return int(np.argmax(np.asarray(lg)[-1]))

    def steps(self, token: int, n: int) -> int:
        """n greedy steps through the engine's token loop (the device draws where it can, one step ahead)."""
        return int(self.engine.decode_greedy(self.state, token, n)[-1])


class _MlxLmRunner:
    """mlx-lm on the same checkpoint folder (its default device: the GPU on a Mac, else the CPU)."""

    name = "mlx-lm"

    def __init__(self, folder: str):
        try:
            import mlx.core as mx
            import mlx_lm
            from mlx_lm.models.cache import make_prompt_cache
        except ImportError as e:
            raise RuntimeError(f"[lily bench] --peer mlx-lm needs mlx and mlx-lm installed ({e})") from None
        self.mx, self._make_cache = mx, make_prompt_cache
        self.model, _ = mlx_lm.load(str(folder))
        self.device = str(mx.default_device())
        self.version = getattr(mlx_lm, "__version__", "?")
        self.cache = None

    def _run(self, ids: np.ndarray) -> Any:
        mx, step = self.mx, 2048  # mlx-lm's own prefill chunk (generate_step's prefill_step_size)
        for i in range(0, max(len(ids) - step, 0), step):
            self.model(mx.array(ids[i:i + step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        start = (max(len(ids) - 1, 0) // step) * step
        out = self.model(mx.array(ids[start:])[None], cache=self.cache)
        y = mx.argmax(out[:, -1, :], axis=-1)
        mx.eval(y)
        return y

    def prefill(self, ids: np.ndarray) -> None:
        self.cache = self._make_cache(self.model)
        self._run(ids)

    def prefill_to(self, ids: np.ndarray) -> int:
        self.cache = self._make_cache(self.model)
        return int(self._run(ids).item())

    def step(self, token: int) -> int:
        mx = self.mx
        out = self.model(mx.array([[token]], dtype=mx.int32), cache=self.cache)
        y = mx.argmax(out[:, -1, :], axis=-1)
        mx.eval(y)
        return int(y.item())


def _peer_runner(peer: str, model: Any) -> Any:
    if peer != "mlx-lm":
        raise ValueError(f"[lily bench] unknown peer {peer!r} (known: {', '.join(PEERS)})")
    if not model.path or not (Path(model.path) / "config.json").is_file():
        raise ValueError("[lily bench] the peer needs the model's checkpoint folder (this model has none)")
    return _MlxLmRunner(model.path)


# ---- measuring -------------------------------------------------------------------------------------------
def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_bench(model: Any, prefill_lengths: Sequence[int] = (256, 512, 1024), decode_contexts: Sequence[int] = (256, 1024),
              repeats: int = 3, peer: str | None = None, *, decode_steps: int = 16, peer_max_tokens: int | None = None,
              seed: int = 0, note: str = "", out: str | os.PathLike | None = None, cooldown_s: float = 0.0,
              log: Callable[[str], None] | None = None, speculative: Sequence[int] | None = None,
              speculative_tokens: int = 256) -> dict[str, Any]:
    """Prefill and decode sweeps on `model` (a `lily.Model`), optionally against `peer` ("mlx-lm").

    peer_max_tokens: the peer runs only at lengths up to this (a slow peer, e.g. mlx-lm on a CPU).
    cooldown_s: idle seconds before every timed run (laptop chips throttle: M-series Macs in particular).
    out: path stem; writes OUT.json and OUT.png (the PNG only when matplotlib is installed).
    speculative: drafted tokens per step of the speculative rows (None: the session's default; []: no speculative
    runs); speculative_tokens: tokens each of those runs generates (see the module docstring).
    log: progress lines (default: print to stderr). Returns the result dict (see the module docstring).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    prefill_lengths = [int(x) for x in prefill_lengths]
    decode_contexts = [int(x) for x in decode_contexts]
    repeats, decode_steps = max(1, int(repeats)), max(1, int(decode_steps))
    need = max(prefill_lengths + [c + 2 + decode_steps for c in decode_contexts] + [1])
    from .speculative import drafts
    if speculative != [] and drafts(model):  # the speculative runs' prompt and reply fit too
        spec_ids = model.apply_chat_template(SPECULATIVE_PROMPT, tokenize=True, enable_thinking=False)
        need = max(need, len(spec_ids) + int(speculative_tokens))
    if need > model.max_context:
        raise ValueError(f"[lily bench] the sweep needs {need} tokens of context and the model was loaded with "
                         f"max_context={model.max_context} (load with a larger max_context)")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.vocab_size, size=max(need, 64)).astype(np.int32)

    runners = [_LilyRunner(model)]
    if peer:
        t0 = time.perf_counter()
        runners.append(_peer_runner(peer, model))
        log(f"[bench] peer {peer} loaded in {time.perf_counter() - t0:.1f} s")
    names = [r.name for r in runners]

    def allowed(r: Any, n: int) -> bool:
        return r is runners[0] or peer_max_tokens is None or n <= peer_max_tokens

    # one untimed warm-up per engine: a short prefill and a few decode steps
    warm = ids[:min(64, min(prefill_lengths + decode_contexts + [64]))]
    for r in runners:
        t = _time(lambda: r.step(r.step(r.prefill_to(warm))))
        log(f"[bench] {r.name}: warm-up {t:.2f} s")

    samples: dict[tuple[str, str, int], list[float]] = {}

    def order(rnd: int) -> list[Any]:
        return runners if rnd % 2 == 0 else runners[::-1]

    for L in prefill_lengths:
        for rnd in range(repeats):
            for r in order(rnd):
                if allowed(r, L):
                    time.sleep(cooldown_s)
                    dt = _time(lambda: r.prefill(ids[:L]))
                    samples.setdefault((r.name, "prefill", L), []).append(dt)
                    log(f"[bench] prefill {L:6d} {r.name:10s} round {rnd}: {L / dt:10.1f} tok/s")

    for C in decode_contexts:
        tok: dict[str, int] = {}
        for r in order(0):  # each engine prefills to the context once, untimed, then two untimed steps
            if allowed(r, C):
                t = r.prefill_to(ids[:C])
                tok[r.name] = r.step(r.step(t))
        for rnd in range(repeats):
            for r in order(rnd):
                if r.name not in tok:
                    continue
                # repeat k continues the same request: its context is C + 2 + k * decode_steps
                snap = getattr(r, "state", None)
                snap = snap.snapshot() if hasattr(snap, "snapshot") else None
                t = tok[r.name]
                time.sleep(cooldown_s)
                t0 = time.perf_counter()
                if hasattr(r, "steps"):  # lily: the engine's own token loop
                    t = r.steps(t, decode_steps)
                else:
                    for _ in range(decode_steps):
                        t = r.step(t)
                dt = time.perf_counter() - t0
                if snap is not None:  # lily: back to context C + 2, so every repeat is at the same context
                    r.state.restore(snap)
                else:
                    tok[r.name] = t
                samples.setdefault((r.name, "decode", C), []).append(dt / decode_steps)
                log(f"[bench] decode  {C:6d} {r.name:10s} round {rnd}: {decode_steps / dt:10.1f} tok/s")

    rows = []
    for (name, phase, n), ts in samples.items():
        per = [n / t for t in ts] if phase == "prefill" else [1 / t for t in ts]
        med_s = statistics.median(ts)
        rows.append({"engine": name, "phase": phase, "tokens": n,
                     "tok_s": (n / med_s) if phase == "prefill" else (1 / med_s),
                     "seconds": med_s, "repeats_tok_s": per})
    rows.sort(key=lambda x: (x["phase"] != "prefill", x["tokens"], names.index(x["engine"])))
    ratios = []
    if peer:
        by = {(x["engine"], x["phase"], x["tokens"]): x["tok_s"] for x in rows}
        for x in rows:
            if x["engine"] == names[0] and (names[1], x["phase"], x["tokens"]) in by:
                ratios.append({"phase": x["phase"], "tokens": x["tokens"], "engines": f"{names[0]}/{names[1]}",
                               "ratio": x["tok_s"] / by[(names[1], x["phase"], x["tokens"])]})
    settings: dict[str, Any] = {
        "model": model.path, "backend": model.backend, "threads": model.threads, "max_context": model.max_context,
        "params": model.params, "weights_bytes": model.nbytes, "chunk_size": model.chunk_size,
        "prefill_lengths": prefill_lengths, "decode_contexts": decode_contexts, "repeats": repeats,
        "decode_steps": decode_steps, "seed": seed, "tokens": "random valid token ids (numpy default_rng(seed))",
        "method": ("one request at a time; prefill from a fresh state, last-row logits; decode = greedy "
                   "single-token steps after an untimed prefill to the context and two untimed steps (lily: "
                   "Engine.decode_greedy, the engine's token loop; a peer: its own step + argmax); one untimed "
                   "warm-up per engine; median of repeats"),
        "cooldown_s": cooldown_s,
        "engines": names}
    if peer:
        pr = runners[1]
        settings["peer"] = {"name": peer, "version": getattr(pr, "version", "?"), "device": getattr(pr, "device", "?"),
                            "max_tokens": peer_max_tokens,
                            "order": "engines alternate order each round (round r: lily first when r is even)",
                            "decode_repeats": "the peer's decode repeats continue one request (context grows by "
                                              "decode_steps per repeat); lily's restore a snapshot"}
    if note:
        settings["note"] = note
    spec = None
    if speculative != []:
        spec = speculative_runs(model, speculative, int(speculative_tokens), repeats, cooldown_s, log)
    result = {"benchmark": "bench", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": git_sha(),
              "hardware": hardware(model), "settings": settings, "rows": rows, "ratios": ratios}
    if spec is not None:
        result["speculative"] = spec
    if out is not None:
        write_result(result, out, log)
    return result


def speculative_runs(model: Any, drafts: Sequence[int] | None, tokens: int, repeats: int, cooldown_s: float = 0.0,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plain vs speculative greedy decoding of SPECULATIVE_PROMPT (see the module docstring); without a head,
    {available: False, reason}."""
    from .speculative import default_drafts, no_head_reason
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    reason = no_head_reason(model)
    if reason is not None:
        why = "no MTP head" if getattr(model, "mtp", None) is None else reason
        log(f"[bench] speculative: {why}")
        return {"available": False, "reason": why}
    k_auto = default_drafts(model.backend)
    ks = list(drafts) if drafts else [k_auto]
    # (label, the speculative option, the stream's own fallback to plain steps)
    modes: list[tuple[str, bool | int | None, bool]] = [("plain", False, True)]
    modes += [(f"speculative k={k}", int(k), False) for k in ks] + [(f"auto (k={k_auto})", None, True)]

    def run(option: bool | int | None, adaptive: bool, n: int) -> Any:
        s = model.session()
        s.speculative_adaptive = adaptive
        return s.generate(SPECULATIVE_PROMPT, max_tokens=n, temperature=0, speculative=option, enable_thinking=False)

    for _, option, adaptive in modes:  # one untimed warm-up each
        run(option, adaptive, min(tokens, 16))
    samples: dict[str, list[Any]] = {label: [] for label, _, _ in modes}
    for rnd in range(repeats):
        for label, option, adaptive in (modes if rnd % 2 == 0 else modes[::-1]):
            time.sleep(cooldown_s)
            r = run(option, adaptive, tokens)
            samples[label].append(r)
            log(f"[bench] {label:18s} round {rnd}: decode {r.stats.decode_tokens_per_s:8.1f} tok/s, "
                f"{r.stats.generated_tokens} tok" + (f", {r.stats.tokens_per_verify:.2f} tok/verify"
                                                      if r.stats.verify_steps else ""))
    plain_ids = samples["plain"][0].token_ids
    rows = []
    for label, option, adaptive in modes:
        runs = samples[label]
        st = runs[-1].stats
        per = [r.stats.decode_tokens_per_s for r in runs]
        rows.append({"mode": label, "speculative": option, "adaptive": adaptive,
                     "decode_tok_s": statistics.median(per), "repeats_tok_s": per,
                     "generated_tokens": st.generated_tokens, "drafted_tokens": st.drafted_tokens,
                     "accepted_tokens": st.accepted_tokens, "verify_steps": st.verify_steps,
                     "acceptance": st.acceptance, "tokens_per_verify": st.tokens_per_verify, "status": st.speculative,
                     "same_tokens": all(r.token_ids == plain_ids for r in runs)})
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / base if base > 0 else None
    return {"available": True, "prompt": SPECULATIVE_PROMPT[0]["content"],
            "prompt_tokens": samples["plain"][0].stats.prompt_tokens, "max_tokens": tokens, "rows": rows,
            "method": ("greedy, the same chat prompt (thinking off) and max_tokens for every mode, each run a fresh "
                       "session (prefill untimed in the figure: decode tok/s from the first token to the last); "
                       "speculative k=K keeps drafting (no fallback); auto is the default of Model.generate and "
                       "lily serve; modes alternate order each round; median of repeats")}


# ---- output ----------------------------------------------------------------------------------------------
def write_result(result: dict[str, Any], out: str | os.PathLike, log: Callable[[str], None] | None = None) -> Path:
    """OUT.json, and OUT.png when matplotlib is installed. Returns the JSON path."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    stem = Path(out)
    if stem.suffix in (".json", ".png"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.parent / (stem.name + ".json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"[bench] wrote {path}")
    png = stem.parent / (stem.name + ".png")
    if plot(result, png):
        log(f"[bench] wrote {png}")
    return path


def plot(result: dict[str, Any], path: str | os.PathLike) -> bool:
    """Two panels (prefill, decode) of tok/s by length, one line per engine. False (with a note) when
    matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no PNG plot (pip install matplotlib)", file=sys.stderr)
        return False
    rows, s, hw = result["rows"], result["settings"], result["hardware"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, phase in zip(axes, ("prefill", "decode")):
        for eng in s["engines"]:
            r = sorted((x for x in rows if x["engine"] == eng and x["phase"] == phase), key=lambda x: x["tokens"])
            if r:
                ax.plot([x["tokens"] for x in r], [x["tok_s"] for x in r], "o-", label=eng)
                for x in r:
                    ax.annotate(f"{x['tok_s']:.0f}", (x["tokens"], x["tok_s"]), textcoords="offset points",
                                xytext=(0, 5), ha="center", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens" if phase == "prefill" else "context tokens")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{phase} ({s['backend']}, {s.get('threads', 0)} threads)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    where = hw.get("gpu") or hw.get("cpu") or hw.get("machine", "")
    model = Path(s["model"]).name if s.get("model") else "model"
    fig.suptitle(f"lily bench: {model} on {where} (batch 1, median of {s['repeats']}; git "
                 f"{str(result.get('git_sha', ''))[:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def format_table(result: dict[str, Any]) -> str:
    """A short table: phase, tokens, tok/s per engine, and the ratio to the peer when there is one."""
    engines = result["settings"]["engines"]
    by = {(x["engine"], x["phase"], x["tokens"]): x["tok_s"] for x in result["rows"]}
    keys = sorted({(x["phase"], x["tokens"]) for x in result["rows"]}, key=lambda k: (k[0] != "prefill", k[1]))
    head = f"{'phase':8s} {'tokens':>7s}" + "".join(f" {e:>14s}" for e in engines)
    if len(engines) > 1:
        head += f" {'ratio':>7s}"
    lines = [head]
    for phase, n in keys:
        vals = [by.get((e, phase, n)) for e in engines]
        line = f"{phase:8s} {n:7d}" + "".join(f" {v:14.1f}" if v is not None else f" {'-':>14s}" for v in vals)
        if len(engines) > 1:
            line += f" {vals[0] / vals[1]:6.2f}x" if None not in vals[:2] else f" {'-':>7s}"
        lines.append(line)
    lines.append("tok/s, batch 1, median of %d; ratio = %s" % (
        result["settings"]["repeats"], " / ".join(engines[:2]) if len(engines) > 1 else "-"))
    spec = result.get("speculative")
    if spec is not None:
        lines += [""] + format_speculative(spec, result["settings"]["repeats"])
    return "\n".join(lines)


def format_speculative(spec: dict[str, Any], repeats: int) -> list[str]:
    """The plain-vs-speculative table (or the one line saying why there is none)."""
    if not spec.get("available"):
        return [f"speculative: {spec.get('reason', 'no MTP head')}"]
    lines = [f"{'decode mode':18s} {'tok/s':>9s} {'speedup':>8s} {'tok/verify':>11s} {'accepted':>9s} {'same':>5s}"]
    for r in spec["rows"]:
        drafted = r["drafted_tokens"] > 0
        tpv = f"{r['tokens_per_verify']:11.2f}" if drafted else f"{'-':>11s}"
        acc = f"{r['acceptance']:9.0%}" if drafted else f"{'-':>9s}"
        same = "yes" if r["same_tokens"] else "NO"
        lines.append(f"{r['mode']:18s} {r['decode_tok_s']:9.1f} {r['speedup'] or 0:7.2f}x {tpv} {acc} {same:>5s}")
        if r["mode"].startswith("auto") and (r["status"] or "").startswith("plain: "):
            lines.append(f"  auto fell back to plain steps: {r['status'][len('plain: '):]}")
    lines.append(f"greedy decode of one chat prompt ({spec['prompt_tokens']} tokens) to {spec['max_tokens']} tokens, "
                 f"median of {repeats}; tok/verify = tokens per verify forward (accepted drafts + 1); same = the "
                 f"tokens plain decoding gave")
    return lines
