"""Ablations of bench_cuda.py: each technique switched off alone through Engine.set_backend_flag(name, value),
measured at the lengths where it matters, the default restored after; and the markdown table written from the
JSON (benchmarks/results/cuda_ablations_h200.md).

A flag the build does not have (backend_flag raises) is recorded once as "not available" and skipped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ablation:
    technique: str
    flag: str
    settings: tuple[int, ...]          # the values that switch the technique off (or pick an alternative)
    decode_lengths: tuple[int, ...]    # contexts at which one-token decode is timed with the setting
    prefill_lengths: tuple[int, ...]   # prompt lengths at which prefill is timed with the setting
    meaning: str


ABLATIONS = (
    Ablation("CUDA graph", "cuda_graph", (0,), (4096, 32768), (),
             "1 the decode step recorded once and replayed (default), 0 its fused kernels launched one by one"),
    # prefill only: decode routes inside the experts' projection kernel, with no host-synced variant
    Ablation("GPU-resident routing", "routing_sync", (1,), (), (4096,), "0 device-resident (default), 1 host-synced"),
    Ablation("GQA packing (decode attention)", "gqa_pack", (0,), (4096, 32768, 131072), (),
             "1 on (default: the tensor-core decode kernel, the 8 query heads of a KV head as the mma N), 0 off: "
             "one query head per block on the CUDA-core kernel"),
    Ablation("split-K", "split_k", (0,), (4096, 32768, 131072), (), "1 on (default), 0 off"),
    Ablation("DeltaNet scan form", "deltanet_form", (1, 2), (), (512, 4096, 16384),
             "0 auto (default: chunked from 128 rows), 1 sequential, 2 chunked (TF32 tensor cores)"),
    Ablation("expert tile size", "expert_tile", (16, 32, 64, 128), (), (4096,), "0 auto (default), else rows"),
)


def scaled(ablations, lengths_map):
    """The same ablations at other lengths (dry run): lengths_map maps each real length to a small one."""
    out = []
    for a in ablations:
        out.append(Ablation(a.technique, a.flag, a.settings,
                            tuple(sorted({lengths_map(x) for x in a.decode_lengths})),
                            tuple(sorted({lengths_map(x) for x in a.prefill_lengths})), a.meaning))
    return tuple(out)


class Ablator:
    """Runs the ablations for one engine; rows accumulate in .rows."""

    def __init__(self, eng, ablations, deadline: float):
        self.eng, self.ablations, self.deadline = eng, ablations, deadline
        self.rows: list[dict] = []
        self.defaults: dict[str, int] = {}
        self.unavailable: dict[str, str] = {}
        for a in ablations:
            if a.flag in self.defaults or a.flag in self.unavailable:
                continue
            try:
                self.defaults[a.flag] = int(eng.backend_flag(a.flag))
            except Exception as e:  # noqa: BLE001 - the C++ side raises for unknown flags
                self.unavailable[a.flag] = f"not available ({str(e)[:100]})"
                self.rows.append({"technique": a.technique, "flag": a.flag, "setting": None, "phase": "-",
                                  "tokens": 0, "tok_s": None, "note": self.unavailable[a.flag]})

    def _run(self, a: Ablation, value: int, phase: str, L: int, baseline: float | None, measure) -> None:
        row = {"technique": a.technique, "flag": a.flag, "setting": value, "default": self.defaults[a.flag],
               "phase": phase, "tokens": L, "tok_s": None, "default_tok_s": baseline}
        if time.time() > self.deadline:
            row["note"] = "not measured (budget)"
            self.rows.append(row)
            return
        try:
            self.eng.set_backend_flag(a.flag, value)
            tok_s = measure()
            row["tok_s"] = tok_s
            if baseline:
                row["change_vs_default"] = tok_s / baseline - 1
        except Exception as e:  # noqa: BLE001 - a broken setting must not stop the others
            row["note"] = f"error: {str(e)[:140]}"
        finally:
            try:
                self.eng.set_backend_flag(a.flag, self.defaults[a.flag])
            except Exception as e:  # noqa: BLE001
                row["note"] = (row.get("note", "") + f"; restoring the default failed: {str(e)[:80]}").lstrip("; ")
        self.rows.append(row)
        tag = f"{row['tok_s']:.1f} tok/s" if row["tok_s"] else row.get("note", "")
        print(f"  ablation {a.flag}={value} {phase} L={L}: {tag}", flush=True)

    def _phase(self, phase: str, L: int, baseline: float | None, measure) -> None:
        todo = [a for a in self.ablations if a.flag in self.defaults
                and L in (a.decode_lengths if phase == "decode" else a.prefill_lengths)]
        if not todo or time.time() > self.deadline:
            for a in todo:
                for v in a.settings:
                    self._run(a, v, phase, L, None, measure)  # rows marked "not measured (budget)"
            return
        try:  # the default measured the same way, right before: the baseline of the changes
            base = measure()
            self.rows.append({"technique": "(all defaults)", "flag": "-", "setting": None, "phase": phase,
                              "tokens": L, "tok_s": base, "default_tok_s": baseline,
                              "note": "baseline re-measured like the ablations; default_tok_s = main sweep"})
        except Exception as e:  # noqa: BLE001
            base = baseline
            print(f"  ablation baseline {phase} L={L} failed: {e!r}", flush=True)
        for a in todo:
            for v in a.settings:
                self._run(a, v, phase, L, base, measure)

    def decode(self, L: int, baseline: float | None, measure) -> None:
        """measure(): tok/s of decode from the state at context L (restored by the caller's closure)."""
        self._phase("decode", L, baseline, measure)

    def prefill(self, L: int, baseline: float | None, measure) -> None:
        """measure(): tok/s of a prefill of L tokens from a fresh state."""
        self._phase("prefill", L, baseline, measure)


def write_markdown(res: dict, path: Path) -> None:
    """Table of the ablation rows of a bench_cuda JSON result."""
    hw = res.get("hardware", {})
    lines = [f"# CUDA ablations on {hw.get('gpu', '?')} (git {str(res.get('git_sha', '?'))[:10]})", "",
             "Each technique switched off alone (Engine.set_backend_flag), all others at their defaults; the "
             "default is re-measured the same way right before (rows '(all defaults)'; their default tok/s column is "
             "the main sweep's figure). Decode: one-token steps "
             "from the same restored state; prefill: a fresh state. Written by benchmarks/bench_cuda.py.", "",
             "| technique | setting (default) | phase | length | tok/s | default tok/s | change vs default |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in res.get("ablations", []):
        setting = (f"{r['flag']}={r['setting']} ({r.get('default', '-')})" if r.get("setting") is not None
                   else r["flag"])
        tok = f"{r['tok_s']:,.1f}" if r.get("tok_s") else r.get("note", "-")
        base = f"{r['default_tok_s']:,.1f}" if r.get("default_tok_s") else "-"
        ch = f"{100 * r['change_vs_default']:+.1f}%" if r.get("change_vs_default") is not None else "-"
        lines.append(f"| {r['technique']} | {setting} | {r['phase']} | {r['tokens'] or '-'} | {tok} | {base} | {ch} |")
    path.write_text("\n".join(lines) + "\n")
