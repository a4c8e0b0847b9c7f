"""The MTP head's math in lily.reference (docs/model.md §7, issue 39 part 2): against an independent formulation
(mlx-lm's own Qwen3.5 decoder layer, KV cache and quantized modules: tests/_mlx_mtp.py), its KV cache against
recomputation, rollback of drafts, chained drafts, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

from lily.testing.metrics import assert_close
from _mlx_mtp import mlx_mtp_head
from lily.testing.tolerances import tol

from lily.reference import MtpState, ReferenceState, Weights, forward_hidden, mtp_draft_greedy, mtp_forward
from lily.testing import random_mtp_weights, random_weights, tiny_config_dicts, tiny_configs

# prefill rows, then decode steps and a short chunk: the cache is read at every split
SPLITS = [(0, 5), (5, 6), (6, 7), (7, 9)]


def _model(name: str, seed: int = 3):
    cfg = tiny_configs()[name]
    tensors, quant = random_weights(cfg, seed)
    head, head_quant = random_mtp_weights(cfg, seed)
    return cfg, (tensors, quant), (head, head_quant)


def _rows(cfg, rng, S: int = 9):
    """Hidden rows as the main model hands them over (final-normed: unit RMS) and the next tokens."""
    h = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    return h / np.sqrt(np.mean(h * h, -1, keepdims=True)), rng.integers(0, cfg.vocab_size, S)


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_mtp_forward_matches_mlx_lm_decoder_layer(name, rng):
    """Prefill then decode through the head's own KV cache, against MLX on the same packed bytes (Dk != Dv, one KV
    head and odd sizes in tiny_dk_ne_dv; dense modules in tiny_odd)."""
    cfg, (t, q), (ht, hq) = _model(name)
    run, kv_cache = mlx_mtp_head(tiny_config_dicts()[name], {**t, **ht}, {**q, **hq})
    hidden, tokens = _rows(cfg, rng)
    w, m, state, cache = Weights(t, q), Weights(ht, hq), MtpState(cfg), kv_cache()
    ours, theirs = [], []
    for a, b in SPLITS:
        ours.append(mtp_forward(w, m, cfg, state, hidden[a:b], tokens[a:b]))
        theirs.append(run(hidden[a:b], tokens[a:b], cache))
    assert state.position == SPLITS[-1][1]
    limit = tol("op_vs_reference")["rel_rms"]
    assert_close(f"{name} mtp logits vs mlx", np.concatenate([o[0] for o in ours]),
                 np.concatenate([o[0] for o in theirs]), limit)
    assert_close(f"{name} mtp out hidden vs mlx", np.concatenate([o[1] for o in ours]),
                 np.concatenate([o[1] for o in theirs]), limit)


def test_mtp_on_the_main_models_hidden_matches_mlx_lm(tmp_path):
    """The whole path: the main model's final-normed hidden states (lily.reference and mlx-lm's own Qwen3.5 model,
    which returns them after its final norm) feed the head with the prompt shifted by one."""
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    import lily.testing
    folder = lily.testing.write_synthetic_checkpoint(tmp_path, "tiny_dk_ne_dv", seed=5, mtp=True)
    from lily.mtp_source import load_with_mtp
    ck = load_with_mtp(folder, progress=False)
    cfg = ck.config
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 12)
    w, m = Weights(ck.tensors, ck.quant), Weights(ck.mtp.tensors, ck.mtp.quant)
    hidden = forward_hidden(w, cfg, ReferenceState(cfg), prompt)            # h_0 .. h_11
    ours, _ = mtp_forward(w, m, cfg, MtpState(cfg), hidden[:-1], prompt[1:])  # rows (h_p, x_p+1)

    model, _ = mlx_lm.load(str(folder))
    model.set_dtype(mx.float32)
    mlx_hidden = np.array(model.language_model.model(mx.array(prompt[None].astype(np.int32))))[0]
    assert_close("main hidden: reference vs mlx-lm", hidden, mlx_hidden, tol("model_vs_mlx")["rel_rms"])
    run, kv_cache = mlx_mtp_head(tiny_config_dicts()["tiny_dk_ne_dv"], {**ck.tensors, **ck.mtp.tensors},
                                 {**ck.quant, **ck.mtp.quant})
    theirs, _ = run(mlx_hidden[:-1], prompt[1:], kv_cache())
    assert_close("mtp logits on the prompt: reference vs mlx", ours, theirs, tol("model_vs_mlx")["rel_rms"])


@pytest.mark.parametrize("name", ["tiny", "tiny_dk_ne_dv"])
def test_mtp_cache_equals_recompute(name, rng):
    """Rows run one at a time or in chunks through the head's KV cache give what one call over all of them gives."""
    cfg, (t, q), (ht, hq) = _model(name)
    w, m = Weights(t, q), Weights(ht, hq)
    hidden, tokens = _rows(cfg, rng, 11)
    whole = MtpState(cfg)
    all_logits, all_out = mtp_forward(w, m, cfg, whole, hidden, tokens)
    for splits in ([(i, i + 1) for i in range(11)], [(0, 4), (4, 5), (5, 11)]):
        state = MtpState(cfg)
        parts = [mtp_forward(w, m, cfg, state, hidden[a:b], tokens[a:b]) for a, b in splits]
        limit = tol("self_consistency")["rel_rms"]
        assert_close(f"{name} cached logits {len(splits)} calls", np.concatenate([p[0] for p in parts]), all_logits,
                     limit)
        assert_close(f"{name} cached out {len(splits)} calls", np.concatenate([p[1] for p in parts]), all_out, limit)
        assert_close(f"{name} cache k", state.k, whole.k, limit)
        assert_close(f"{name} cache v", state.v, whole.v, limit)


def test_mtp_cache_is_read(rng):
    """A row's output depends on the cached rows before it: the same row after another prefix differs."""
    cfg, (t, q), (ht, hq) = _model("tiny")
    w, m = Weights(t, q), Weights(ht, hq)
    hidden, tokens = _rows(cfg, rng, 6)
    a, b = MtpState(cfg), MtpState(cfg)
    mtp_forward(w, m, cfg, a, hidden[:5], tokens[:5])
    mtp_forward(w, m, cfg, b, hidden[:5][::-1], tokens[:5][::-1])
    la, _ = mtp_forward(w, m, cfg, a, hidden[5:], tokens[5:])
    lb, _ = mtp_forward(w, m, cfg, b, hidden[5:], tokens[5:])
    assert np.sqrt(np.mean((la - lb) ** 2)) > 1e-3 * np.sqrt(np.mean(la ** 2))


def test_mtp_truncate_rolls_back_drafts_exactly(rng):
    """Drafting k tokens grows the head's cache by k rows; truncating back to the accepted position gives, bit for
    bit, the state before the drafts, and the next row then equals a run that never drafted."""
    cfg, (t, q), (ht, hq) = _model("tiny_dk_ne_dv")
    w, m = Weights(t, q), Weights(ht, hq)
    hidden, tokens = _rows(cfg, rng, 8)
    state = MtpState(cfg)
    mtp_forward(w, m, cfg, state, hidden[:6], tokens[:6])
    before = state.snapshot()
    drafts = mtp_draft_greedy(w, m, cfg, state, hidden[5], tokens[5], k=3)
    assert len(drafts) == 3 and state.position == 9
    state.truncate(6)
    np.testing.assert_array_equal(state.k, before.k)
    np.testing.assert_array_equal(state.v, before.v)
    after, _ = mtp_forward(w, m, cfg, state, hidden[6:7], tokens[6:7])
    never, _ = mtp_forward(w, m, cfg, before, hidden[6:7], tokens[6:7])
    np.testing.assert_array_equal(after, never)
    with pytest.raises(ValueError, match=r"length 9 is outside 0\.\.7"):
        state.truncate(9)


def test_mtp_chained_draft_feeds_its_own_output(rng):
    """Draft i+1 reads the head's output for draft i (after mtp.norm) and draft i as its token, one position on."""
    cfg, (t, q), (ht, hq) = _model("tiny")
    w, m = Weights(t, q), Weights(ht, hq)
    hidden, tokens = _rows(cfg, rng, 4)
    state = MtpState(cfg)
    mtp_forward(w, m, cfg, state, hidden[:3], tokens[:3])
    manual = state.snapshot()
    drafts = mtp_draft_greedy(w, m, cfg, state, hidden[3], tokens[3], k=3)
    h, tok = hidden[3:4], tokens[3:4]
    for i in range(3):
        logits, h = mtp_forward(w, m, cfg, manual, h, tok)
        tok = np.array([int(np.argmax(logits[0]))])
        assert tok[0] == drafts[i]
    assert manual.position == state.position == 6


def test_mtp_forward_bad_input(rng):
    cfg, (t, q), (ht, hq) = _model("tiny")
    w, m = Weights(t, q), Weights(ht, hq)
    hidden, tokens = _rows(cfg, rng, 3)
    with pytest.raises(ValueError, match=r"hidden must be \[S, 128\] with S = len\(next_tokens\) = 2, got shape "
                                         r"\(3, 128\)"):
        mtp_forward(w, m, cfg, MtpState(cfg), hidden, tokens[:2])
    with pytest.raises(ValueError, match=r"ids in 0\.\.511"):
        mtp_forward(w, m, cfg, MtpState(cfg), hidden, np.array([0, 1, 512]))
    with pytest.raises(ValueError, match="k must be >= 1"):
        mtp_draft_greedy(w, m, cfg, MtpState(cfg), hidden[0], 1, k=0)
