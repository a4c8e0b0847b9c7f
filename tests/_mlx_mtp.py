"""An independent formulation of the MTP head (docs/model.md §7) in MLX, for tests/test_mtp_reference.py.

The decoder layer is mlx-lm's own Qwen3.5 full-attention DecoderLayer (its attention, RoPE, SDPA and SparseMoeBlock
with gather_qmm), with mlx-lm's KVCache; norms are nn.RMSNorm, fc / embedding / lm_head MLX quantized modules loaded
from the same packed bytes. Only the wiring around the layer (norms, concat order, fc, mtp.norm, shared head) is
written here, from the same spec; mlx-lm has no MTP head of its own (its conversion drops mtp.*).
"""
from __future__ import annotations

import numpy as np
import pytest


def mlx_mtp_head(text_config: dict, tensors: dict, quant: dict):
    """tensors / quant: the main model's and the head's in the contract format (`model.embed_tokens.*`, `lm_head.*`,
    `mtp.*`). Returns (run, new_cache): run(hidden [S, H], next_tokens int [S], cache) -> (logits [S, V], out [S, H])
    as float32 NumPy, in fp32 (scales, biases and norms upcast, as tests/_mlx_peer.py's fp32 mode)."""
    mx = pytest.importorskip("mlx.core")
    nn = pytest.importorskip("mlx.nn")
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

    args = TextModelArgs.from_dict(text_config)
    H, V, eps = args.hidden_size, args.vocab_size, args.rms_norm_eps

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(V, H)
            self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
            self.fc = nn.Linear(2 * H, H, bias=False)
            # a full-attention layer index of the main schedule: mlx-lm builds gated attention + the MoE there
            self.layers = [DecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
            self.norm = nn.RMSNorm(H, eps=eps)
            self.lm_head = nn.Linear(H, V, bias=False)

        def __call__(self, hidden, tokens, cache):
            e = self.pre_fc_norm_embedding(self.embed_tokens(tokens))
            x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))
            x = self.layers[0](x, create_attention_mask(x, cache), cache)
            out = self.norm(x)
            return self.lm_head(out), out

    def mlx_name(name: str) -> str:
        return name[len("mtp."):] if name.startswith("mtp.") else name[len("model."):] if \
            name.startswith("model.") else name

    def as_mx(a: np.ndarray):
        return mx.array(a).view(mx.bfloat16) if a.dtype == np.uint16 else mx.array(a)

    weights = {mlx_name(n): as_mx(np.asarray(a)) for n, a in tensors.items()
               if n.startswith(("mtp.", "model.embed_tokens.", "lm_head."))}
    specs = {mlx_name(m): spec for m, spec in quant.items()}
    head = Head()
    nn.quantize(head, class_predicate=lambda path, _: {"group_size": specs[path][1], "bits": specs[path][0]}
                if path in specs else False)
    head.load_weights(list(weights.items()), strict=True)
    head.set_dtype(mx.float32)

    def run(hidden: np.ndarray, next_tokens: np.ndarray, cache) -> tuple[np.ndarray, np.ndarray]:
        logits, out = head(mx.array(np.asarray(hidden, np.float32))[None],
                           mx.array(np.asarray(next_tokens, np.int32))[None], cache)
        return np.array(logits.astype(mx.float32))[0], np.array(out.astype(mx.float32))[0]

    return run, KVCache
