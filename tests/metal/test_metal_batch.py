"""Concurrent streams decoded together on emulated Metal (issue 45): with exact rows (every row by the one-row
step's kernels: the GEMV over the rows, decode attention, the fused MoE decode and the sequential DeltaNet scan per
row) Engine.step_streams runs several streams' plain steps in one forward, each stream with its own state, and
each returns what it returns alone (greedy and seeded sampling, different prompt lengths, different lengths). The
weights carry an MTP head, so every batched step also advances each stream's head row. Each Metal run happens in
a forked child (test_metal_backend._in_child)."""
from __future__ import annotations

import numpy as np
import test_metal_backend as t_be

from lily.testing import random_mtp_weights, random_weights, tiny_configs

OPTIONS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11),
           dict(temperature=0.8, repetition_penalty=1.3, seed=5)]
LENGTHS = [10, 6, 10]


def _weights():
    cfg = tiny_configs()["tiny"]
    t, q = random_weights(cfg, 4)
    ht, hq = random_mtp_weights(cfg, 4)
    return cfg, {**t, **ht}, {**q, **hq}


def _prompts(cfg):
    rng = np.random.default_rng(4)
    return [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (5, 9, 2)]


def _open(eng, prompt, n, opts, batch):
    st = eng.new_state()
    first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
    return st, eng.open_stream(st, first, n, device=True, batch=batch, **opts)


def test_streams_stepped_together_on_metal_return_what_they_return_alone():
    cfg, t, q = _weights()
    prompts = _prompts(cfg)

    def run():
        eng = t_be.metal_engine(cfg, t, q)
        solo = []
        for p, n, o in zip(prompts, LENGTHS, OPTIONS):  # alone: the Metal device sampler draws (run ahead)
            _, s = _open(eng, p, n, o, batch=False)
            assert s.device
            out = []
            while (tok := s.next()) >= 0:
                out.append(tok)
            s.close()
            solo.append(out)
        opened = [_open(eng, p, n, o, batch=True) for p, n, o in zip(prompts, LENGTHS, OPTIONS)]
        streams = [s for _, s in opened]
        assert not any(s.device for s in streams) and all(s.draws for s in streams)
        got, rows = [[] for _ in streams], []
        while not all(s.ended for s in streams):
            rows.append(eng.step_streams(streams))
            for i, s in enumerate(streams):
                if not s.ended and (tok := s.next()) >= 0:
                    got[i].append(tok)
        positions = [st.position for st, _ in opened]
        for s in streams:
            s.close()
        return solo, got, rows, positions, eng.batches_streams

    solo, got, rows, positions, batches = t_be._in_child(run)
    assert batches and got == solo
    assert rows[:6] == [3] * 6 and max(rows) == 3, rows  # stepped together while three ran
    assert positions == [len(p) + n for p, n in zip(prompts, LENGTHS)]  # the prompt, then the first and n - 1 draws fed
