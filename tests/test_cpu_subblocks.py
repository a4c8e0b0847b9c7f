"""CPU backend vs lily.reference per sub-block, on the same inputs.

The engine traces the residual stream after every sub-block; each reference sub-block is fed the
engine's own residual from just before it, so an error is pinned to one sub-block of one layer
instead of being compounded through the model.
"""
import numpy as np
import pytest

from _metrics import assert_close
from tolerances import tol

import lily.testing
from lily import reference as ref

_lily = pytest.importorskip("lily._lily")


def _difference_floor(residual_after, out):
    """A sub-block's output is read back as the difference of two fp32 residual rows, which carries their
    rounding (up to an ulp of the residual) whatever the kernel does: 2 eps ||residual|| / ||out||, added to
    the op tolerance. (A DeltaNet output ~200x smaller than the residual measured 1.36e-5 against 1e-5 with a
    floor of 5e-6: seed 58 of tiny_odd at S=1.)"""
    rms = lambda a: float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))  # noqa: E731
    return 2 * float(np.finfo(np.float32).eps) * rms(residual_after) / max(rms(out), 1e-30)


@pytest.mark.parametrize("name", ["tiny", "tiny_dk_ne_dv", "tiny_odd"])
@pytest.mark.parametrize("S,chunk", [(1, 0), (37, 0), (50, 16)])
def test_every_subblock_matches_reference(rng, name, S, chunk):
    cfg = lily.testing.tiny_configs()[name]
    tensors, quant = lily.testing.random_weights(cfg, seed=int(rng.integers(1 << 30)))
    engine = _lily.Engine(cfg.to_dict(), tensors, quant, threads=2, max_context=256)
    state = engine.new_state()
    prefix = rng.integers(0, cfg.vocab_size, 5)
    engine.forward(state, prefix, logits="none")  # sub-blocks must also be right with a non-empty past
    tokens = rng.integers(0, cfg.vocab_size, S)
    trace = engine.forward_trace(state, tokens, chunk_size=chunk)

    w = ref.Weights(tensors, quant)
    rs = ref.ReferenceState(cfg)
    ref.forward_hidden(w, cfg, rs, prefix)
    positions = np.arange(5, 5 + S)
    limit = tol("op_vs_reference")["rel_rms"]
    assert_close(f"{name} embed", trace["embed"], w.embed_rows(tokens), limit)
    x = trace["embed"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        h = ref.rms_norm(x, w.vec(p + ".input_layernorm.weight"), cfg.rms_norm_eps)
        if cfg.is_attention(i):
            k, v = rs.kv[i]
            out, k, v = ref.attention_mixer(h, w, i, cfg, k, v, positions)
            rs.kv[i] = (k, v)
            kind = "attention"
        else:
            out, rs.conv[i], rs.rec[i] = ref.deltanet_mixer(h, w, i, cfg, rs.conv[i], rs.rec[i])
            kind = "deltanet"
        assert_close(f"{name} S={S} layer {i} {kind}", trace[f"mixer.{i}"] - x, out,
                     limit + _difference_floor(trace[f"mixer.{i}"], out))
        x = trace[f"mixer.{i}"]
        h = ref.rms_norm(x, w.vec(p + ".post_attention_layernorm.weight"), cfg.rms_norm_eps)
        out = ref.moe_ffn(h, w, i, cfg)
        assert_close(f"{name} S={S} layer {i} moe", trace[f"moe.{i}"] - x, out,
                     limit + _difference_floor(trace[f"moe.{i}"], out))
        x = trace[f"moe.{i}"]
    head = ref.rms_norm(x, w.vec("model.norm.weight"), cfg.rms_norm_eps) @ w.linear("lm_head").T
    assert_close(f"{name} head", trace["logits"], head, limit)
