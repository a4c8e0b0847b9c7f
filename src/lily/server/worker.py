"""The engine worker: one thread owns the model and serves requests by decoding them together.

Each running request (at most `parallel`) has its own `Session` of the shared model (its own engine state,
all sessions sharing one `PrefixCache`). Each round, the streams whose next token is one plain step away are
decoded in one forward (`_step_together`), then the thread pulls one chunk from each running request's
`Session.generate(stream=True)` iterator in turn, so a short request never waits for a long one to finish. A new request's prefill runs in slices of `prefill_slice` tokens and, between slices, every
request that is already decoding makes one step.

All slots busy: a new request does not wait for one to free up. The running request that has run longest is
*parked* (its generator and session state kept, not stepped) and the new one starts at once; parked requests
resume in turn, when a slot frees up or every `PARK_SLICE_STEPS` steps of the one that has run longest (time
slicing, so a stream of new requests cannot starve them). The states of parked requests are bounded by
`park_bytes`; past it, and with parking off (0), new requests wait in arrival order, and `max_queue` bounds
how many may wait (`submit` raises `QueueFull`, answered 503 + Retry-After from the measured drain rate).

Handlers (asyncio) submit `Job`s; the worker pushes events back to the handler's asyncio queue:
("queued", ahead) when the job's place in the queue changes, ("start", queue_s), ("progress", done, total)
during the prefill, ("chunk", GenerationChunk) per token, ("error", exception), ("end",). A job whose
`cancel` is set (client gone) stops after the step in flight, or between prefill slices.

A job stopped by the server after it started (its deadline passed, or the server is shutting down) gets a last
("chunk", ...) with finish_reason "length" and stop_reason `STOP_TIMEOUT` / `STOP_SHUTDOWN` (empty text, its
stats so far), so every handler answers with what was generated; a timeout then ends with ("end",) (a final
answer no client re-runs), a shutdown with ("error", ServerShutdown).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import math
import os
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import LilyError, NonFiniteLogitsError
from ..generation import FINISH_LENGTH, GenerationChunk, GenerationStats
from ..prefix_cache import PrefixCache
from ..sampling import SamplingParams
from ..session import Session

# the stop reasons of a job the server ended early (the final choice's `stop_reason`, vLLM's field)
STOP_TIMEOUT = "request_timeout"
STOP_SHUTDOWN = "server_shutdown"
# steps a resumed (or new) request runs before it may be parked again for one that waits in the parking lot
PARK_SLICE_STEPS = 32
# finishes the drain rate (Retry-After) is measured over
DRAIN_WINDOW = 32
DEFAULT_REPLY_TOKENS = 256  # the drain estimate's reply length before any request finished


class Cancelled(Exception):
    """The client went away; raised inside the worker to stop a job."""


class RequestTimeout(LilyError):
    """The request ran (queued + prefill + decode) longer than the server's --request-timeout."""


class ServerShutdown(LilyError):
    """The server is shutting down: queued and new requests are refused (503), running ones end early."""


# The model produced NaN/inf logits (Session.generate raises it; prompt scoring too): a 500 non_finite_logits.
NonFiniteLogits = NonFiniteLogitsError


class QueueFull(LilyError):
    """--max-queue requests are already waiting; `retry_after_s` estimates when the queue will have drained."""

    def __init__(self, message: str, retry_after_s: float):
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
    session: Session | None = None
    gen: Iterator[Any] | None = None
    decoding: bool = False         # the first chunk came: the prefill is done
    ahead: int = -1                # last queue position sent
    next_progress: int = 0
    began: float = 0.0             # when it started (perf_counter)
    first_token_at: float = 0.0
    cached_tokens: int = 0         # prompt tokens its session already held
    slice_steps: int = 0           # steps since it started or was resumed
    parked_bytes: int = 0          # its session's state while parked
    expected_tokens: int = 0       # tokens it is expected to generate (EngineWorker.submit; the drain estimate)

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


def _libc_malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


_MALLOC_TRIM = _libc_malloc_trim() if os.name == "posix" else None


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc keeps them in its per-thread arenas: after bursts of
    concurrent requests, served by many threads, the RSS stayed at its peak while idle)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class _Sliced:
    """A call_sliced generator in progress on the worker thread."""
    gen: Iterator[Any]
    fut: concurrent.futures.Future
    cancel: threading.Event
    deadline: float | None
    timeout_s: float | None
    what: str


class EngineWorker:
    """Owns `model`, a pool of sessions (one per started request) and the wait queue."""

    def __init__(self, model: Any, cache: PrefixCache | None, progress_tokens: int = 4096, *,
                 parallel: int = 4, max_queue: int = 64, prefill_slice: int = 512, park_bytes: int = 0,
                 metrics: Any = None):
        if parallel < 1:
            raise ValueError(f"parallel={parallel} is invalid: expected at least 1 running request")
        self.model = model
        self.cache = cache
        self.parallel = parallel
        self.max_queue = max_queue
        self.park_bytes = max(0, int(park_bytes))
        self.progress_tokens = progress_tokens
        self.prefill_slice = max(1, min(prefill_slice, progress_tokens) if progress_tokens > 0 else prefill_slice)
        self.metrics = metrics
        self.sessions: list[Session] = []            # the pool; a session is busy while a job holds it
        self._busy_sessions: set[int] = set()
        self._dirty: list[Session] = []              # sessions with a sampled token not yet run (flush when idle)
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._parked: collections.deque[Job] = collections.deque()
        self._sliced: list[_Sliced] = []  # call_sliced work in progress
        self._thread = threading.Thread(target=self._run, name="lily-engine", daemon=True)
        self._lock = threading.Lock()
        self.waiting = 0        # submitted, not started (read by handlers)
        self.running = 0        # started and stepped
        self.parked = 0         # started and parked
        self.parked_bytes = 0   # their sessions' state
        self._drain_gaps: collections.deque[float] = collections.deque(maxlen=DRAIN_WINDOW)
        self._last_finish = 0.0
        self._busy_since = 0.0
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "timeouts": 0, "rejected": 0,
                      "parks": 0, "resumes": 0, "shutdown_ended": 0, "last_cancel_steps": None,
                      "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "batched_steps": 0, "batched_rows": 0}  # forwards that stepped several streams, their rows
        self._draining = False
        self._tokens_ahead = 0  # expected tokens not yet generated by the submitted requests (drain estimate)
        self._decode_cost: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)  # (s, tokens)
        self._prefill_cost: collections.deque[float] = collections.deque(maxlen=32)  # s per request's prefill
        self._nested_s = 0.0  # time spent stepping others inside a prefill (_progress), kept out of its cost
        self._round_tokens, self._round_other_s = 0, 0.0  # the current round's tokens, its prefill / scoring time
        self._token_times: collections.deque[float] = collections.deque(maxlen=1 << 16)  # recent tokens sent
        engine = getattr(model, "engine", None)
        # None: the backend steps one stream per forward (each job's stream then steps itself)
        self._step_streams = engine.step_streams if getattr(engine, "batches_streams", False) else None
        # test hook: pretend every decode step takes this long (a fast tiny model finishes before a client
        # can hang up); only read from the environment, never from a request
        self._step_delay = float(os.environ.get("LILY_TEST_STEP_DELAY", "0") or 0)

    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.running + self.parked > 0

    def decode_rate(self, window_s: float = 5.0) -> float:
        """Tokens per second sent to all clients together over the last window_s seconds (over the time since the
        first of them when tokens began to go out within the window: a server busy for 0.5 s is not at 1/4 of its
        rate over 2 s)."""
        now = time.perf_counter()
        times = list(self._token_times)
        recent = [t for t in times[-(1 << 14):] if now - t <= window_s]
        if len(recent) < 8:
            return len(recent) / window_s
        return len(recent) / max(now - recent[0], 1e-3)

    def batch_info(self) -> dict:
        """The batch: its width (--parallel), rows per forward that stepped several streams, recent tok/s."""
        steps, rows = self.stats["batched_steps"], self.stats["batched_rows"]
        return {"width": self.parallel, "batched_steps": steps, "mean_rows": round(rows / steps, 2) if steps else 0.0,
                "decode_tokens_per_s": round(self.decode_rate(), 1)}

    @property
    def scoring(self) -> int:
        """call_sliced work in progress (prompt scoring)."""
        return len(self._sliced)

    @property
    def session(self) -> Session:
        """The first session of the pool (made on demand)."""
        return self.sessions[0] if self.sessions else self._new_session()

    # ---- called from the handlers ------------------------------------------------------------------
    def queued(self) -> int:
        """Requests that are waiting for a running slot (not those about to start)."""
        with self._lock:
            return max(0, self.waiting + self.running - self.parallel)

    def idle(self) -> bool:
        with self._lock:
            return self.waiting + self.running + self.parked == 0

    def check_room(self) -> None:
        """Raise ServerShutdown while shutting down, QueueFull when the queue is full."""
        with self._lock:
            self._check_room_locked()

    def _check_room_locked(self) -> None:
        if self._draining:
            self.stats["rejected"] += 1
            raise ServerShutdown("the server is shutting down and takes no new requests")
        # Requests that wait: without parking room, those past the free slots; with it, every one not started yet
        # (each starts by parking a decoding request, but one still in its prefill cannot be parked, so under a
        # flood they wait all the same: a 100 req/s flood queued 470 against --max-queue 64 when they were not
        # counted). Either way at most --max-queue wait; the next gets a 503.
        parking = self.park_bytes > 0 and self.parked_bytes < self.park_bytes
        queued = self.waiting if parking else self.waiting + self.running - self.parallel
        if queued >= self.max_queue:
            self.stats["rejected"] += 1
            raise QueueFull(f"the server is busy: {self.running} request(s) running, {self.parked} parked and "
                            f"{self.waiting} waiting (--max-queue {self.max_queue}); retry later",
                            self.drain_seconds_locked())

    def drain_seconds_locked(self) -> float:
        """Seconds until the requests in the server now have finished: the tokens they still have to generate
        (each request's max_tokens, at most the mean reply once some finished; 256 without either) at the measured cost of a token
        (the last 256 rounds' wall time per token made, prefills and scoring left out), plus the waiting
        requests' prefills at their measured mean. (The mean time between finishes times the requests ahead
        advised 2-3.6x the real drain in a 100 req/s flood, whose first finishes came slowly while every arrival
        parked a running request; the oldest running request's age per slot advised 6.9 s for a 39 s drain.)
        Before 8 tokens were made: the mean time between finishes per request ahead, else the oldest running
        request's age per slot, else 1 s per request per slot."""
        ahead = max(1, self.waiting + self.running + self.parked)
        decode = list(self._decode_cost)
        tokens = sum(n for _, n in decode)
        if tokens >= 8:  # the median round's cost per token: rounds stalled by a burst of arrivals (their parsing and
            # templates hold the GIL) made the mean 2-3x what the drain then took
            per_token = statistics.median(t / n for t, n in decode)
            prefills = list(self._prefill_cost)
            per_prefill = sum(prefills) / len(prefills) if prefills else 0.0
            return max(0.05, min(600.0, max(0, self._tokens_ahead) * per_token + self.waiting * per_prefill))
        if self._drain_gaps:
            per_job = sum(self._drain_gaps) / len(self._drain_gaps)
        else:
            began = [j.began for j in list(self._active) if j.began > 0]
            per_job = ((time.perf_counter() - min(began)) if began else 1.0) / self.parallel
        return max(0.05, min(600.0, per_job * ahead))

    def submit(self, job: Job) -> int:
        """Queue a job; returns how many requests must finish before it starts (0: it starts now, or soon
        by parking another)."""
        with self._lock:
            self._check_room_locked()
            ahead = max(0, self.waiting + self.running - self.parallel + 1)
            if self.park_bytes > 0:
                ahead = 0
            self.waiting += 1
            job.expected_tokens = self._expected_tokens(job)
            self._tokens_ahead += job.expected_tokens
        job.ahead = ahead
        self._inbox.put(("job", job))
        return ahead

    def _expected_tokens(self, job: Job) -> int:
        """Tokens `job` will generate, for the drain estimate: its max_tokens, at most the mean reply so far."""
        done = self.stats["completed"]
        if not done:
            return max(1, job.sampling.max_tokens if job.sampling.max_tokens is not None else DEFAULT_REPLY_TOKENS)
        typical = self.stats["generated_tokens"] / done
        return max(1, int(min(job.sampling.max_tokens or typical, typical)))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on the worker thread between decode rounds (e.g. saving sessions); returns a Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def call_sliced(self, gen: Iterator[Any], cancel: threading.Event, timeout_s: float | None,
                    what: str = "the request") -> concurrent.futures.Future:
        """Run the generator on the worker thread one item per decode round (between the other requests' steps), so
        a long piece of work (prompt scoring) stalls running streams by one slice at most; its Future gets the
        generator's return value, or Cancelled (cancel set: the client hung up), RequestTimeout (past timeout_s
        from now) or ServerShutdown, checked between slices."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        deadline = None if not timeout_s else time.perf_counter() + timeout_s
        self._inbox.put(("sliced", _Sliced(gen, fut, cancel, deadline, timeout_s, what)))
        return fut

    def begin_shutdown(self) -> None:
        """Refuse new requests; end the queued ones (503) and the started ones (their text so far, then a
        shutdown error) at the next step. Returns at once; `idle()` says when all have ended."""
        with self._lock:
            self._draining = True
        self._inbox.put(("wake", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel running jobs, drop queued ones, and end the thread."""
        self._draining = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self._active and not self._waiting and not self._parked and not self._sliced
            if idle and self._inbox.empty():
                self._flush_idle_sessions()
            if not self._take_inbox(block=idle):
                return
            t0 = time.perf_counter()
            self._round_tokens, self._round_other_s = 0, 0.0
            self._schedule()
            self._step_together(self._active)
            for job in list(self._active):
                if not job.finished:
                    self._step(job)
            if self._sliced:  # one piece a round, in turn: several scoring requests stall the streams no longer
                work = self._sliced.pop(0)
                self._sliced.append(work)
                s0 = time.perf_counter()
                self._slice(work)
                self._round_other_s += time.perf_counter() - s0
            if self._round_tokens:  # the round's wall time per token made (the prefills and scoring left out)
                spent = time.perf_counter() - t0 - self._round_other_s
                self._decode_cost.append((max(0.0, spent), self._round_tokens))

    def _slice(self, w: "_Sliced") -> None:
        """One item of a sliced call, or its end (result, error, or the reason it was stopped)."""
        stop: BaseException | None = None
        if w.cancel.is_set():
            stop = Cancelled(f"{w.what} was cancelled (the client went away)")
        elif self._draining:
            stop = ServerShutdown("the server is shutting down")
        elif w.deadline is not None and time.perf_counter() > w.deadline:
            stop = RequestTimeout(f"{w.what} took longer than the server's request timeout of {w.timeout_s:g} s "
                                  f"(lily serve --request-timeout)")
        try:
            if stop is not None:
                w.gen.close()
                raise stop
            next(w.gen)
            return
        except StopIteration as e:
            w.fut.set_result(e.value)
        except BaseException as e:  # handed to the caller
            w.fut.set_exception(e)
        self._sliced.remove(w)

    def _take_inbox(self, block: bool) -> bool:
        """Handle what the handlers sent; False on stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                for job in list(self._active) + list(self._parked) + list(self._waiting):
                    self._end(job, Cancelled("the server is shutting down"), started=job.session is not None)
                for w in self._sliced:
                    w.fut.set_exception(ServerShutdown("the server is shutting down"))
                self._sliced.clear()
                return False
            if kind == "sliced":
                if item.fut.set_running_or_notify_cancel():
                    self._sliced.append(item)
            if kind == "call":
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            elif kind == "job":
                self._waiting.append(item)

    def _schedule(self) -> None:
        """Drop what ended while not stepped, start new requests (parking others if need be), resume parked
        ones into free slots, and rotate one parked request in every PARK_SLICE_STEPS steps."""
        now = time.perf_counter()
        for job in [j for j in self._waiting if j.cancel.is_set() or j.overdue(now) or self._draining]:
            self._waiting.remove(job)
            with self._lock:
                self.waiting -= 1
            self._end(job, self._why_stopped(job, now, "the request was cancelled before it started"), started=False)
        for job in [j for j in self._parked if j.cancel.is_set() or j.overdue(now) or self._draining]:
            self._end(job, self._why_stopped(job, now, "the client disconnected"))
        while self._waiting and (len(self._active) < self.parallel or self._park_longest_running()):
            job = self._waiting.popleft()
            with self._lock:
                self.waiting -= 1
                self.running += 1
            self._begin(job)
        while self._parked and len(self._active) < self.parallel:
            self._resume(self._parked.popleft())
        if self._parked and not self._waiting:
            victim = self._longest_running(PARK_SLICE_STEPS)
            incoming = self._parked[0]
            if victim is not None and self._fits(victim.session.nbytes - incoming.session.nbytes):
                self._resume(self._parked.popleft())
                self._park(victim)
        for i, job in enumerate(self._waiting):  # everyone behind moved up
            if job.ahead != i + 1:
                job.ahead = i + 1
                job.emit("queued", i + 1)

    def _why_stopped(self, job: Job, now: float, cancelled: str) -> BaseException:
        if self._draining:
            return ServerShutdown("the server is shutting down")
        if job.overdue(now):
            return RequestTimeout(self._timeout_message(job))
        return Cancelled(cancelled)

    # ---- parking ---------------------------------------------------------------------------------------
    def _fits(self, extra_bytes: int) -> bool:
        return self.park_bytes > 0 and self.parked_bytes + extra_bytes <= self.park_bytes

    def _longest_running(self, min_slice_steps: int = 1) -> Job | None:
        """The decoding job that started longest ago and ran at least min_slice_steps since it (re)started."""
        ready = [j for j in self._active if j.decoding and not j.finished and j.slice_steps >= min_slice_steps]
        return min(ready, key=lambda j: j.began) if ready else None

    def _park_longest_running(self) -> bool:
        victim = self._longest_running()
        if victim is None or not self._fits(victim.session.nbytes):
            return False
        self._park(victim)
        return True

    def _park(self, job: Job) -> None:
        self._active.remove(job)
        self._parked.append(job)
        nbytes = job.session.nbytes
        with self._lock:
            self.running -= 1
            self.parked += 1
            self.parked_bytes += nbytes
        job.parked_bytes = nbytes
        self.stats["parks"] += 1
        job.emit("parked")

    def _resume(self, job: Job) -> None:
        if job in self._parked:
            self._parked.remove(job)
        self._active.append(job)
        with self._lock:
            self.running += 1
            self.parked -= 1
            self.parked_bytes -= job.parked_bytes
        job.slice_steps = 0
        self.stats["resumes"] += 1
        job.emit("resumed")

    # ---- running a job -----------------------------------------------------------------------------------
    def _pick_session(self, ids: list[int]) -> Session:
        """An idle session whose live state is the longest prefix of ids; else a new one (pool not full, or
        every session busy with a running or parked request); else the least recently used idle one (its
        state goes to the prefix cache when replaced)."""
        best, best_n = None, -1
        for s in self.sessions:
            if id(s) in self._busy_sessions:
                continue
            held = s.state_tokens
            n = len(held) if len(held) <= len(ids) and ids[:len(held)] == held else 0
            if n > best_n:
                best, best_n = s, n
        if best is None or (best_n == 0 and len(self.sessions) < self.parallel):
            best = self._new_session()
        self.sessions.remove(best)
        self.sessions.append(best)  # most recently used last
        return best

    def _new_session(self) -> Session:
        s = self.model.session(prefix_cache=self.cache)
        # several slots: plain streams draw in the extension so that they are decoded together (a device backend's
        # one-stream run-ahead is given up for the batch)
        s.batch_streams = self.parallel > 1 and self._step_streams is not None
        self.sessions.insert(0, s)
        return s

    def _trim_pool(self) -> None:
        """Sessions beyond --parallel were made for requests that started while others were parked: once idle
        they go (their live state into the prefix cache first, as a session replacing it would do)."""
        while len(self.sessions) > self.parallel + self.parked:
            idle = [s for s in self.sessions if id(s) not in self._busy_sessions]
            if not idle:
                return
            s = idle[0]  # least recently used
            if self.cache is not None and s.state_tokens and not self.cache.contains(s.state_tokens):
                snap = s.snapshot()
                self.cache.insert(type(snap)(snap.state, snap.tokens, (), snap.last_logits))
            self.sessions.remove(s)
            if s in self._dirty:
                self._dirty.remove(s)

    def _begin(self, job: Job) -> None:
        now = time.perf_counter()
        self.stats["requests"] += 1
        if not self._active and not self._parked:
            self._busy_since = now
        job.began = now
        job.emit("start", now - job.enqueued)
        if self.metrics is not None:
            self.metrics.observe("queue", now - job.enqueued)
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
            job.cached_tokens = len(s.state_tokens)  # the generator reused the longest prefix held
        except Exception as e:  # e.g. the prompt does not fit: reported to the client
            self._end(job, e)

    def _progress(self, job: Job, done: int, total: int) -> None:
        """Between prefill slices of `job`: stop it if cancelled, report, and let decoding jobs step."""
        self._check_going(job)
        if self.progress_tokens > 0 and (done >= job.next_progress or done == total):
            job.emit("progress", done, total)
            while job.next_progress <= done:
                job.next_progress += self.progress_tokens
        t0 = time.perf_counter()
        others = [o for o in self._active if o is not job]
        self._step_together(others)
        for other in others:
            if other.decoding and not other.finished:
                self._step(other)
        self._nested_s += time.perf_counter() - t0

    def _check_going(self, job: Job) -> None:
        if job.cancel.is_set():
            raise Cancelled
        if self._draining:
            raise ServerShutdown("the server is shutting down")
        if job.overdue(time.perf_counter()):
            raise RequestTimeout(self._timeout_message(job))

    def _step_together(self, jobs: list[Job]) -> None:
        """The next step of every decoding job whose stream draws in the extension, in one forward
        (Engine.step_streams: each row as its stream alone computes and draws it): a plain step's row, or the
        1 + k rows of a verify drafted with an explicit `speculative: k` (`auto` stops drafting to join); each job's
        next pulls then return the tokens queued. A job whose stream cannot join (a grammar or logprobs drawn on
        the host) steps alone in _step. The stats count forwards and the rows they ran."""
        streams = [j.session.stream for j in jobs
                   if j.decoding and not j.finished and j.session is not None and j.session.stream is not None]
        if len(streams) < 2 or self._step_streams is None:
            return
        try:
            rows = self._step_streams(streams)
        except Exception as e:  # the forward failed half-way: every stream in it is in doubt
            for j in list(jobs):
                if j.session is not None and j.session.stream in streams:
                    self._end(j, e)
            return
        if rows:
            self.stats["batched_steps"] += 1
            self.stats["batched_rows"] += rows

    def _step(self, job: Job) -> None:
        """Pull one chunk from the job's stream (the first pull runs its prefill)."""
        t0, nested0, decoding = time.perf_counter(), self._nested_s, job.decoding
        try:
            self._check_going(job)
            chunk = next(job.gen)
        except StopIteration:
            self._end(job, LilyError("the generation ended without a final chunk"))
            return
        except Exception as e:
            self._end(job, e)
            return
        if not job.decoding:
            job.decoding, job.first_token_at = True, time.perf_counter()
        job.steps += 1
        job.slice_steps += 1
        self._token_times.append(time.perf_counter())
        if job.steps <= job.expected_tokens:
            with self._lock:
                self._tokens_ahead -= 1
        job.emit("chunk", chunk)
        if self._step_delay:
            time.sleep(self._step_delay)
        if decoding:
            self._round_tokens += 1
        else:  # the prefill (and its first token), without the other jobs' steps made between its slices
            took = time.perf_counter() - t0
            nested = self._nested_s - nested0
            self._prefill_cost.append(max(0.0, took - nested))
            self._round_other_s += max(0.0, took - nested)
        if chunk.finish_reason is not None:
            s = chunk.stats
            if s is not None:
                self.stats["prompt_tokens"] += s.prompt_tokens
                self.stats["cached_tokens"] += s.cached_tokens
                self.stats["generated_tokens"] += s.generated_tokens
                if self.metrics is not None:
                    self.metrics.finished(s)
            self._end(job, None)

    def _final_chunk(self, job: Job, reason: str) -> GenerationChunk:
        """The last chunk of a job the server stopped: no token (-1), no text, finish 'length', its stats."""
        now = time.perf_counter()
        first = job.first_token_at or now
        stats = GenerationStats(prompt_tokens=len(job.ids), cached_tokens=job.cached_tokens,
                                generated_tokens=job.steps, ttft_s=first - job.began if job.steps else 0.0,
                                prefill_s=first - job.began, decode_s=now - first if job.steps else 0.0,
                                total_s=now - job.began)
        ran = getattr(job.session, "last_stats", None)  # the stopped generation's own (its stream is closed)
        if ran is not None:
            stats.speculative, stats.drafted_tokens = ran.speculative, ran.drafted_tokens
            stats.accepted_tokens, stats.verify_steps = ran.accepted_tokens, ran.verify_steps
        return GenerationChunk("", -1, finish_reason=FINISH_LENGTH, stop_reason=reason, stats=stats)

    def _end(self, job: Job, error: BaseException | None, started: bool = True) -> None:
        if job.finished:
            return
        job.finished = True
        with self._lock:
            self._tokens_ahead -= max(0, job.expected_tokens - job.steps)
        was_parked = job in self._parked
        if job in self._active:
            self._active.remove(job)
        if was_parked:
            self._parked.remove(job)
        if started and job.session is not None:
            now = time.perf_counter()
            with self._lock:
                if was_parked:
                    self.parked -= 1
                    self.parked_bytes -= job.parked_bytes
                else:
                    self.running -= 1
                # the drain rate: time between finishes while the server was busy (queue time excluded)
                self._drain_gaps.append(now - max(self._last_finish, self._busy_since))
                self._last_finish = now
            if job.gen is not None:
                try:
                    job.gen.close()
                except Exception:  # closing a broken stream: the error (if any) was reported already
                    pass
            self._busy_sessions.discard(id(job.session))
            self._dirty.append(job.session)
            self._trim_pool()
            if isinstance(error, (RequestTimeout, ServerShutdown)):
                job.emit("chunk", self._final_chunk(job, STOP_TIMEOUT if isinstance(error, RequestTimeout)
                                                    else STOP_SHUTDOWN))
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
        elif isinstance(error, ServerShutdown):
            self.stats["shutdown_ended"] += 1
        else:
            self.stats["errors"] += 1
        if self.metrics is not None:
            self.metrics.failed(type(error).__name__)
        if isinstance(error, RequestTimeout) and started and job.session is not None:
            job.emit("end")  # the final chunk above is the answer: a timeout is not an error to retry
            return
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
        if self._inbox.empty():
            release_free_memory()

