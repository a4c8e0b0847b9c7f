"""The engine worker: one thread owns the model and its session; requests run one at a time, in order.

Handlers (asyncio) submit `Job`s; the worker pushes events back to the handler's asyncio queue:
("start", queue_s), ("progress", done, total) during the prefill, ("chunk", GenerationChunk) per token,
("error", exception), ("end",). A job whose `cancel` is set (client gone) stops after the decode step in
flight, or between prefill pieces, and the next job starts.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..model import Model
    from ..prefix_cache import PrefixCache


class Cancelled(Exception):
    """The client went away; raised inside the worker to stop a job."""


_ids = itertools.count(1)


@dataclass
class Job:
    ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    constraint: Any = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    number: int = field(default_factory=lambda: next(_ids))
    enqueued: float = field(default_factory=time.perf_counter)
    steps: int = 0                 # decode steps done (tokens sampled)
    cancel_step: int | None = None  # `steps` when the cancel was requested
    finished: bool = False

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    def request_cancel(self) -> None:
        if not self.cancel.is_set() and not self.finished:
            self.cancel_step = self.steps
            self.cancel.set()


class EngineWorker:
    """Owns `model` and one session (with the prefix cache); runs jobs from a FIFO queue."""

    def __init__(self, model: "Model", cache: "PrefixCache | None", progress_tokens: int = 4096):
        self.model = model
        self.cache = cache
        self.session = model.session(prefix_cache=cache)
        self.session.progress_tokens = progress_tokens
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lily-engine", daemon=True)
        self._lock = threading.Lock()
        self.waiting = 0
        self.current: Job | None = None
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "last_cancel_steps": None,
                      "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._stopping = False
        # test hook: pretend every decode step takes this long (a fast tiny model finishes before a client
        # can hang up); only read from the environment, never from a request
        self._step_delay = float(os.environ.get("LILY_TEST_STEP_DELAY", "0") or 0)

    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.current is not None

    def submit(self, job: Job) -> int:
        """Queue a job; returns how many jobs are ahead of it."""
        with self._lock:
            ahead = self.waiting + (1 if self.current is not None else 0)
            self.waiting += 1
        self._jobs.put(("job", job))
        return ahead

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on the worker thread, in queue order (e.g. saving sessions); returns a Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put(("call", (fn, fut)))
        return fut

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job, drop queued ones, and end the thread."""
        self._stopping = True
        if self.current is not None:
            self.current.request_cancel()
        self._jobs.put(("stop", None))
        self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, item = self._jobs.get()
            if kind == "stop":
                return
            if kind == "call":
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
                continue
            job: Job = item
            with self._lock:
                self.waiting -= 1
                self.current = job
            try:
                if self._stopping or job.cancel.is_set():
                    job.emit("error", Cancelled("the request was cancelled before it started"))
                    self.stats["cancelled"] += 1
                else:
                    self._generate(job)
            finally:
                job.finished = True
                with self._lock:
                    self.current = None

    def _generate(self, job: Job) -> None:
        self.stats["requests"] += 1
        job.emit("start", time.perf_counter() - job.enqueued)

        def progress(done: int, total: int) -> None:
            if job.cancel.is_set():
                raise Cancelled
            job.emit("progress", done, total)

        gen = None
        try:
            gen = self.session.generate(job.ids, whole=True, stream=True, sampling=job.sampling,
                                        progress=progress, constraint=job.constraint)
            for chunk in gen:
                job.steps += 1
                if chunk.stats is not None:
                    s = chunk.stats
                    self.stats["prompt_tokens"] += s.prompt_tokens
                    self.stats["cached_tokens"] += s.cached_tokens
                    self.stats["generated_tokens"] += s.generated_tokens
                job.emit("chunk", chunk)
                if self._step_delay:
                    time.sleep(self._step_delay)
                if job.cancel.is_set():
                    raise Cancelled
            self.stats["completed"] += 1
            job.emit("end")
        except Cancelled:
            self.stats["cancelled"] += 1
            self.stats["last_cancel_steps"] = job.steps - (job.cancel_step or 0)
            job.emit("error", Cancelled("the client disconnected"))
        except Exception as e:  # reported to the client; the worker keeps serving
            self.stats["errors"] += 1
            job.emit("error", e)
        finally:
            if gen is not None:
                gen.close()
