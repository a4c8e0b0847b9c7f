"""Device sampling checks of lily.testing.cuda_checks (rows in its format; benchmarks/cuda_check.py prints them):
device-mode token streams of the CUDA engine against the host sampler (lily.sampling.draw_token) on each step's own
logits, over option sets and seeds, seen/counts carried across steps on the device; streams parking each other;
and, on the bundled model, generation with the device sampler == with the host sampler (greedy, and sampled with
one seed), plus seeded reproducibility.
"""
from __future__ import annotations

import numpy as np

from ..sampling import SamplingParams
from .stream_checks import draws_vs_host, run_and_replay

OPTION_SETS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+penalties+bias": SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                            frequency_penalty=0.3, logit_bias={0: 5.0, 3: -100.0}),
    "t1": SamplingParams(temperature=1.0),
    "t0.7 top_k 5": SamplingParams(temperature=0.7, top_k=5),
    "top_p 0.8": SamplingParams(top_p=0.8),
    "min_p 0.1": SamplingParams(min_p=0.1),
    "all": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                          presence_penalty=0.4, frequency_penalty=0.2, logit_bias={1: 2.0}),
}


def check_engine_sampling(name, cfg, gpu, toks, add, steps=8):
    """Device-mode token streams (the engine's token loop, drawing on the GPU) against the host sampler: every drawn
    token is the host's draw from that step's logits (the same tokens replayed lock-step) with the stream's uniform
    sequence (lily.sampling.stream_uniforms), seen / counts following the drawn tokens; and two streams pulled
    in turn (each parks the other) draw what each draws alone."""
    V = cfg.vocab_size
    if len(toks) < 12:
        raise ValueError(f"check_engine_sampling: {len(toks)} tokens, expected >= 12 (a prefix, then steps)")
    n0 = min(16, len(toks) - 10)
    st = gpu.new_state()
    gpu.forward(st, toks[:n0], logits="none")
    snap = st.snapshot()
    first = int(toks[n0])
    rng = np.random.default_rng(17)
    mism, boundary, total, row_err, not_device = [], 0, 0, 0.0, []
    for label, p in OPTION_SETS.items():
        seen0 = np.zeros(V, np.uint8)
        seen0[toks[:n0 + 1]] = 1
        counts0 = np.zeros(V, np.int32)
        counts0[rng.integers(0, V, 5)] += 1
        for seed in (1, 2):
            run = run_and_replay(gpu, st, snap, first, steps, p, seen0, counts0, seed)
            if not run.device:
                not_device.append(label)
                continue
            if run.held is not None:
                row_err = max(row_err, float(np.sqrt(np.mean((run.held - run.rows[-1]) ** 2) /
                                                     np.mean(run.rows[-1] ** 2))))
            bad, near = draws_vs_host(run, p, seen0, counts0, seed, exact=False)
            total += len(run.tokens)
            boundary += near
            mism += [(label, seed, *b) for b in bad]
    add("device stream draws == host sampler (lock-step replayed rows)", not mism and not not_device and row_err < 2e-2,
        cases=total, boundary=boundary, mismatches=mism[:4], not_device=not_device,
        held_logits_rel_rms_vs_lockstep=row_err)

    # Two streams on two states pulled in turn: each parks the other and resumes with its host record.
    p = OPTION_SETS["all"]
    solo = []
    for seed in (3, 4):
        st.restore(snap)
        s = gpu.open_stream(st, first, steps, device=True, seed=seed, **p.draw_options())
        solo.append([s.next() for _ in range(steps)])
        s.close()
    st.restore(snap)
    st2 = snap.snapshot()
    a = gpu.open_stream(st, first, steps, device=True, seed=3, **p.draw_options())
    b = gpu.open_stream(st2, first, steps, device=True, seed=4, **p.draw_options())
    inter = [[], []]
    for _ in range(steps):
        inter[0].append(a.next())
        inter[1].append(b.next())
    a.close()
    b.close()
    add("device streams interleaved == alone", inter == solo and st.position == st2.position == n0 + steps,
        solo=solo, interleaved=inter)

    # The same stream with its steps' kernels launched one by one (no CUDA graph) draws the same tokens.
    gpu.set_backend_flag("cuda_graph", 0)
    try:
        st.restore(snap)
        s = gpu.open_stream(st, first, steps, device=True, seed=3, **p.draw_options())
        no_graph = [s.next() for _ in range(steps)]
        s.close()
    finally:
        gpu.set_backend_flag("cuda_graph", 1)
    add("device stream without the CUDA graph == with", no_graph == solo[0], graph=solo[0], no_graph=no_graph)


def check_session_sampling(results):
    """The bundled model on CUDA: generation with the device sampler == with the host sampler, greedy and sampled
    with one seed (one sampling semantics); a seeded sampled generation is reproducible; decode tok/s of both
    samplers."""
    import lily

    def add(check, ok, **fig):
        results.append({"config": "bundled_model", "check": check, "pass": bool(ok), **fig})

    model = lily.load(backend="cuda")
    prompt = "The list type"
    out, speed = {}, {}
    for device in (True, False):
        for label, kw in (("greedy", dict(temperature=0.0)),
                          ("greedy+rep", dict(temperature=0.0, repetition_penalty=1.3)),
                          ("sampled", dict(temperature=0.8, top_p=0.9, top_k=50, seed=5))):
            s = model.session()
            s.device_sampling = device
            r = s.generate(prompt, max_tokens=96, stream=False, **kw)
            speed[(device, label)] = r.stats.decode_tokens_per_s
            out[(device, label)] = list(r.token_ids)
    add("session greedy: device == host", out[(True, "greedy")] == out[(False, "greedy")],
        tokens=len(out[(True, "greedy")]))
    add("session greedy+rep penalty: device == host", out[(True, "greedy+rep")] == out[(False, "greedy+rep")])
    add("session sampled, one seed: device == host", out[(True, "sampled")] == out[(False, "sampled")],
        tokens=len(out[(True, "sampled")]))
    s = model.session()
    again = s.generate(prompt, max_tokens=96, stream=False, temperature=0.8, top_p=0.9, top_k=50, seed=5)
    again = list(again.token_ids)
    add("session sampled: seeded run repeats", again == out[(True, "sampled")],
        decode_tok_s_device=speed[(True, "sampled")], decode_tok_s_host=speed[(False, "sampled")])

    # A stop string ends a device stream after the device ran the token that completed it (one step ahead): the
    # next turn must see exactly the state of a session that fed the same tokens lock-step, one step each.
    probe = model.session().generate(prompt, max_tokens=12, stream=False, temperature=0.0)
    stop = model.tokenizer.decode(probe.token_ids[3:5])
    ran_ahead = model.session()
    r = ran_ahead.generate(prompt, max_tokens=12, stop=stop, stream=False, temperature=0.0)
    lock = model.session()
    lock.device_sampling = False
    lock.generate(prompt, max_tokens=len(r.token_ids), stream=False, temperature=0.0)
    lock.flush()
    a = ran_ahead.generate(" next", max_tokens=4, stream=False, temperature=0.0, logprobs=True)
    b = lock.generate(" next", max_tokens=4, stream=False, temperature=0.0, logprobs=True)
    same = (ran_ahead.tokens[:len(lock.tokens)] == lock.tokens and a.token_ids == b.token_ids
            and a.logprobs == b.logprobs)
    add("session after a stop string (run ahead) == lock-step", same and r.finish_reason == "stop",
        finish_reason=r.finish_reason, tokens=len(r.token_ids))
