"""The engine worker: one thread owns the model and serves requests by interleaving their decode steps.

Each running request (at most `parallel`) has its own `Session` of the shared model (its own engine state,
all sessions sharing one `PrefixCache`). The thread pulls one chunk from each running request's
`Session.generate(stream=True)` iterator in turn (round-robin), so a short request never waits for a long
one to finish. A new request's prefill runs in slices of `prefill_slice` tokens and, between slices, every
request that is already decoding makes one step. Requests beyond `parallel` wait in arrival order;
`max_queue` bounds how many may wait (`submit` raises `QueueFull`, answered 503 + Retry-After).

Handlers (asyncio) submit `Job`s; the worker pushes events back to the handler's asyncio queue:
("queued", ahead) when the job's place in the queue changes, ("start", queue_s), ("progress", done, total)
during the prefill, ("chunk", GenerationChunk) per token, ("error", exception), ("end",). A job whose
`cancel` is set (client gone) or whose deadline passed stops after the step in flight, or between prefill
slices.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator


from ..errors import LilyError, NonFiniteLogitsError
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..model import Model
    from ..prefix_cache import PrefixCache
    from ..session import Session


class Cancelled(Exception):
    """The client went away; raised inside the worker to stop a job."""


class RequestTimeout(LilyError):
    """The request ran (queued + prefill + decode) longer than the server's --request-timeout."""


# The model produced NaN/inf logits (Session.generate raises it; prompt scoring too): a 500 non_finite_logits.
NonFiniteLogits = NonFiniteLogitsError


class QueueFull(LilyError):
    """--max-queue requests are already waiting; `retry_after_s` estimates when a slot frees up."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


_ids = itertools.count(1)


@dataclass
class Job:
    ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    constraint: Any = None
    timeout_s: float | None = None  # from arrival to the last token; None: no limit
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    number: int = field(default_factory=lambda: next(_ids))
    enqueued: float = field(default_factory=time.perf_counter)
    steps: int = 0                 # decode steps done (tokens sampled)
    cancel_step: int | None = None  # `steps` when the cancel was requested
    finished: bool = False
    # worker-side state
    session: "Session | None" = None
    gen: Iterator[Any] | None = None
    decoding: bool = False         # the first chunk came: the prefill is done
    ahead: int = -1                # last queue position sent
    next_progress: int = 0

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    def request_cancel(self) -> None:
        if not self.cancel.is_set() and not self.finished:
            self.cancel_step = self.steps
            self.cancel.set()

    def overdue(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.enqueued > self.timeout_s


class EngineWorker:
    """Owns `model`, a pool of sessions (one per running request) and the wait queue."""

    def __init__(self, model: "Model", cache: "PrefixCache | None", progress_tokens: int = 4096, *,
                 parallel: int = 4, max_queue: int = 64, prefill_slice: int = 512, metrics: Any = None):
        if parallel < 1:
            raise ValueError(f"parallel={parallel} is invalid: expected at least 1 running request")
        self.model = model
        self.cache = cache
        self.parallel = parallel
        self.max_queue = max_queue
        self.progress_tokens = progress_tokens
        self.prefill_slice = max(1, min(prefill_slice, progress_tokens) if progress_tokens > 0 else prefill_slice)
        self.metrics = metrics
        self.sessions: list["Session"] = []          # the pool; a session is busy while a job holds it
        self._busy_sessions: set[int] = set()
        self._dirty: list["Session"] = []            # sessions with a sampled token not yet run (flush when idle)
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._thread = threading.Thread(target=self._run, name="lily-engine", daemon=True)
        self._lock = threading.Lock()
        self.waiting = 0        # submitted, not started (read by handlers)
        self.running = 0        # started, not finished
        self._job_seconds = collections.deque(maxlen=32)  # recent run times, for Retry-After
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "timeouts": 0, "rejected": 0,
                      "last_cancel_steps": None, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._stopping = False
        # test hook: pretend every decode step takes this long (a fast tiny model finishes before a client
        # can hang up); only read from the environment, never from a request
        self._step_delay = float(os.environ.get("LILY_TEST_STEP_DELAY", "0") or 0)

    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.running > 0

    @property
    def session(self) -> "Session":
        """The first session of the pool (made on demand)."""
        return self.sessions[0] if self.sessions else self._new_session()

    # ---- called from the handlers ------------------------------------------------------------------
    def queued(self) -> int:
        """Requests that are waiting for a running slot (not those about to start)."""
        with self._lock:
            return max(0, self.waiting + self.running - self.parallel)

    def check_room(self) -> None:
        """Raise QueueFull when a new request would have to wait and the queue is full."""
        with self._lock:
            self._check_room_locked()

    def _check_room_locked(self) -> None:
        would_wait = self.waiting + self.running >= self.parallel
        if would_wait and self.waiting + self.running - self.parallel >= self.max_queue:
            self.stats["rejected"] += 1
            raise QueueFull(f"the server is busy: {self.running} request(s) running and "
                            f"{self.waiting} waiting (--max-queue {self.max_queue}); retry later",
                            self.retry_after_locked())

    def retry_after_locked(self) -> int:
        per_job = (sum(self._job_seconds) / len(self._job_seconds)) if self._job_seconds else 1.0
        ahead = max(1, self.waiting + self.running - self.parallel + 1)
        return max(1, min(600, math.ceil(per_job * ahead / self.parallel)))

    def submit(self, job: Job) -> int:
        """Queue a job; returns how many requests must finish before it starts (0: it starts now)."""
        with self._lock:
            self._check_room_locked()
            ahead = max(0, self.waiting + self.running - self.parallel + 1)
            self.waiting += 1
        job.ahead = ahead
        self._inbox.put(("job", job))
        return ahead

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on the worker thread between decode rounds (e.g. saving sessions); returns a Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel running jobs, drop queued ones, and end the thread."""
        self._stopping = True
        for job in list(self._active):
            job.request_cancel()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self._active and not self._waiting
            if idle and self._inbox.empty():
                self._flush_idle_sessions()
            if not self._take_inbox(block=idle):
                return
            self._start_waiting()
            for job in list(self._active):
                if not job.finished:
                    self._step(job)

    def _take_inbox(self, block: bool) -> bool:
        """Handle what the handlers sent; False on stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                for job in list(self._active) + list(self._waiting):
                    self._end(job, Cancelled("the server is shutting down"))
                return False
            if kind == "call":
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            else:
                self._waiting.append(item)

    def _start_waiting(self) -> None:
        now = time.perf_counter()
        for job in [j for j in self._waiting if j.cancel.is_set() or j.overdue(now) or self._stopping]:
            self._waiting.remove(job)
            with self._lock:
                self.waiting -= 1
            self._end(job, RequestTimeout(self._timeout_message(job)) if job.overdue(now) else
                      Cancelled("the request was cancelled before it started"), started=False)
        while self._waiting and len(self._active) < self.parallel:
            job = self._waiting.popleft()
            with self._lock:
                self.waiting -= 1
                self.running += 1
            self._begin(job)
        for i, job in enumerate(self._waiting):  # everyone behind moved up
            if job.ahead != i + 1:
                job.ahead = i + 1
                job.emit("queued", i + 1)

    def _pick_session(self, ids: list[int]) -> "Session":
        """An idle session whose live state is the longest prefix of ids; else a new one (pool not full);
        else the least recently used idle one (its state goes to the prefix cache when replaced)."""
        best, best_n = None, -1
        for s in self.sessions:
            if id(s) in self._busy_sessions:
                continue
            held = s._tokens
            n = len(held) if len(held) <= len(ids) and ids[:len(held)] == held else 0
            if n > best_n:
                best, best_n = s, n
        if (best is None or best_n == 0) and len(self.sessions) < self.parallel:
            best = self._new_session()
        self.sessions.remove(best)
        self.sessions.append(best)  # most recently used last
        return best

    def _new_session(self) -> "Session":
        s = self.model.session(prefix_cache=self.cache)
        self.sessions.insert(0, s)
        return s

    def _begin(self, job: Job) -> None:
        self.stats["requests"] += 1
        job.emit("start", time.perf_counter() - job.enqueued)
        if self.metrics is not None:
            self.metrics.observe("queue", time.perf_counter() - job.enqueued)
        s = self._pick_session(job.ids)
        self._busy_sessions.add(id(s))
        if s in self._dirty:
            self._dirty.remove(s)
        job.session = s
        s.progress_tokens = self.prefill_slice
        job.next_progress = self.progress_tokens
        self._active.append(job)
        try:
            job.gen = s.generate(job.ids, whole=True, stream=True, sampling=job.sampling,
                                 progress=lambda done, total: self._progress(job, done, total),
                                 constraint=job.constraint)
        except Exception as e:  # e.g. the prompt does not fit: reported to the client
            self._end(job, e)

    def _progress(self, job: Job, done: int, total: int) -> None:
        """Between prefill slices of `job`: stop it if cancelled, report, and let decoding jobs step."""
        if job.cancel.is_set():
            raise Cancelled
        if job.overdue(time.perf_counter()):
            raise RequestTimeout(self._timeout_message(job))
        if self.progress_tokens > 0 and (done >= job.next_progress or done == total):
            job.emit("progress", done, total)
            while job.next_progress <= done:
                job.next_progress += self.progress_tokens
        for other in list(self._active):
            if other is not job and other.decoding and not other.finished:
                self._step(other)

    def _step(self, job: Job) -> None:
        """Pull one chunk from the job's stream (the first pull runs its prefill)."""
        try:
            if job.cancel.is_set():
                raise Cancelled
            if job.overdue(time.perf_counter()):
                raise RequestTimeout(self._timeout_message(job))
            chunk = next(job.gen)
        except StopIteration:
            self._end(job, LilyError("the generation ended without a final chunk"))
            return
        except Exception as e:
            self._end(job, e)
            return
        job.decoding = True
        job.steps += 1
        job.emit("chunk", chunk)
        if self._step_delay:
            time.sleep(self._step_delay)
        if chunk.finish_reason is not None:
            s = chunk.stats
            if s is not None:
                self.stats["prompt_tokens"] += s.prompt_tokens
                self.stats["cached_tokens"] += s.cached_tokens
                self.stats["generated_tokens"] += s.generated_tokens
                if self.metrics is not None:
                    self.metrics.finished(s)
            self._end(job, None)

    def _end(self, job: Job, error: BaseException | None, started: bool = True) -> None:
        if job.finished:
            return
        job.finished = True
        if job in self._active:
            self._active.remove(job)
        if started and job.session is not None:
            with self._lock:
                self.running -= 1
                self._job_seconds.append(time.perf_counter() - job.enqueued)
            if job.gen is not None:
                try:
                    job.gen.close()
                except Exception:  # closing a broken stream: the error (if any) was reported already
                    pass
            self._busy_sessions.discard(id(job.session))
            self._dirty.append(job.session)
        if error is None:
            self.stats["completed"] += 1
            job.emit("end")
            return
        if isinstance(error, Cancelled):
            self.stats["cancelled"] += 1
            if started:
                self.stats["last_cancel_steps"] = job.steps - (job.cancel_step or 0)
            if not str(error):
                error = Cancelled("the client disconnected")
        elif isinstance(error, RequestTimeout):
            self.stats["timeouts"] += 1
        else:
            self.stats["errors"] += 1
        if self.metrics is not None:
            self.metrics.failed(type(error).__name__)
        job.emit("error", error)

    def _timeout_message(self, job: Job) -> str:
        return (f"the request took longer than the server's request timeout of {job.timeout_s:g} s (queued and "
                f"running; lily serve --request-timeout) and was stopped after {job.steps} token(s)")

    def _flush_idle_sessions(self) -> None:
        """Nothing to do: run each finished session's last sampled token (e.g. <|im_end|>) so that the next
        turn of that conversation reuses all of it."""
        while self._dirty and self._inbox.empty():
            s = self._dirty.pop()
            try:
                s.flush()
            except Exception:  # e.g. the context is full: the token stays pending, reuse stops before it
                pass
