"""The MTP head on emulated Metal (issue 39; docs/model.md §7; core/backend.h: keep_hidden, store_hidden, mtp_embed,
mtp_head, and the head's decoder layer run by attention_block / moe_block at index n_layers). The real Engine drives
the backend: prefill chunks (the head's rows (h_{p-1}, x_p) after each chunk), lock-step steps (host ids inside a
step), device steps (the id the step's embed read from the device slot) and speculative streams (chained drafts,
verify, replay). Compared with the CPU backend and with lily.reference.mtp_forward at the fp32 rows of the tolerance
table, with the scratch poisoned with NaN before every chunk and step (debug). Each Metal run happens in a forked
child (test_metal_backend._in_child)."""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import test_metal_backend as t_be
from lily.testing.metrics import assert_close
from lily.testing.tolerances import tol

from lily.quant import dequantize, quantize
from lily.reference import MtpState, ReferenceState, Weights, forward_hidden, mtp_forward
from lily.testing import random_mtp_weights, random_weights, tiny_configs

_lily = t_be._lily
FP32 = tol("model_vs_reference")["rel_rms"]  # a fp32 backend against fp32 (CPU backend, reference)
HEAD = ("mtp.k", "mtp.v", "mtp.hidden")
K_DRAFT = 3


def _close(name: str, out, ref) -> None:
    """assert_close at the fp32 bound; an empty cache (no head row yet) only by shape."""
    out, ref = np.asarray(out), np.asarray(ref)
    if out.size == 0:
        assert out.shape == ref.shape, f"{name}: shape {out.shape} != {ref.shape}"
        return
    assert_close(name, out, ref, FP32)


def _model(name: str, seed: int = 3):
    cfg = tiny_configs()[name]
    t, q = random_weights(cfg, seed)
    ht, hq = random_mtp_weights(cfg, seed)
    return cfg, (t, q), (ht, hq)


def _cpu_engine(cfg, t, q, max_context=256):
    return _lily.Engine(cfg.to_dict(), t, q, threads=2, max_context=max_context)


def _head_arrays(st) -> dict:
    a = st.export_arrays()
    return {"rows": int(a["mtp.rows"]), **{k: np.asarray(a[k]) for k in HEAD}}


def _scenario(eng, prompt, chunk, fed, n_greedy, draft_token) -> dict:
    """The prompt in chunks of `chunk` rows, lock-step steps feeding `fed` (host ids), then n_greedy greedy steps
    (on Metal the device loop: each step's id comes from the device slot). After each phase: its logits or tokens,
    the head's arrays, and K_DRAFT chained greedy drafts after draft_token (Engine.draft: mtp_embed, the head's
    layer, mtp_head; Kept then Draft rows) with their logits."""
    st = eng.new_state()
    out = {}

    def phase(name, result):
        drafts, logits = eng.draft(st, draft_token, K_DRAFT)
        out[name] = (result, _head_arrays(st), np.asarray(drafts), np.asarray(logits))

    phase("prefill", eng.forward(st, prompt, logits="last", chunk_size=chunk))
    s = eng.open_stream(st, int(fed[0]), len(fed), device=False)
    steps = np.stack([np.array(s.step(int(t))) for t in fed])
    s.close()
    phase("steps", steps)
    phase("greedy", np.asarray(eng.decode_greedy(st, int(np.argmax(steps[-1])), n_greedy)))
    out["position"] = st.position
    return out


def _reference_head(cfg, main, head, tokens, draft_token, drafts) -> tuple[dict, np.ndarray]:
    """lily.reference: the main model's final-normed hidden over tokens, the head's rows (h_p, x_{p+1}), then the
    chained rows of a draft after draft_token, chained on the given drafts (so a near tie cannot derail the
    comparison). Returns the head's arrays before the draft and the draft's logits [K_DRAFT, V]."""
    w, m = Weights(*main), Weights(*head)
    hidden = forward_hidden(w, cfg, ReferenceState(cfg), np.asarray(tokens))
    state = MtpState(cfg)
    if len(tokens) > 1:
        mtp_forward(w, m, cfg, state, hidden[:-1], np.asarray(tokens[1:]))
    rows = state.position
    arrays = {"rows": rows, "mtp.k": state.k.reshape(rows, -1), "mtp.v": state.v.reshape(rows, -1),
              "mtp.hidden": hidden[-1]}
    logits, h = [], hidden[-1][None]
    for tok in [draft_token, *drafts[:-1]]:
        lg, h = mtp_forward(w, m, cfg, state, h, np.array([int(tok)]))
        logits.append(lg[0])
    return arrays, np.stack(logits)


# name, prompt length, prefill chunk rows (0: the backend's), lock-step ids fed, greedy device steps
SHAPES = [
    ("tiny", 1, 0, 2, 3),          # a prompt of one token: no head row in the prefill, only its hidden state kept
    ("tiny", 11, 4, 3, 4),         # chunks of 4, 4, 3: each starts with the previous chunk's stored hidden state
    ("tiny", 5, 1, 1, 2),          # one-row chunks outside a step: the decode kernels, the ids ring per chunk
    ("tiny", 23, 9, 2, 2),         # chunks over 4 rows: fc and the head's layer on the GEMM / grouped paths
    ("tiny_dk_ne_dv", 6, 0, 2, 2),  # one KV head, head_dim 64, 5 experts top-3, odd vocab
    ("tiny_odd", 7, 3, 2, 2),      # dense (bf16) expert and shared-expert weights: the unfused decode MoE
]


@pytest.mark.parametrize("name,n_prompt,chunk,n_fed,n_greedy", SHAPES)
def test_head_rows_match_cpu_and_reference(name, n_prompt, chunk, n_fed, n_greedy):
    """The head's KV rows, last hidden state and chained drafts after prefill, lock-step and device steps: Metal
    (NaN-poisoned scratch) against the CPU backend after every phase, and against lily.reference at the end."""
    cfg, main, head = _model(name)
    t, q = {**main[0], **head[0]}, {**main[1], **head[1]}
    rng = np.random.default_rng(n_prompt)
    prompt = rng.integers(0, cfg.vocab_size, n_prompt).astype(np.int32)
    fed = rng.integers(0, cfg.vocab_size, n_fed).astype(np.int32)
    draft_token = int(rng.integers(0, cfg.vocab_size))
    cpu = _cpu_engine(cfg, t, q)
    assert cpu.has_mtp
    want = _scenario(cpu, prompt, chunk, fed, n_greedy, draft_token)
    del cpu
    gc.collect()

    def run():
        m = t_be.metal_engine(cfg, t, q, debug=True)
        assert m.has_mtp and m.debug
        return _scenario(m, prompt, chunk, fed, n_greedy, draft_token)

    got = t_be._in_child(run)
    assert got["position"] == want["position"] == n_prompt + n_fed + n_greedy
    for phase in ("prefill", "steps", "greedy"):
        (rg, g, dg, lg), (rw, w, dw, lw) = got[phase], want[phase]
        assert g["rows"] == w["rows"], phase
        if phase == "greedy":
            np.testing.assert_array_equal(rg, rw, err_msg=f"{name}: greedy tokens")
        else:
            _close(f"{name} {phase} logits", rg, rw)
        for k in HEAD:
            _close(f"{name} {phase} {k} metal vs cpu", g[k], w[k])
        _close(f"{name} {phase} draft logits metal vs cpu", lg, lw)
        np.testing.assert_array_equal(dg, dw, err_msg=f"{name} {phase}: drafts")
    tokens = np.concatenate([prompt, fed, [int(np.argmax(got["steps"][0][-1]))], got["greedy"][0][:-1]])
    _, final, drafts, logits = got["greedy"]
    ref, ref_logits = _reference_head(cfg, main, head, tokens, draft_token, drafts)
    assert final["rows"] == ref["rows"] == len(tokens) - 1
    for k in HEAD:
        _close(f"{name} {k} metal vs reference", final[k], ref[k])
    _close(f"{name} draft logits metal vs reference", logits, ref_logits)
    assert list(drafts) == [int(np.argmax(r)) for r in ref_logits]


def test_head_with_the_bf16_kv_cache():
    """Metal's default KV cache (bf16; the *_kvbf16 attention kernels, the head's layer included) against the fp32
    CPU engine at the table's bf16-KV bar: prefill / step logits, the head's hidden state and its draft logits
    (the cached K and V themselves carry bf16 rounding, ~1e-3 relative, so they are not compared)."""
    cfg, main, head = _model("tiny")
    t, q = {**main[0], **head[0]}, {**main[1], **head[1]}
    bar = tol("model_vs_cpu", "bf16_kv")["rel_rms"]
    rng = np.random.default_rng(11)
    prompt, fed = (rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (11, 3))
    cpu = _cpu_engine(cfg, t, q)
    want = _scenario(cpu, prompt, 4, fed, 4, 5)
    del cpu
    gc.collect()
    got = t_be._in_child(lambda: _scenario(t_be.metal_engine(cfg, t, q, debug=True, kv_bf16="1"), prompt, 4, fed,
                                           4, 5))
    for phase in ("prefill", "steps", "greedy"):
        (rg, g, dg, lg), (rw, w, dw, lw) = got[phase], want[phase]
        if phase != "greedy":
            assert_close(f"bf16 kv {phase} logits", rg, rw, bar)
        assert_close(f"bf16 kv {phase} mtp.hidden", g["mtp.hidden"], w["mtp.hidden"], bar)
        assert_close(f"bf16 kv {phase} draft logits", lg, lw, bar)


# ---- speculative decoding: drafts, verify, replay ------------------------------------------------------------------

def _draft_head(cfg, main, seq, seed=3, wrong=()):
    """A head that drafts seq's continuation: fc's embedding half maps RMSNorm(E[a]; norm_embed) onto lm_head's row
    of a's successor in seq (least squares over seq's distinct tokens), so the draft from (h_p, x_{p+1}) is x_{p+2}
    and chained drafts follow seq; tokens in `wrong` map to another successor (a rejected draft each time). The
    hidden half is the random head's, scaled down; the layer, norms and router are random. Quantized as
    random_mtp_weights quantizes fc (4-bit, groups of 64)."""
    H = cfg.hidden_size
    ht, hq = random_mtp_weights(cfg, seed)
    w = Weights(*main)
    succ: dict[int, int] = {}
    for a, b in zip(seq[:-1], seq[1:]):
        succ.setdefault(int(a), int(b))
    for a in wrong:
        succ[int(a)] = (succ[int(a)] + 1) % cfg.vocab_size
    keys = sorted(succ)
    e = w.embed_rows(np.array(keys))
    e = e / np.sqrt(np.mean(e * e, -1, keepdims=True)) * ht["mtp.pre_fc_norm_embedding.weight"]
    u = w.linear("lm_head")[[succ[k] for k in keys]]
    u = 4.0 * u / np.sqrt(np.mean(u * u, -1, keepdims=True))
    bits, group = hq["mtp.fc"]
    fc = dequantize(ht["mtp.fc.weight"], ht["mtp.fc.scales"], ht["mtp.fc.biases"], bits, group)
    fc = np.concatenate([u.T @ np.linalg.pinv(e.T), 0.25 * fc[:, H:]], axis=1).astype(np.float32)
    ht["mtp.fc.weight"], ht["mtp.fc.scales"], ht["mtp.fc.biases"] = quantize(fc, bits, group)
    return ht, hq


def _spec(eng, prompt, n, k, **sample):
    st = eng.new_state()
    first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
    s = eng.open_stream(st, first, n, speculative=k, adaptive=False, **sample)
    assert s.speculative
    out = []
    while (tok := s.next()) >= 0:
        out.append(tok)
    stats = dict(s.spec_stats)
    s.close()
    return out, stats, st.position, _head_arrays(st)


def _spec_model(n_greedy):
    """tiny with a drafting head built from its own greedy continuation (CPU), some early successors wrong."""
    cfg = tiny_configs()["tiny"]
    main = random_weights(cfg, 3)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 7).astype(np.int32)
    cpu = _cpu_engine(cfg, *main, max_context=512)
    st = cpu.new_state()
    first = int(np.argmax(cpu.forward(st, prompt, logits="last")[-1]))
    greedy = [int(x) for x in cpu.decode_greedy(st, first, n_greedy)]
    del cpu
    gc.collect()
    late = set(greedy[-100:])  # the loop greedy decoding settles in: its drafts stay right
    ht, hq = _draft_head(cfg, main, [first] + greedy, wrong=[a for a in greedy[:24:6] if a not in late])
    return cfg, {**main[0], **ht}, {**main[1], **hq}, prompt, greedy


def test_speculative_greedy_on_metal_is_plain_greedy():
    """300 tokens: the speculative stream (k = 3: rejected drafts with replays early on, whole runs accepted later)
    on emulated Metal gives the plain greedy tokens (the CPU's and the Metal device loop's) one for one, with the
    CPU's draft and acceptance counts (the head's drafts are the same tokens) and the head's arrays at the end."""
    n, k = 300, 3
    cfg, t, q, prompt, greedy = _spec_model(n)
    cpu = _cpu_engine(cfg, t, q, max_context=512)
    c_out, c_stats, c_pos, c_head = _spec(cpu, prompt, n, k)
    del cpu
    gc.collect()
    assert c_out == greedy
    assert 0 < c_stats["accepted"] < c_stats["drafted"], c_stats

    def run():
        m = t_be.metal_engine(cfg, t, q, max_context=512)
        t0 = time.time()
        spec = _spec(m, prompt, n, k)
        t1 = time.time()
        st = m.new_state()
        first = int(np.argmax(m.forward(st, prompt, logits="last")[-1]))
        plain = [int(x) for x in m.decode_greedy(st, first, n)]
        return spec, plain, t1 - t0, time.time() - t1

    (m_out, m_stats, m_pos, m_head), m_plain, t_spec, t_plain = t_be._in_child(run)
    print(f"metal: speculative {t_spec:.1f} s ({m_stats}), plain {t_plain:.1f} s")
    assert m_plain == greedy, "the Metal device loop's plain greedy tokens differ from the CPU's"
    assert m_out == greedy, "the speculative tokens on Metal differ from plain greedy"
    assert m_stats == c_stats and m_pos == c_pos
    assert m_head["rows"] == c_head["rows"] == m_pos - 1
    for key in HEAD:
        _close(f"speculative {key} metal vs cpu", m_head[key], c_head[key])


def test_speculative_sampling_on_metal_draws_the_cpu_tokens():
    """A sampled speculative stream (greedy drafts, each verified row drawn with plain decoding's uniform number, a
    draft kept when the draw equals it): the same seed draws the same tokens on Metal as on the CPU, whose logits it
    matches to ~1e-6 (a draw within that distance of a boundary would show here; not on this seed). A low temperature
    keeps the draws near the greedy path the head drafts, so some drafts stay and some do not."""
    n, k = 40, 3
    cfg, t, q, prompt, _ = _spec_model(n)
    opts = dict(temperature=0.3, top_p=0.95, seed=11)
    cpu = _cpu_engine(cfg, t, q)
    want = _spec(cpu, prompt, n, k, **opts)
    del cpu
    gc.collect()
    assert 0 < want[1]["accepted"] < want[1]["drafted"], want[1]

    got = t_be._in_child(lambda: _spec(t_be.metal_engine(cfg, t, q), prompt, n, k, **opts))
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]
    for key in HEAD:
        _close(f"sampled speculative {key} metal vs cpu", got[3][key], want[3][key])


def test_one_seed_one_text_with_speculation_on_or_off_on_metal():
    """Issue 44 on emulated Metal: for k = 1..4 and three seeds, a sampled speculative stream (its draws in the
    extension, each verified row with plain decoding's uniform number) returns the plain stream's tokens (the Metal
    device sampler's draws), token for token; some drafts stay."""
    n = 12
    cfg, t, q, prompt, _ = _spec_model(n)
    opts = dict(temperature=0.3, top_p=0.95, top_k=40)  # near the greedy path the head drafts: some drafts stay

    def plain(eng, seed):
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
        s = eng.open_stream(st, first, n, seed=seed, **opts)
        out = []
        while (tok := s.next()) >= 0:
            out.append(tok)
        s.close()
        return out

    def run():
        eng = t_be.metal_engine(cfg, t, q)
        rows = []
        for seed in (7, 11, 2026):
            want = plain(eng, seed)
            for k in (1, 2, 3, 4):
                got, stats, _, _ = _spec(eng, prompt, n, k, seed=seed, **opts)
                rows.append((seed, k, got == want, stats["drafted"], stats["accepted"]))
        return rows

    rows = t_be._in_child(run)
    assert all(same for _, _, same, _, _ in rows), rows
    assert sum(a for *_, a in rows) > 0, rows  # the accepting path ran too


def test_without_a_head_metal_has_no_mtp():
    """Weights without mtp.*: the backend wraps no head layer and a speculative stream is refused."""
    cfg = tiny_configs()["tiny"]
    t, q = random_weights(cfg, 1)

    def run():
        m = t_be.metal_engine(cfg, t, q)
        st = m.new_state()
        m.forward(st, np.arange(3, dtype=np.int32))
        try:
            m.open_stream(st, 1, 4, speculative=2)
        except ValueError as ex:
            return m.has_mtp, str(ex)
        return m.has_mtp, ""

    has, err = t_be._in_child(run)
    assert not has and "needs the MTP head" in err
