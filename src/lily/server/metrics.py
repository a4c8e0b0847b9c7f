"""`GET /metrics`: Prometheus text exposition format (version 0.0.4), written by hand (no dependency).

Counters: requests by endpoint and status, prompt / cached / generated tokens, speculative decoding's drafted and
accepted tokens and verify forwards, errors by kind, prefix-cache hits and misses, parks. Histograms: time to first
token, time per output token, decode time, time queued, request duration. Gauges: running, parked and queued
requests, parked bytes and their budget, prefix-cache bytes, budget and snapshots.
"""
from __future__ import annotations

import bisect
import threading
from typing import Any

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_HISTOGRAMS = {
    "ttft": ("lily_time_to_first_token_seconds", "Request arrival at the engine to its first sampled token",
             _TIME_BUCKETS),
    "tpot": ("lily_time_per_output_token_seconds", "Decode time per generated token after the first",
             _TOKEN_TIME_BUCKETS),
    "decode": ("lily_decode_seconds", "Time from the first to the last generated token of a request", _TIME_BUCKETS),
    "queue": ("lily_queue_seconds", "Time a request waited for a running slot", _TIME_BUCKETS),
    "request": ("lily_request_duration_seconds", "Request duration in the engine (prefill and decode)",
                _TIME_BUCKETS),
}


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hist = {k: _Histogram(b) for k, (_, _, b) in _HISTOGRAMS.items()}
        self.requests: dict[tuple[str, int], int] = {}
        self.failures: dict[str, int] = {}
        self.tokens = {"prompt": 0, "cached": 0, "generated": 0, "drafted": 0, "accepted": 0, "verify_steps": 0}

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.hist[name].observe(value)

    def finished(self, stats: Any) -> None:
        """A generation's final GenerationStats (worker thread)."""
        with self._lock:
            self.tokens["prompt"] += stats.prompt_tokens
            self.tokens["cached"] += stats.cached_tokens
            self.tokens["generated"] += stats.generated_tokens
            self.tokens["drafted"] += stats.drafted_tokens
            self.tokens["accepted"] += stats.accepted_tokens
            self.tokens["verify_steps"] += stats.verify_steps
            self.hist["ttft"].observe(stats.ttft_s)
            self.hist["decode"].observe(stats.decode_s)
            self.hist["request"].observe(stats.total_s)
            if stats.generated_tokens > 1:
                self.hist["tpot"].observe(stats.decode_s / (stats.generated_tokens - 1))

    def failed(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def render(self, gauges: dict[str, tuple[str, float]], cache: Any,
               counters: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; `gauges` and `counters` kept elsewhere: {name: (help, value)}."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix_labels, v in samples:
                out.append(f"{name}{suffix_labels} {_num(v)}")

        with self._lock:
            metric("lily_requests_total", "counter", "HTTP requests answered, by endpoint and status code",
                   [(f'{{endpoint="{_label(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("lily_request_failures_total", "counter", "Generations that ended with an error, by kind",
                   [(f'{{kind="{_label(k)}"}}', n) for k, n in sorted(self.failures.items())])
            metric("lily_prompt_tokens_total", "counter", "Prompt tokens of finished generations",
                   [("", self.tokens["prompt"])])
            metric("lily_cached_prompt_tokens_total", "counter", "Prompt tokens reused from a held state",
                   [("", self.tokens["cached"])])
            metric("lily_generation_tokens_total", "counter", "Generated tokens of finished generations",
                   [("", self.tokens["generated"])])
            metric("lily_speculative_drafted_tokens_total", "counter",
                   "Tokens the MTP head drafted (speculative decoding) in finished generations",
                   [("", self.tokens["drafted"])])
            metric("lily_speculative_accepted_tokens_total", "counter",
                   "Drafted tokens the verify forward accepted (each one a token gained over plain decoding)",
                   [("", self.tokens["accepted"])])
            metric("lily_speculative_verify_steps_total", "counter",
                   "Verify forwards of speculative decoding (each checks one step's drafts)",
                   [("", self.tokens["verify_steps"])])
            for key, (name, help_, _) in _HISTOGRAMS.items():
                h = self.hist[key]
                samples, acc = [], 0
                for b, c in zip(h.buckets, h.counts):
                    acc += c
                    samples.append((f'_bucket{{le="{_num(b)}"}}', acc))
                samples += [('_bucket{le="+Inf"}', h.n), ("_sum", h.sum), ("_count", h.n)]
                metric(name, "histogram", help_, samples)
        metric("lily_prefix_cache_hits_total", "counter", "Prefix-cache lookups that found a stored prefix",
               [("", cache.hits)])
        metric("lily_prefix_cache_misses_total", "counter", "Prefix-cache lookups that found none",
               [("", cache.misses)])
        for name, (help_, v) in (counters or {}).items():
            metric(name, "counter", help_, [("", v)])
        for name, (help_, v) in gauges.items():
            metric(name, "gauge", help_, [("", v)])
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


