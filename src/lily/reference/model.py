"""The whole model, layer by layer, and `ReferenceEngine`: the NumPy twin of the engine contract.

Slow and obvious on purpose: it is the executable spec every backend is tested against.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import ModelConfig
from .attention import attention_mixer
from .deltanet import deltanet_mixer
from .linear import Weights
from .moe import moe_ffn
from .ops import rms_norm


class ReferenceState:
    """KV per attention layer [T, Hkv, D]; conv [K-1, C] and recurrent [Hv, Dv, Dk] per DeltaNet layer."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.position = 0
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.conv: dict[int, np.ndarray] = {}
        self.rec: dict[int, np.ndarray] = {}
        for i in range(cfg.num_hidden_layers):
            if cfg.is_attention(i):
                empty = np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), np.float32)
                self.kv[i] = (empty, empty.copy())
            else:
                self.conv[i] = np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), np.float32)
                self.rec[i] = np.zeros((cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                        cfg.linear_key_head_dim), np.float32)

    def snapshot(self) -> "ReferenceState":
        s = ReferenceState.__new__(ReferenceState)
        s.cfg, s.position = self.cfg, self.position
        s.kv = {i: (k.copy(), v.copy()) for i, (k, v) in self.kv.items()}
        s.conv = {i: c.copy() for i, c in self.conv.items()}
        s.rec = {i: r.copy() for i, r in self.rec.items()}
        return s

    def restore(self, snap: "ReferenceState") -> None:
        c = snap.snapshot()
        self.position, self.kv, self.conv, self.rec = c.position, c.kv, c.conv, c.rec

    def export_arrays(self) -> dict[str, np.ndarray]:
        """Same names and flat layouts as the C++ State (docs/engine_contract.md)."""
        d: dict[str, np.ndarray] = {"position": np.int64(self.position)}
        for slot, (k, v) in enumerate(self.kv[i] for i in sorted(self.kv)):
            d[f"kv.{slot}.k"] = k.reshape(k.shape[0], -1).copy()
            d[f"kv.{slot}.v"] = v.reshape(v.shape[0], -1).copy()
        for slot, i in enumerate(sorted(self.rec)):
            d[f"dn.{slot}.ssm"] = self.rec[i].ravel().copy()
            d[f"dn.{slot}.conv"] = self.conv[i].ravel().copy()
        return d

    def import_arrays(self, d: dict[str, np.ndarray]) -> None:
        cfg = self.cfg
        self.position = int(d["position"])
        for slot, i in enumerate(sorted(self.kv)):
            shape = (self.position, cfg.num_key_value_heads, cfg.head_dim)
            self.kv[i] = (np.asarray(d[f"kv.{slot}.k"], np.float32).reshape(shape).copy(),
                          np.asarray(d[f"kv.{slot}.v"], np.float32).reshape(shape).copy())
        for slot, i in enumerate(sorted(self.rec)):
            self.rec[i] = np.asarray(d[f"dn.{slot}.ssm"], np.float32).reshape(self.rec[i].shape).copy()
            self.conv[i] = np.asarray(d[f"dn.{slot}.conv"], np.float32).reshape(self.conv[i].shape).copy()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv.values()) + \
            sum(c.nbytes for c in self.conv.values()) + sum(r.nbytes for r in self.rec.values())


def _layer_loop(w: Weights, cfg: ModelConfig, state: ReferenceState, x: np.ndarray, positions: np.ndarray,
                after=None) -> np.ndarray:
    """The reference's one layer loop: x [S, hidden] embedded rows -> the residual after the last layer; updates
    state's KV / conv / recurrent arrays (not its position). after(kind, layer, out, residual) is called after each
    sub-block (kind "mixer" or "moe", out its output [S, hidden], residual = x + out) and returns the residual
    the next sub-block reads."""
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        h = rms_norm(x, w.vec(p + ".input_layernorm.weight"), cfg.rms_norm_eps)
        if cfg.is_attention(i):
            k, v = state.kv[i]
            out, k, v = attention_mixer(h, w, i, cfg, k, v, positions)
            state.kv[i] = (k, v)
        else:
            out, state.conv[i], state.rec[i] = deltanet_mixer(h, w, i, cfg, state.conv[i], state.rec[i])
        x = after("mixer", i, out, x + out) if after else x + out
        h = rms_norm(x, w.vec(p + ".post_attention_layernorm.weight"), cfg.rms_norm_eps)
        moe = moe_ffn(h, w, i, cfg)
        x = after("moe", i, moe, x + moe) if after else x + moe
    return x


def forward_hidden(w: Weights, cfg: ModelConfig, state: ReferenceState, tokens: np.ndarray,
                   trace: dict | None = None) -> np.ndarray:
    """tokens int [S] -> final-normed hidden [S, hidden]; updates state. trace collects named intermediates."""
    S = tokens.shape[0]
    positions = np.arange(state.position, state.position + S)

    def record(kind, i, out, residual):
        trace[f"{kind}_out.{i}"] = out
        if kind == "moe":
            trace[f"residual.{i}"] = residual
        return residual

    x = _layer_loop(w, cfg, state, w.embed_rows(tokens), positions, record if trace is not None else None)
    state.position += S
    return rms_norm(x, w.vec("model.norm.weight"), cfg.rms_norm_eps)


class SubBlock(NamedTuple):
    """One sub-block of a backend's traced run beside the reference's output on the backend's own input.
    out and reference [S, n]; residual: the residual row out was read back from (out = residual - the residual
    before), None where out is the backend's output itself (embedding, head)."""
    name: str
    out: np.ndarray
    reference: np.ndarray
    residual: np.ndarray | None


def subblock_references(w: Weights, cfg: ModelConfig, state: ReferenceState, trace: dict,
                        tokens: np.ndarray) -> list[SubBlock]:
    """Each sub-block of the reference fed the backend's residual from just before it, so an error is pinned to
    one sub-block of one layer instead of compounding through the model.

    trace: the backend's run of tokens int [S] from state (Engine.forward_trace: "embed", "mixer.L", "moe.L"
    residuals [S, hidden], "logits" [S, vocab]); state advances by S (the reference's KV / recurrent state
    follows the reference's own outputs). -> the embedding, every mixer and MoE, and the head, in model order.
    """
    S = tokens.shape[0]
    positions = np.arange(state.position, state.position + S)
    blocks = [SubBlock("embed", trace["embed"], w.embed_rows(tokens), None)]
    prev = [trace["embed"]]

    def compare(kind, i, out, residual):
        got = trace[f"{kind}.{i}"]
        name = kind if kind == "moe" else ("attention" if cfg.is_attention(i) else "deltanet")
        blocks.append(SubBlock(f"layer {i} {name}", got - prev[0], out, got))
        prev[0] = got
        return got

    x = _layer_loop(w, cfg, state, trace["embed"], positions, compare)
    state.position += S
    head = rms_norm(x, w.vec("model.norm.weight"), cfg.rms_norm_eps) @ w.linear("lm_head").T
    blocks.append(SubBlock("head", trace["logits"], head, None))
    return blocks


class ReferenceTokenStream:
    """The engine's TokenStream contract in its lock-step form (the reference has no device sampler)."""

    device = False

    def __init__(self, engine: "ReferenceEngine", state: ReferenceState):
        self._engine, self._state = engine, state
        self.fed = self.returned = 0
        self.ended = False

    def next(self) -> int:
        raise RuntimeError("[TokenStream.next] a lock-step stream takes step(token)")

    def step(self, token: int) -> np.ndarray:
        if self.ended:
            raise RuntimeError("[TokenStream.step] the stream is closed")
        out = self._engine.forward(self._state, np.array([token], np.int64), logits="last")[0]
        self.fed += 1
        return out

    def close(self, logits: bool = False) -> None:
        self.ended = True
        return None


class ReferenceEngine:
    """NumPy implementation of docs/engine_contract.md (backend name "reference")."""

    backend = "reference"

    def __init__(self, config: ModelConfig | dict, tensors: dict[str, np.ndarray],
                 quant: dict[str, tuple[int, int]], threads: int = 0, max_context: int = 4096):
        self.config = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(
            {"model_type": "qwen3_5_moe", **config})
        self.weights = Weights(tensors, quant)
        self.max_context = int(max_context)
        self.threads = 1

    def new_state(self) -> ReferenceState:
        return ReferenceState(self.config)

    def open_stream(self, state: ReferenceState, first: int, max_tokens: int, **options) -> ReferenceTokenStream:
        """A lock-step token stream (the options of a device draw do not apply: the host draws)."""
        if not 0 <= int(first) < self.config.vocab_size:
            raise ValueError(f"[open_stream] token id {first} is out of range for vocab_size "
                             f"{self.config.vocab_size}")
        if max_tokens < 1:
            raise ValueError(f"[open_stream] max_tokens must be >= 1, got {max_tokens}")
        return ReferenceTokenStream(self, state)

    def forward(self, state: ReferenceState, tokens, logits: str = "last", chunk_size: int = 0) -> np.ndarray:
        cfg = self.config
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"[forward] tokens must be a non-empty 1-D array, got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"[forward] token id out of range: expected 0..{cfg.vocab_size - 1}, "
                             f"got min {tokens.min()} max {tokens.max()}")
        if state.position + tokens.size > self.max_context:
            raise ValueError(f"[forward] position {state.position} + {tokens.size} tokens exceeds "
                             f"max_context {self.max_context}")
        if logits not in ("last", "all", "none"):
            raise ValueError(f"[forward] logits must be 'last', 'all' or 'none', got {logits!r}")
        step = chunk_size if chunk_size > 0 else tokens.size
        rows = []
        for start in range(0, tokens.size, step):
            hidden = forward_hidden(self.weights, cfg, state, tokens[start:start + step].astype(np.int64))
            if logits == "all":
                rows.append(hidden)
            elif start + step >= tokens.size and logits == "last":
                rows.append(hidden[-1:])
        if logits == "none":
            return np.zeros((0, cfg.vocab_size), np.float32)
        return (np.concatenate(rows) @ self.weights.linear("lm_head").T).astype(np.float32)
