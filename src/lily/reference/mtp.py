"""The MTP head (docs/model.md §7), the spec every backend's draft is tested against.

From the main model's final-normed hidden state at position p and the embedding of token p+1, the head drafts token
p+2: RMSNorm both (the offset "1 + γ" norms, stored as 1 + γ like every MLX norm), concatenate embedding first, fc
back to the hidden size, one gated full-attention + MoE decoder layer with its own KV cache, mtp.norm, then the main
model's lm_head. The embedding and lm_head are the main model's (the head has none of its own).

Rows and positions: row i of a call pairs hidden h_p (position p) with token x_{p+1} and runs at position p, as vLLM's
proposer feeds the target's positions. A prompt x_0..x_{n-1} whose main forward gave h_0..h_{n-1} and sampled x_n
fills the head's cache with the rows (h_p, x_{p+1}), p = 0..n-1, so its cache covers the main model's positions.
Chained drafts feed the head's own output (after mtp.norm: the row the lm_head reads) back as the next hidden state,
one position later (mtp_draft_greedy).

Dimension legend: S rows, H hidden size, V vocabulary, T cached positions, Hkv KV heads, D head dim.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from .attention import attention_mixer
from .linear import Weights
from .moe import moe_ffn
from .ops import rms_norm

MTP_LAYER = "mtp.layers.0"


class MtpState:
    """The head's KV cache, k and v [T, Hkv, D] (post-RoPE), and position = T, the position of its next row."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.k = np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), np.float32)
        self.v = self.k.copy()

    @property
    def position(self) -> int:
        return self.k.shape[0]

    def snapshot(self) -> "MtpState":
        s = MtpState.__new__(MtpState)
        s.cfg, s.k, s.v = self.cfg, self.k.copy(), self.v.copy()
        return s

    def restore(self, snap: "MtpState") -> None:
        self.k, self.v = snap.k.copy(), snap.v.copy()

    def truncate(self, length: int) -> None:
        """Drop the rows from position `length` on (rejected drafts): a KV cache rolls back exactly."""
        if not 0 <= length <= self.position:
            raise ValueError(f"[MtpState.truncate] length {length} is outside 0..{self.position} (the cached rows)")
        self.k, self.v = self.k[:length].copy(), self.v[:length].copy()


def mtp_forward(weights: Weights, mtp: Weights, cfg: ModelConfig, state: MtpState, hidden: np.ndarray,
                next_tokens: np.ndarray, trace: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """S rows of the head at positions P..P+S-1 (P = state.position); appends their K, V to state.

    weights: the main model's (embedding, lm_head); mtp: the head's (lily.mtp_source.MtpWeights' tensors and quant).
    Shapes: hidden [S, H]: the main model's final-normed hidden at P..P+S-1, or the head's own output when chaining;
    next_tokens int [S]: the tokens at P+1..P+S. Returns (logits [S, V] for the tokens at P+2..P+S+1, out [S, H]: the
    head's output after mtp.norm, the hidden state of a chained draft). trace collects the named intermediates.
    """
    hidden = np.asarray(hidden, np.float32)
    next_tokens = np.asarray(next_tokens)
    S, H = next_tokens.shape[0] if next_tokens.ndim == 1 else -1, cfg.hidden_size
    if hidden.ndim != 2 or hidden.shape != (S, H):
        raise ValueError(f"[mtp_forward] hidden must be [S, {H}] with S = len(next_tokens) = {S}, got shape "
                         f"{hidden.shape} and next_tokens shape {next_tokens.shape}")
    if S < 1 or next_tokens.min() < 0 or next_tokens.max() >= cfg.vocab_size:
        raise ValueError(f"[mtp_forward] next_tokens must be a non-empty 1-D array of ids in 0..{cfg.vocab_size - 1}"
                         f", got {next_tokens!r}")
    eps = cfg.rms_norm_eps
    positions = np.arange(state.position, state.position + S)
    e = rms_norm(weights.embed_rows(next_tokens), mtp.vec("mtp.pre_fc_norm_embedding.weight"), eps)
    hn = rms_norm(hidden, mtp.vec("mtp.pre_fc_norm_hidden.weight"), eps)
    # embedding first, then the hidden state (vLLM's and SGLang's torch.cat([inputs_embeds, hidden_states]))
    x = np.concatenate([e, hn], axis=-1) @ mtp.linear("mtp.fc").T  # [S, 2H] -> [S, H]
    h = rms_norm(x, mtp.vec(MTP_LAYER + ".input_layernorm.weight"), eps)
    mixer, state.k, state.v = attention_mixer(h, mtp, 0, cfg, state.k, state.v, positions, prefix=MTP_LAYER)
    x = x + mixer
    moe = moe_ffn(rms_norm(x, mtp.vec(MTP_LAYER + ".post_attention_layernorm.weight"), eps), mtp, 0, cfg,
                  prefix=MTP_LAYER)
    x = x + moe
    out = rms_norm(x, mtp.vec("mtp.norm.weight"), eps)
    if trace is not None:
        trace.update({"mtp.embed_norm": e, "mtp.hidden_norm": hn, "mtp.mixer_out": mixer, "mtp.moe_out": moe,
                      "mtp.out": out})
    return (out @ weights.linear("lm_head").T).astype(np.float32), out


def mtp_draft_greedy(weights: Weights, mtp: Weights, cfg: ModelConfig, state: MtpState, hidden: np.ndarray,
                     token: int, k: int) -> list[int]:
    """k chained greedy drafts after position P = state.position: hidden [H] is the main model's at P and token the
    one at P+1 (sampled from the main model); returns the drafts for P+2..P+k+1. Each step feeds the head its own
    output and its last draft, one position later; state grows by k rows (truncate to roll back rejected ones)."""
    if k < 1:
        raise ValueError(f"[mtp_draft_greedy] k must be >= 1, got {k}")
    h, tok, drafts = np.asarray(hidden, np.float32)[None], int(token), []
    for _ in range(k):
        logits, h = mtp_forward(weights, mtp, cfg, state, h, np.array([tok]))
        tok = int(np.argmax(logits[0]))
        drafts.append(tok)
    return drafts
