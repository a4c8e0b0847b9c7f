"""`POST /v1/responses` (the OpenAI Responses API, as the Vercel AI SDK and `client.responses.create` use it):
text and message input, `instructions`, function tools, reasoning, `text.format` json_schema, streaming
events, and `previous_response_id`, which continues a stored conversation (the engine then reuses the
session state of the earlier turns through the prefix cache). `GET /v1/responses/{id}` returns a stored one.

A request becomes a chat request (same preparation, grammar, parsers and worker as /v1/chat/completions);
the chat deltas become Responses output items: `reasoning`, `message` (output_text) and `function_call`.
"""
from __future__ import annotations

import collections
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from ..sampling import RULE_OPTIONS
from .errors import as_api_error
from .middleware import SSEResponse
from .output import ChatOutput
from .protocol import APIError, ChatCompletionRequest, bad_request, new_id, now
from .streams import SERVER_STOPS, collect, comment, events
from .worker import Cancelled

MAX_STORED = 256  # responses kept for previous_response_id (least recently used dropped)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    reasoning: Optional[dict[str, Any]] = None
    text: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None


class ResponseStore:
    """id -> (chat messages of the whole conversation after that response, the response body): the last `size` in
    memory and, with a directory (`lily serve --session-dir`), every one also as DIR/responses/<id>.json, so
    `previous_response_id` works across restarts; the files are kept within `disk_items` and `disk_bytes` (the
    oldest removed first)."""

    def __init__(self, size: int = MAX_STORED, directory: str | os.PathLike | None = None,
                 disk_items: int = 4096, disk_bytes: int = 256 << 20):
        self._items: collections.OrderedDict[str, tuple[list, dict]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.size = size
        self.dir = Path(directory) / "responses" if directory else None
        self.disk_items, self.disk_bytes = disk_items, disk_bytes
        self._files: collections.OrderedDict[str, int] | None = None  # id -> bytes, oldest first (read once)

    def put(self, rid: str, messages: list, body: dict) -> None:
        with self._lock:
            self._items[rid] = (messages, body)
            self._items.move_to_end(rid)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            if self.dir is not None:
                self._write(rid, messages, body)

    def _write(self, rid: str, messages: list, body: dict) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self._files is None:  # the files an earlier server left, oldest first (scanned once)
                found = sorted(self.dir.glob("*.json"), key=lambda f: f.stat().st_mtime)
                self._files = collections.OrderedDict((f.stem, f.stat().st_size) for f in found)
            data = json.dumps({"messages": messages, "body": body}, ensure_ascii=False).encode()
            tmp = self.dir / f".{rid}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.dir / f"{rid}.json")
            self._files[rid] = len(data)
            self._files.move_to_end(rid)
            total = sum(self._files.values())
            while len(self._files) > 1 and (len(self._files) > self.disk_items or total > self.disk_bytes):
                old, size = self._files.popitem(last=False)
                total -= size
                (self.dir / f"{old}.json").unlink(missing_ok=True)
        except OSError as e:  # the reply went out; only its continuation after a restart is lost
            print(f"[lily serve] could not store response {rid} in {self.dir}: {e}", flush=True)

    def get(self, rid: str) -> tuple[list, dict]:
        with self._lock:
            if rid not in self._items and self.dir is not None and _SAFE_ID.match(rid):
                f = self.dir / f"{rid}.json"
                try:
                    data = json.loads(f.read_text())
                    self._items[rid] = (data["messages"], data["body"])
                except (OSError, ValueError, KeyError):
                    pass
            if rid not in self._items:
                kept = f"the last {self.size} responses made with store=true" + (
                    f", and those in {self.dir}" if self.dir is not None else " (lily serve --session-dir keeps "
                    f"them across restarts)")
                raise APIError(404, f"No response with id {rid!r} is stored on this server (it keeps {kept})",
                               param="previous_response_id", code="response_not_found")
            self._items.move_to_end(rid)
            return self._items[rid]


_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # an id names a file only when it could be one of ours


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                    and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad_request(f"{where} has a part of type {kind!r}: lily serves a text-only model, expected "
                                  f"input_text parts", param=where)
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of input_text parts", param=where)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses `input` -> chat messages (function_call items join the assistant turn before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role={role!r} is invalid: expected user, system, developer or assistant",
                                  param=f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise bad_request(f"{where} (function_call) needs call_id and name", param=where)
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning: the template drops it before the last user turn anyway
        else:
            raise bad_request(f"{where}.type={kind!r} is not supported: expected message, function_call, "
                              f"function_call_output or reasoning", param=f"{where}.type")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses tools ({type, name, parameters}) -> chat tools ({type, function: {...}})."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"tools.{i}.type={t.get('type')!r} is not supported: lily runs function tools only",
                              param=f"tools.{i}.type")
        fn = t.get("function") or {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


# lily's options a Responses request may carry beside the API's own fields, passed on to the chat request
_CHAT_EXTRAS = frozenset(RULE_OPTIONS) - {"temperature", "top_p"} | {"logit_bias", "chat_template_kwargs"}


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise bad_request(f"text.format.type={kind!r} is invalid: expected text, json_object or json_schema",
                          param="text.format")
    response_format = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        response_format = {"type": fmt["type"]}
    effort = (req.reasoning or {}).get("effort")
    chat = ChatCompletionRequest(model=req.model, messages=messages, tools=chat_tools(req.tools), tool_choice=choice,
                                 parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, response_format=response_format,
                                 reasoning_effort=effort, **{k: v for k, v in (req.model_extra or {}).items()
                                                             if k in _CHAT_EXTRAS})
    return chat, conversation


class _Items:
    """Chat deltas -> Responses output items, and the stream events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}

    def _close(self) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        o, self.open = self.open, None
        if o is None:
            return ev
        n = self.items.index(o)
        if o["type"] == "message":
            part = o["content"][0]
            ev.append(("response.output_text.done", {"item_id": o["id"], "output_index": n, "content_index": 0,
                                                      "text": part["text"], "logprobs": []}))
            ev.append(("response.content_part.done", {"item_id": o["id"], "output_index": n, "content_index": 0,
                                                       "part": part}))
        elif o["type"] == "reasoning":
            ev.append(("response.reasoning_text.done", {"item_id": o["id"], "output_index": n, "content_index": 0,
                                                         "text": o["content"][0]["text"]}))
        else:
            ev.append(("response.function_call_arguments.done", {"item_id": o["id"], "output_index": n,
                                                                  "arguments": o["arguments"]}))
        o["status"] = "completed" if o["type"] != "reasoning" else None
        if o["status"] is None:
            del o["status"]
        ev.append(("response.output_item.done", {"output_index": n, "item": o}))
        return ev

    def _begin(self, item: dict[str, Any]) -> list[tuple[str, dict]]:
        ev = self._close()
        self.items.append(item)
        self.open = item
        n = len(self.items) - 1
        shown = {**item, "content": []} if "content" in item else dict(item)
        ev.append(("response.output_item.added", {"output_index": n, "item": shown}))
        if item["type"] == "message":
            ev.append(("response.content_part.added", {"item_id": item["id"], "output_index": n, "content_index": 0,
                                                        "part": {"type": "output_text", "text": "", "annotations": []}}))
        return ev

    def push(self, delta: dict[str, Any]) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        text = delta.get("reasoning_content", delta.get("reasoning"))
        if text:
            if self.open is None or self.open["type"] != "reasoning":
                ev += self._begin({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}]})
            self.open["content"][0]["text"] += text
            ev.append(("response.reasoning_text.delta", {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                                          "content_index": 0, "delta": text}))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                ev += self._begin({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                   "role": "assistant",
                                   "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.open["content"][0]["text"] += delta["content"]
            ev.append(("response.output_text.delta", {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                                       "content_index": 0, "delta": delta["content"], "logprobs": []}))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc.get("id"):
                item = {"type": "function_call", "id": new_id("fc"), "call_id": tc["id"], "name": fn.get("name"),
                        "arguments": "", "status": "in_progress"}
                self.calls[tc["index"]] = item
                ev += self._begin(item)
            item = self.calls[tc["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                ev.append(("response.function_call_arguments.delta", {"item_id": item["id"],
                                                                       "output_index": self.items.index(item),
                                                                       "delta": fn["arguments"]}))
        return ev

    def finish(self, truncated: bool) -> list[tuple[str, dict]]:
        ev = self._close()
        if truncated and self.items and "status" in self.items[-1]:
            self.items[-1]["status"] = "incomplete"  # cut off by max_output_tokens
        return ev


def incomplete_reason(stop_reason: Any) -> str:
    """incomplete_details.reason of a reply cut off: the server's own stop (request_timeout, server_shutdown), else
    the token limit."""
    return stop_reason if stop_reason in SERVER_STOPS else "max_output_tokens"


def add_responses_routes(app: FastAPI, srv: Any, parse: Callable) -> None:
    store = ResponseStore(directory=srv.config.session_dir)
    config = srv.config

    def body_of(rid: str, created: int, req: ResponsesRequest, status: str, items: list, out: ChatOutput | None,
                truncated: bool, stop_reason: str | None = None) -> dict[str, Any]:
        s = out.stats if out is not None else None
        usage = None
        if s is not None:
            usage = {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                     "output_tokens": s.generated_tokens,
                     "output_tokens_details": {
                         "reasoning_tokens": out.reasoning_tokens, "accepted_prediction_tokens": s.accepted_tokens,
                         "rejected_prediction_tokens": s.drafted_tokens - s.accepted_tokens},
                     "total_tokens": s.prompt_tokens + s.generated_tokens}
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": req.model or srv.name,
                "output": items, "usage": usage, "error": None,
                # why it stopped early: the token limit, or the server (request_timeout, server_shutdown)
                "incomplete_details": {"reason": incomplete_reason(stop_reason)} if truncated else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "parallel_tool_calls": req.parallel_tool_calls
                is not False, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
                "reasoning": req.reasoning, "truncation": "disabled", "store": req.store is not False,
                "metadata": req.metadata or {}}

    def keep(rid: str, req: ResponsesRequest, conversation: list, items: list, body: dict) -> None:
        if req.store is False:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in items:
            if item["type"] == "message":
                reply["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                reply["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "function_call":
                reply.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        store.put(rid, conversation + [reply], body)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        return store.get(rid)[1]

    @app.post("/v1/responses", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": ResponsesRequest.model_json_schema()}}}})
    async def responses(request: Request):
        req: ResponsesRequest = await parse(ResponsesRequest, request)
        history = store.get(req.previous_response_id)[0] if req.previous_response_id else []
        chat, conversation = await run_in_threadpool(to_chat_request, req, history)
        prep = await run_in_threadpool(srv.prepare_chat, chat)
        job, ahead = srv.submit(prep)
        out = ChatOutput(srv.model.tokenizer, in_reasoning=prep.in_reasoning, tools=prep.tools,
                         parse_tools=prep.parse_tools, logprobs=False, reasoning_field="reasoning_content")
        rid, created, items = new_id("resp"), now(), _Items()
        ids: list[int] = []
        if not req.stream:
            def on_chunk(c):
                if c.token_id >= 0:
                    ids.append(c.token_id)
                for d in out.push(c)[0]:
                    items.push(d)

            last, _ = await collect(srv, request, job, on_chunk)
            srv.remember_reply(ids, last.stop_reason)
            truncated = out.finish_reason == "length"
            items.finish(truncated)
            body = body_of(rid, created, req, "incomplete" if truncated else "completed", items.items, out, truncated,
                           last.stop_reason)
            keep(rid, req, conversation, items.items, body)
            return JSONResponse(body)

        async def stream() -> AsyncIterator[str]:
            seq = [0]

            def event(kind: str, data: dict) -> str:
                seq[0] += 1
                return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **data}, ensure_ascii=False)}\n\n"

            if ahead:
                yield f": queued, {ahead} request(s) ahead\n\n"
            yield event("response.created", {"response": body_of(rid, created, req, "in_progress", [], None, False)})
            yield event("response.in_progress", {"response": body_of(rid, created, req, "in_progress", [], None, False)})
            async for ev in events(job, config.keepalive_s):
                if ev[0] == "chunk":
                    c = ev[1]
                    if c.token_id >= 0:
                        ids.append(c.token_id)
                    for d in out.push(c)[0]:
                        for kind, data in items.push(d):
                            yield event(kind, data)
                    if c.finish_reason is not None:
                        srv.remember_reply(ids, c.stop_reason)
                        truncated = out.finish_reason == "length"
                        for kind, data in items.finish(truncated):
                            yield event(kind, data)
                        status = "incomplete" if truncated else "completed"
                        body = body_of(rid, created, req, status, items.items, out, truncated, c.stop_reason)
                        keep(rid, req, conversation, items.items, body)
                        yield event(f"response.{status}", {"response": body})
                elif ev[0] == "error":
                    if isinstance(ev[1], Cancelled):
                        return
                    err = as_api_error(ev[1])
                    yield event("error", {"code": err.code or err.type, "message": err.message, "param": err.param})
                elif (text := comment(ev)) is not None:
                    yield text

        return SSEResponse(stream(), job.request_cancel)
