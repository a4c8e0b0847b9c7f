"""The engine worker's parking, driven directly (no HTTP): a new request parks the longest-running one, parked
requests take turns every PARK_SLICE_STEPS steps, the parking budget bounds them, and the drain rate behind
Retry-After counts the time between finishes, not the time queued."""
from __future__ import annotations

import asyncio
import time

import pytest

import lily
from lily.prefix_cache import PrefixCache
from lily.sampling import SamplingParams
from lily.server.worker import PARK_SLICE_STEPS, EngineWorker, Job


@pytest.fixture(scope="module")
def model():
    return lily.load(backend="cpu", max_context=1024, threads=2)


def _no_end(model) -> dict[int, float]:
    return {i: -100.0 for i in model.stop_token_ids}


async def _run(worker: EngineWorker, jobs: list[Job], log: list[tuple[int, str]]) -> None:
    async def follow(job: Job) -> None:
        while True:
            ev = await job.events.get()
            if ev[0] in ("parked", "resumed", "end", "error"):
                log.append((job.number, ev[0]))
            if ev[0] in ("end", "error"):
                return
    await asyncio.gather(*(follow(j) for j in jobs))


def test_parked_requests_take_turns_and_all_finish(model):
    async def go():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(model, PrefixCache(), parallel=1, park_bytes=1 << 30)
        worker.start()
        params = SamplingParams(max_tokens=3 * PARK_SLICE_STEPS, temperature=0.0, logit_bias=_no_end(model))
        first = Job(model.tokenize("first request"), params, loop)
        worker.submit(first)
        while first.steps < 3:
            await asyncio.sleep(0.005)
        second = Job(model.tokenize("second request"), params, loop)
        worker.submit(second)
        log: list[tuple[int, str]] = []
        await _run(worker, [first, second], log)
        stats = dict(worker.stats)
        worker.stop()
        return first, second, log, stats

    first, second, log, stats = asyncio.run(go())
    a, b = first.number, second.number
    assert log[0] == (a, "parked"), log                      # the new request did not wait
    assert (a, "resumed") in log and (b, "parked") in log     # ... and the parked one had its turn before it ended
    assert log.index((a, "resumed")) < log.index((b, "end"))
    assert first.steps == second.steps == 3 * PARK_SLICE_STEPS
    assert stats["parks"] >= 2 and stats["completed"] == 2


def test_past_the_parking_budget_new_requests_wait(model):
    async def go():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(model, PrefixCache(), parallel=1, park_bytes=1)  # no state fits
        worker.start()
        params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=_no_end(model))
        first = Job(model.tokenize("first"), params, loop)
        worker.submit(first)
        while first.steps < 2:
            await asyncio.sleep(0.005)
        second = Job(model.tokenize("second"), params, loop)
        worker.submit(second)
        log: list[tuple[int, str]] = []
        await _run(worker, [first, second], log)
        worker.stop()
        return log

    log = asyncio.run(go())
    assert [e for _, e in log] == ["end", "end"] and log[0][0] < log[1][0]  # in order, nobody parked


def test_the_drain_rate_leaves_the_queue_time_out(model):
    """Eight 1-token requests queued behind each other: each waits for all before it, but they finish a
    fixed interval apart, and that interval is what Retry-After multiplies."""
    async def go():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(model, PrefixCache(), parallel=1, park_bytes=0)
        worker.start()
        jobs = [Job(model.tokenize(f"request {i}"), SamplingParams(max_tokens=1, temperature=0.0), loop)
                for i in range(8)]
        for j in jobs:
            worker.submit(j)
        t0 = loop.time()
        await _run(worker, jobs, [])
        took = loop.time() - t0
        with worker._lock:
            worker.waiting = 8  # as if eight were in the server now
            estimate = worker.drain_seconds_locked()
            worker.waiting = 0
        worker.stop()
        return took, estimate

    took, estimate = asyncio.run(go())
    assert took / 2 <= estimate <= took * 2, (took, estimate)


def test_with_parking_room_the_queue_is_still_bounded(model):
    """A flood while the parking budget has room: requests that have not started count against --max-queue (one in
    its prefill cannot be parked, so they would wait unbounded), and the one past it is refused with QueueFull."""
    from lily.server.worker import QueueFull

    async def go():
        loop = asyncio.get_running_loop()
        worker = EngineWorker(model, PrefixCache(), parallel=1, max_queue=3, park_bytes=1 << 30)
        worker._inbox.put(("wake", None))  # (not started: every submitted job stays waiting)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        accepted, refused = 0, 0
        for i in range(10):
            try:
                worker.submit(Job(model.tokenize(f"flood {i}"), params, loop))
                accepted += 1
            except QueueFull as e:
                refused += 1
                assert "--max-queue 3" in str(e) and e.retry_after_s > 0
        return accepted, refused, worker.waiting

    accepted, refused, waiting = asyncio.run(go())
    assert (accepted, refused, waiting) == (3, 7, 3)


async def _two_running(model, loop, min_steps: int, max_tokens: int = 900) -> tuple[EngineWorker, list[Job]]:
    """A started worker of two slots with two long greedy requests that have each run min_steps steps."""
    worker = EngineWorker(model, PrefixCache(), parallel=2, park_bytes=0)
    worker.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=_no_end(model))
    jobs = [Job(model.tokenize(f"stream {i}"), params, loop) for i in range(2)]
    for j in jobs:
        worker.submit(j)
    while min(j.steps for j in jobs) < min_steps and not any(j.finished for j in jobs):
        await asyncio.sleep(0.01)
    return worker, jobs


def _scoring(model, n: int):
    from lily.server.scoring import prompt_logprobs
    ids = model.tokenize("the quick brown fox jumps over the lazy dog " * (n // 8))[:n]
    return prompt_logprobs(model, ids, 1)


def test_scoring_runs_between_the_streams_steps_and_stops_on_cancel_and_timeout(model):
    """Prompt scoring (echo + logprobs) one piece per decode round: two running streams keep stepping while a
    1,000-token prompt is scored (their largest gap a piece, well under 0.5 s), and a scoring call stops within
    0.5 s of a hang-up (cancel) or its timeout."""
    import threading

    from lily.server.worker import Cancelled, RequestTimeout

    async def go():
        loop = asyncio.get_running_loop()
        worker, streams = await _two_running(model, loop, min_steps=3)
        times: list[list[float]] = [[], []]

        async def follow(i: int, job: Job) -> None:
            while not job.finished:
                ev = await job.events.get()
                if ev[0] == "chunk":
                    times[i].append(time.perf_counter())
                if ev[0] in ("end", "error"):
                    return
        followers = [asyncio.create_task(follow(i, j)) for i, j in enumerate(streams)]
        t0 = time.perf_counter()
        scored = await asyncio.wrap_future(worker.call_sliced(_scoring(model, 1000), threading.Event(), None))
        took = time.perf_counter() - t0
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a >= t0]
        steps_during = [sum(1 for t in ts if t0 <= t) for ts in times]

        cancel = threading.Event()
        fut = worker.call_sliced(_scoring(model, 1000), cancel, None)
        await asyncio.sleep(0.3)
        cancel.set()
        t1 = time.perf_counter()
        with pytest.raises(Cancelled):
            await asyncio.wrap_future(fut)
        cancel_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        with pytest.raises(RequestTimeout):
            await asyncio.wrap_future(worker.call_sliced(_scoring(model, 1000), threading.Event(), 0.3))
        timeout_s = time.perf_counter() - t2
        for j in streams:
            j.request_cancel()
        await asyncio.gather(*followers)
        worker.stop()
        return len(scored), took, max(gaps), steps_during, cancel_s, timeout_s

    n, took, gap, steps, cancel_s, timeout_s = asyncio.run(go())
    assert n == 1000 and took > 0.5
    assert min(steps) > 5 and gap < 0.5, (gap, steps, took)
    assert cancel_s < 0.5 and timeout_s < 0.8, (cancel_s, timeout_s)


def test_retry_after_before_the_first_finish_is_the_tokens_still_to_generate(model):
    """Before any request finished, the estimate is the tokens the requests in the server still have to generate at
    the rate tokens go out now: two running requests of 400 tokens, 0.3 s in, advise what their real drain then
    takes (within 2x). (It was the oldest running request's age per slot, which advised 6.9 s at the first refusal
    of a 100 req/s flood that took 39 s to drain: tests/server/test_server_lifecycle.py's flood test.)"""
    async def go():
        loop = asyncio.get_running_loop()
        worker, jobs = await _two_running(model, loop, min_steps=2, max_tokens=400)
        await asyncio.sleep(0.3)
        with worker._lock:
            estimate = worker.drain_seconds_locked()
        t0 = time.perf_counter()
        await _run(worker, jobs, [])
        drained = time.perf_counter() - t0
        worker.stop()
        return estimate, drained, [j.steps for j in jobs]

    estimate, drained, steps = asyncio.run(go())
    assert steps == [400, 400] and drained / 2 <= estimate <= 2 * drained, (estimate, drained)
