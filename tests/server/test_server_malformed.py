"""Malformed request bodies of 25 kinds, each sent through one keep-alive connection: every one a 400 in the OpenAI
error shape naming what is wrong (never a 500, which the SDKs would retry), the connection kept, and the server
still answering afterwards. Unknown top-level fields are refused by name with the nearest known one."""
from __future__ import annotations

import http.client
import json

from _live import NO_THINK

MSG = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat(**kw) -> bytes:
    return json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 2, **kw}).encode()


# (name, path, body): the five of issue 44 first
BAD = [
    ("nested 100,000 levels in an unknown field", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100000 + b"]" * 100000
     + b"}"),
    ("a tool schema nested 2,000 levels", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b"}}]}"),
    ("a content part whose text is a number", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])),
    ("assistant tool_calls as a string", "/v1/chat/completions",
     _chat(messages=[*MSG, {"role": "assistant", "tool_calls": "f()"}, *MSG])),
    ("json_schema as a string", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": "{}"})),
    ("unknown field (a typo of max_tokens)", "/v1/chat/completions",
     json.dumps({"model": "tiny", "messages": MSG, "max_token": 2}).encode()),
    ("content a number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 7}])),
    ("content part not an object", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": ["hi"]}])),
    ("content part without a type", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"text": "hi"}]}])),
    ("message not an object", "/v1/chat/completions", _chat(messages=["hello"])),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hello")),
    ("role a number", "/v1/chat/completions", _chat(messages=[{"role": 1, "content": "hi"}])),
    ("unknown role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}])),
    ("tool_calls entries not objects", "/v1/chat/completions",
     _chat(messages=[*MSG, {"role": "assistant", "tool_calls": ["f"]}, *MSG])),
    ("tool call without a function", "/v1/chat/completions",
     _chat(messages=[*MSG, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}, *MSG])),
    ("tool call arguments a number", "/v1/chat/completions",
     _chat(messages=[*MSG, {"role": "assistant", "tool_calls": [
         {"id": "1", "type": "function", "function": {"name": "f", "arguments": 3}}]}, *MSG])),
    ("tools not a list", "/v1/chat/completions", _chat(tools={"f": 1})),
    ("tool function a string", "/v1/chat/completions", _chat(tools=[{"type": "function", "function": "f"}])),
    ("tool parameters a string", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}])),
    ("response_format a string", "/v1/chat/completions", _chat(response_format="json")),
    ("response_format of an unknown type", "/v1/chat/completions", _chat(response_format={"type": "xml"})),
    ("tool_choice naming no tool", "/v1/chat/completions", _chat(tools=[TOOL], tool_choice={"type": "function"})),
    ("stop a number", "/v1/chat/completions", _chat(stop=5)),
    ("unknown field on completions", "/v1/completions",
     json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "temprature": 0.5}).encode()),
    ("Responses text.format of an unknown type", "/v1/responses",
     json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "xml"}}}).encode()),
]


def _post(conn, path: str, body: bytes, key: str):
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, raw


def test_malformed_bodies_get_400_and_keep_the_connection(server):
    assert len(BAD) == 25
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    ok = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 2, **NO_THINK}).encode()
    assert _post(conn, "/v1/chat/completions", ok, server.api_key)[0] == 200
    sock = conn.sock
    wrong = []
    dropped = False
    for name, path, body in BAD * 4:  # 100 bodies
        try:
            status, headers, raw = _post(conn, path, body, server.api_key)
        except (ConnectionError, http.client.HTTPException) as e:
            wrong.append((name, "connection dropped", repr(e)))
            conn.close()
            conn, dropped = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60), True
            continue
        try:
            err = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if status != 400 or not err or not err.get("message") or set(err) < {"message", "type", "param", "code"} \
                or headers.get("connection", "").lower() == "close":
            wrong.append((name, status, raw[:200]))
    assert not wrong, "\n".join(sorted({f"{n} -> {st}: {str(r)[:120]}" for n, st, r in wrong}))
    assert _post(conn, "/v1/chat/completions", ok, server.api_key)[0] == 200
    assert conn.sock is sock and not dropped, "the keep-alive connection was closed and reopened"
    conn.close()


def test_unknown_field_is_named_with_the_nearest_known_one(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    status, _, raw = _post(conn, "/v1/chat/completions",
                           json.dumps({"model": "tiny", "messages": MSG, "max_token": 2}).encode(), server.api_key)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "max_token" and "max_tokens" in err["message"], err
    assert "Unrecognized request argument" in err["message"], err
    # the extension fields other servers accept stay accepted
    ext = dict(top_k=5, min_p=0.05, repetition_penalty=1.1, chat_template_kwargs={"enable_thinking": False},
               seed=3, user="u", metadata={"a": "b"}, store=False, stream_options=None)
    status, _, raw = _post(conn, "/v1/chat/completions",
                           json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 2, **ext}).encode(),
                           server.api_key)
    assert status == 200, raw[:300]
    conn.close()
