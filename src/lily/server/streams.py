"""Turning a running `Job`'s events into HTTP answers: SSE streams and whole JSON bodies for chat completions
and text completions (`/v1/responses` has its own, server/responses.py; Ollama's API server/ollama.py).

A job the server stopped early (its --request-timeout passed, or the server is shutting down) ends with a
final chunk of no token: its choice gets finish_reason "length" and `stop_reason` "request_timeout" or
"server_shutdown" (vLLM's field), so the answer holds what was generated; a shutdown then adds an error event
(a stream) or answers 503 (not streamed)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import as_api_error
from .middleware import sse
from .output import ChatOutput
from .prepared import PreparedCompletion
from .protocol import completion_logprobs, timings, usage
from .service import LilyServer
from .worker import STOP_SHUTDOWN, STOP_TIMEOUT, Cancelled, Job

SERVER_STOPS = (STOP_TIMEOUT, STOP_SHUTDOWN)


def stopped_by_server(chunk: Any) -> dict[str, Any]:
    """{"stop_reason": ...} for the final chunk of a job the server stopped, else {}."""
    return {"stop_reason": chunk.stop_reason} if chunk.token_id < 0 and chunk.stop_reason in SERVER_STOPS else {}


async def watch_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.request_cancel()
            return


async def events(job: Job, keepalive_s: float) -> AsyncIterator[tuple]:
    """The job's events; ("idle",) when nothing came for keepalive_s."""
    while True:
        try:
            ev = await asyncio.wait_for(job.events.get(), timeout=keepalive_s)
        except asyncio.TimeoutError:
            yield ("idle",)
            continue
        yield ev
        if ev[0] in ("end", "error"):
            return


# ---- chat ---------------------------------------------------------------------------------------------------
def comment(ev: tuple) -> str | None:
    """SSE comments (OpenAI clients ignore them): queue position, prefill progress, keep-alive."""
    if ev[0] == "queued":
        return f": queued, {ev[1]} request(s) ahead\n\n"
    if ev[0] == "progress":
        return f": prefill {ev[1]}/{ev[2]} tokens\n\n"
    if ev[0] == "idle":
        return ": keep-alive\n\n"
    if ev[0] == "parked":
        return ": paused for a newer request, resumes in turn\n\n"
    if ev[0] == "resumed":
        return ": resumed\n\n"
    return None


async def chat_stream(srv: LilyServer, job: Job, ahead: int, out: ChatOutput, rid: str, created: int, name: str,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
            "system_fingerprint": srv.fingerprint}

    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None, stop: dict | None = None,
              **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **(stop or {})}
        return sse({**base, "choices": [choice], **extra})

    if ahead:
        yield f": queued, {ahead} request(s) ahead\n\n"
    yield chunk({"role": "assistant", "content": ""})
    ids: list[int] = []
    queue_s = 0.0
    async for ev in events(job, srv.config.keepalive_s):
        if ev[0] == "start":
            queue_s = ev[1]
        elif ev[0] == "chunk":
            c = ev[1]
            if c.token_id >= 0:
                ids.append(c.token_id)
            deltas, items = out.push(c)
            lp = {"content": items} if items else None
            for k, d in enumerate(deltas):
                yield chunk(d, logprobs=lp if k == len(deltas) - 1 else None)
            if not deltas and lp:
                yield chunk({}, logprobs=lp)
            if c.finish_reason is not None:
                srv.remember_reply(ids, c.stop_reason)
                extra = {"timings": timings(c.stats, queue_s)}
                yield chunk({}, out.finish_reason, stop=stopped_by_server(c), **extra)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(c.stats, out.reasoning_tokens), **extra})
        elif ev[0] == "error":
            err = as_api_error(ev[1])
            if isinstance(ev[1], Cancelled):
                return
            yield sse(err.body())
        elif (text := comment(ev)) is not None:
            yield text
    yield "data: [DONE]\n\n"


async def collect(srv: LilyServer, request: Request, job: Job, on_chunk: Callable[[Any], None]) -> tuple[Any, float]:
    """Run a job to its end for a non-streaming response; a client that goes away cancels it."""
    watcher = asyncio.create_task(watch_disconnect(request, job))
    last, queue_s = None, 0.0
    try:
        async for ev in events(job, 3600.0):
            if ev[0] == "start":
                queue_s = ev[1]
            elif ev[0] == "chunk":
                on_chunk(ev[1])
                last = ev[1]
            elif ev[0] == "error":
                raise as_api_error(ev[1])
    finally:
        watcher.cancel()
        job.request_cancel()
    return last, queue_s


async def chat_whole(srv: LilyServer, request: Request, job: Job, out: ChatOutput, rid: str, created: int,
                      name: str) -> JSONResponse:
    ids: list[int] = []

    def on_chunk(c):
        if c.token_id >= 0:
            ids.append(c.token_id)
        out.push(c)

    last, queue_s = await collect(srv, request, job, on_chunk)
    srv.remember_reply(ids, last.stop_reason)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": name,
            "system_fingerprint": srv.fingerprint,
            "choices": [{"index": 0, "message": out.message(),
                         "logprobs": {"content": out.logprobs} if out.want_logprobs else None,
                         "finish_reason": out.finish_reason, **stopped_by_server(last)}],
            "usage": usage(last.stats, out.reasoning_tokens), "timings": timings(last.stats, queue_s)}
    return JSONResponse(body)


# ---- completions --------------------------------------------------------------------------------------------
async def completion_stream(srv: LilyServer, prep: PreparedCompletion, job: Job, ahead: int, rid: str, created: int,
                             name: str, echo: str, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}
    want_lp = job.sampling.logprobs
    if ahead:
        yield f": queued, {ahead} request(s) ahead\n\n"
    prompt_items = prep.prompt_logprobs
    offset = len(echo)
    if echo:
        lp = completion_logprobs(srv.model.tokenizer, prompt_items, 0) if prompt_items else None
        if lp:
            offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        yield sse({**base, "choices": [{"index": 0, "text": echo, "logprobs": lp, "finish_reason": None}]})
    queue_s = 0.0
    ids: list[int] = []
    async for ev in events(job, srv.config.keepalive_s):
        if ev[0] == "start":
            queue_s = ev[1]
        elif ev[0] == "chunk":
            c = ev[1]
            if c.token_id >= 0:
                ids.append(c.token_id)
            if c.finish_reason:
                srv.remember_completion(prep, ids, c.stop_reason)
            lp = completion_logprobs(srv.model.tokenizer, [(c.token_id, c.logprob, c.top_logprobs)], offset) \
                if want_lp and c.logprob is not None else None
            offset += len(c.text)
            extra = {"timings": timings(c.stats, queue_s)} if c.finish_reason else {}
            if c.text or lp or c.finish_reason:
                yield sse({**base, "choices": [{"index": 0, "text": c.text, "logprobs": lp,
                                                "finish_reason": c.finish_reason, **stopped_by_server(c)}],
                           **extra})
            if c.finish_reason and include_usage:
                yield sse({**base, "choices": [], "usage": usage(c.stats), **extra})
        elif ev[0] == "error":
            if isinstance(ev[1], Cancelled):
                return
            yield sse(as_api_error(ev[1]).body())
        elif (text := comment(ev)) is not None:
            yield text
    yield "data: [DONE]\n\n"


async def completion_whole(srv: LilyServer, prep: PreparedCompletion, request: Request, job: Job, rid: str,
                            created: int, name: str, echo: str) -> JSONResponse:
    texts: list[str] = []
    items: list[tuple] = []
    ids: list[int] = []

    def on_chunk(c):
        texts.append(c.text)
        if c.token_id >= 0:
            ids.append(c.token_id)
        if c.logprob is not None:
            items.append((c.token_id, c.logprob, c.top_logprobs))

    last, queue_s = await collect(srv, request, job, on_chunk)
    srv.remember_completion(prep, ids, last.stop_reason)
    prompt_items = prep.prompt_logprobs or []
    lp = completion_logprobs(srv.model.tokenizer, prompt_items + items, 0 if prompt_items else len(echo)) \
        if job.sampling.logprobs else None
    body = {"id": rid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"index": 0, "text": echo + "".join(texts), "logprobs": lp,
                         "finish_reason": last.finish_reason, **stopped_by_server(last)}],
            "usage": usage(last.stats), "timings": timings(last.stats, queue_s)}
    return JSONResponse(body)
