"""Faults among streams decoded together (issue 45): a stream whose rows go non-finite ends alone with plain
decoding's error, and the streams stepped beside it return exactly what they return alone."""
from __future__ import annotations

import numpy as np
import pytest

import lily

PROMPTS = ["The list type", "A dictionary maps keys to values, and the", "Once upon a time there was a small"]


@pytest.fixture(scope="module")
def model():
    return lily.load(backend="cpu")


def _open(model, i: int, max_tokens: int, poison: bool = False):
    eng = model.engine
    ids = model.tokenize(PROMPTS[i])
    st = eng.new_state()
    eng.forward(st, np.asarray(ids[:-1], np.int32), logits="none")
    if poison:  # a NaN in this stream's DeltaNet state alone: its next rows go non-finite, no one else's
        arrays = {k: np.array(v, copy=True) for k, v in st.export_arrays().items()}
        arrays["dn.0.ssm"][:] = np.nan
        st.import_arrays(arrays)
    opts = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0.7, seed=3)][i]
    return eng.open_stream(st, ids[-1], max_tokens, stop_ids=[], device=True, **opts)


def _solo(model, i: int, n: int) -> list[int]:
    s = _open(model, i, n)
    out = []
    while (t := s.next()) >= 0:
        out.append(t)
    s.close()
    return out


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_stream_with_non_finite_rows_ends_alone_and_the_others_go_on(model, bad):
    n = 8
    solo = {i: _solo(model, i, n) for i in range(3) if i != bad}
    streams = [_open(model, i, n, poison=i == bad) for i in range(3)]
    got: dict[int, list[int]] = {i: [] for i in solo}
    errors, stepped = [], []
    for _ in range(n):
        stepped.append(model.engine.step_streams(streams))  # the bad row's draw fails when its stream asks, not here
        for i, s in enumerate(streams):
            if s.ended:
                continue
            if i == bad:
                with pytest.raises(ValueError, match="non-finite logits") as e:
                    s.next()
                errors.append(str(e.value))
                s.close()
            else:
                got[i].append(s.next())
    assert len(errors) == 1, errors  # one error, at its first token; the stream is closed after it
    assert got == solo
    assert stepped[0] == 3 and stepped[1:] == [2] * (n - 1), stepped  # the bad stream was in the first forward
