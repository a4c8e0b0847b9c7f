"""MLX-LM as the peer of bench_cuda.py: the same checkpoint folder loaded by mlx_lm.load, prefill and decode timed
the way lily.bench does (mlx-lm's own 2048-token prefill chunks, mx.eval to synchronise, greedy decode steps).

Nothing here may kill the lily measurements: every failure (mlx not importable, out of memory, a kernel error)
becomes a row note ("not measured (...)") and the peer is disabled for the rest of the run.
"""
from __future__ import annotations

import time

import numpy as np


class MlxPeer:
    """mlx-lm on `folder`; `.error` holds why it cannot run (then every measurement returns a note)."""

    name = "mlx-lm"

    def __init__(self, folder: str | None):
        self.runner, self.error, self.info = None, None, {}
        if folder is None:
            self.error = "no checkpoint folder (in-memory weights)"
            return
        try:
            t0 = time.perf_counter()
            from lily.bench import _MlxLmRunner
            self.runner = _MlxLmRunner(folder)
            import mlx.core as mx
            self.info = {"version": self.runner.version, "mlx": getattr(mx, "__version__", "?"),
                         "device": self.runner.device, "load_s": time.perf_counter() - t0}
        except BaseException as e:  # noqa: BLE001 - ImportError, RuntimeError, MemoryError, SystemExit alike
            if isinstance(e, KeyboardInterrupt):
                raise
            self.error = f"{type(e).__name__}: {str(e)[:160]}"
            self.runner = None

    @property
    def ok(self) -> bool:
        return self.runner is not None

    def _guard(self, fn):
        if not self.ok:
            return None, f"not measured ({self.error})"
        try:
            return fn(), None
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self.error = f"failed earlier: {type(e).__name__}: {str(e)[:120]}"
            msg = f"not measured ({type(e).__name__}: {str(e)[:120]})"
            self.runner = None  # a failed MLX run may leave the device in any state: stop using it
            try:
                import gc
                gc.collect()
            except Exception:  # noqa: BLE001
                pass
            return None, msg

    def warm_up(self, ids: np.ndarray) -> str | None:
        return self._guard(lambda: self.runner.step(self.runner.step(self.runner.prefill_to(ids[:64]))))[1]

    def prefill_then_decode(self, ids: np.ndarray, n_decode: int) -> tuple[dict | None, dict | None, str | None]:
        """Prefill len(ids) tokens (timed, mx.eval-synchronised), then n_decode greedy steps (2 untimed first).
        Returns (prefill {seconds}, decode {seconds, steps}, note)."""
        def run():
            r = self.runner
            t0 = time.perf_counter()
            tok = r.prefill_to(ids)
            pf = time.perf_counter() - t0
            dec = None
            if n_decode > 0:
                tok = r.step(r.step(tok))
                t0 = time.perf_counter()
                for _ in range(n_decode):
                    tok = r.step(tok)
                dec = {"seconds": time.perf_counter() - t0, "steps": n_decode}
            r.cache = None  # free the KV cache before lily runs again
            clear = getattr(r.mx, "clear_cache", None)
            if clear is not None:
                clear()
            return {"seconds": pf}, dec
        out, note = self._guard(run)
        if out is None:
            return None, None, note
        return out[0], out[1], None
