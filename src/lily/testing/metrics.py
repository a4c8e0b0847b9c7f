"""Comparison metrics shared by tests/ and benchmarks/ (tests import them as `_metrics`); every comparison prints
one line: name, max_abs, rel_rms (style rule 6)."""
from __future__ import annotations

import numpy as np


def rel_rms(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))


def perplexity(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Teacher-forced perplexity of tokens[1:] under logits[:-1] ([S, V], [S])."""
    lg = np.asarray(logits[:-1], np.float64)
    y = np.asarray(tokens[1:])
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
    return float(np.exp(np.mean(lse - lg[np.arange(len(y)), y])))


def assert_close(name: str, out: np.ndarray, ref: np.ndarray, max_rel_rms: float) -> float:
    """Assert rel_rms(out, ref) <= max_rel_rms and that out is finite; prints one diff line."""
    out = np.asarray(out)
    ref = np.asarray(ref)
    assert out.shape == ref.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(out)), f"{name}: output has non-finite values"
    err = rel_rms(out, ref)
    print(f"{name:48s} max_abs {np.max(np.abs(out.astype(np.float64) - ref)):.3e}  rel_rms {err:.3e}")
    assert err <= max_rel_rms, f"{name}: rel_rms {err:.3e} > {max_rel_rms:.1e}"
    return err
