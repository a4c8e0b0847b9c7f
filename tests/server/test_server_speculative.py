"""Speculative decoding through `lily serve` (issue 39 part 6), over a tiny model whose MTP head drafts what its trunk
says (lily.testing.drafting_weights, written as a checkpoint with its head): on by default (auto); a request's
`speculative` (OpenAI body, Ollama `options`) true / false / K, validated with 400s; greedy output token for token the
same as plain decoding; drafted and accepted tokens in `usage.completion_tokens_details` (OpenAI's predicted-output
fields, which the official client types), `timings` and Ollama's final line; /metrics counters; /health; a server
whose default is off; and, on a model without a head, a 400 naming `lily serve --mtp SOURCE`."""
from __future__ import annotations

import re

import pytest
from _http import httpx
from _live import NO_THINK, LiveServer
from lily.speculative import default_drafts

USER = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
ADAPTIVE_OFF = {"LILY_SPECULATIVE_ADAPTIVE": "0"}  # keep drafting: the tiny model's verify rarely pays by the clock


@pytest.fixture(scope="module")
def drafting_ckpt(tmp_path_factory):
    pytest.importorskip("lily._lily")
    from test_cli_speculative import write_drafting_checkpoint  # (tests/ is on sys.path: tests/conftest.py)
    return write_drafting_checkpoint(tmp_path_factory.mktemp("drafting_ckpt"))


@pytest.fixture(scope="module")
def spec_server(drafting_ckpt, tmp_path_factory):
    srv = LiveServer(drafting_ckpt, tmp_path_factory.mktemp("spec") / "serve.log", env=ADAPTIVE_OFF)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return spec_server.client()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers(), timeout=60.0)


def _metrics(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers=srv.headers(), timeout=10.0).text
    return {k: float(v) for k, v in re.findall(r"^(lily_speculative_\w+_total) (\S+)$", text, re.M)}


def test_health_says_the_model_drafts(spec_server):
    s = spec_server.health()["speculative"]
    assert s["drafts"] is True and s["default"] == "auto"
    assert s["summary"].startswith("auto") and "MTP head from the checkpoint" in s["summary"]
    assert "speculative decoding: auto" in spec_server.log()


def test_greedy_chat_is_the_same_with_and_without_drafting(spec_client):
    kw = dict(model="tiny", messages=USER, max_tokens=48, temperature=0)
    plain = spec_client.chat.completions.create(**kw, extra_body={**NO_THINK, "speculative": False})
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    assert "draft_n" not in plain.model_extra["timings"]
    for spec in (True, 1, 4, None):  # None: the server's default (auto)
        r = spec_client.chat.completions.create(**kw, extra_body={**NO_THINK, "speculative": spec})
        assert r.choices[0].message.content == plain.choices[0].message.content, spec
        assert r.usage.completion_tokens == plain.usage.completion_tokens
        d = r.usage.completion_tokens_details  # typed by the official client (predicted-output fields)
        assert d.accepted_prediction_tokens > 0 and d.rejected_prediction_tokens >= 0, spec
        t = r.model_extra["timings"]
        assert t["draft_n"] == d.accepted_prediction_tokens + d.rejected_prediction_tokens
        assert t["draft_n_accepted"] == d.accepted_prediction_tokens and t["verify_n"] > 0
        k = default_drafts("cpu") if spec is True or spec is None else spec
        assert t["speculative"] == f"speculative k={k}"


def test_token_for_token_through_ollama_options(spec_server):
    """/api/generate returns the token ids (`context`): greedy drafting gives plain decoding's, id for id."""
    def run(options):
        body = {"model": "tiny", "prompt": "Once upon a time", "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": 40, **options}}
        r = _post(spec_server, "/api/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    plain = run({"speculative": False})
    assert "draft_count" not in plain and plain["eval_count"] == 40
    for spec in (True, 2, 8):
        r = run({"speculative": spec})
        assert r["context"] == plain["context"] and r["response"] == plain["response"]
        assert r["draft_count"] >= r["draft_accepted_count"] > 0
    chat = _post(spec_server, "/api/chat", {"model": "tiny", "messages": USER, "stream": False, "think": False,
                                            "options": {"temperature": 0, "num_predict": 24, "speculative": 3}})
    assert chat.status_code == 200 and chat.json()["draft_accepted_count"] > 0


def test_streams_completions_and_responses_carry_the_counts(spec_client):
    chunks = list(spec_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={**NO_THINK, "speculative": 2}))
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    c = spec_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                       extra_body={"speculative": True})
    assert c.usage.completion_tokens_details.accepted_prediction_tokens > 0
    plain = spec_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                           extra_body={"speculative": False})
    assert c.choices[0].text == plain.choices[0].text
    r = spec_client.responses.create(model="tiny", input="Hello", max_output_tokens=24, temperature=0,
                                     extra_body={"speculative": True})
    assert r.usage.output_tokens_details.model_extra["accepted_prediction_tokens"] > 0


def test_metrics_count_drafts(spec_server, spec_client):
    before = _metrics(spec_server)
    assert set(before) == {"lily_speculative_drafted_tokens_total", "lily_speculative_accepted_tokens_total",
                           "lily_speculative_verify_steps_total"}
    r = spec_client.chat.completions.create(model="tiny", messages=USER, max_tokens=32, temperature=0,
                                            extra_body={**NO_THINK, "speculative": True})
    after = _metrics(spec_server)
    d = r.usage.completion_tokens_details
    assert after["lily_speculative_accepted_tokens_total"] - before["lily_speculative_accepted_tokens_total"] == \
        d.accepted_prediction_tokens > 0
    assert after["lily_speculative_drafted_tokens_total"] - before["lily_speculative_drafted_tokens_total"] == \
        d.accepted_prediction_tokens + d.rejected_prediction_tokens
    assert after["lily_speculative_verify_steps_total"] > before["lily_speculative_verify_steps_total"]
    h = spec_server.health()["speculative"]
    assert h["accepted_tokens"] == after["lily_speculative_accepted_tokens_total"] and 0 < h["acceptance"] <= 1


@pytest.mark.parametrize("bad", [9, 0, -1, 2.5, "x", [1], {"k": 2}])
def test_bad_values_are_400s(spec_server, bad):
    base = {"model": "tiny", "max_tokens": 4}
    bodies = {"/v1/chat/completions": {**base, "messages": USER}, "/v1/completions": {**base, "prompt": "a"},
              "/v1/responses": {"model": "tiny", "input": "a"}}
    for path, body in bodies.items():
        r = _post(spec_server, path, {**body, "speculative": bad})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "speculative" and "is invalid: expected true" in err["message"]
        assert "1..8" in err["message"]
    r = _post(spec_server, "/api/chat", {"model": "tiny", "messages": USER, "stream": False,
                                         "options": {"speculative": bad}})
    assert r.status_code == 400 and r.json()["error"].startswith("options.speculative=")


def test_a_server_whose_default_is_off(drafting_ckpt, tmp_path):
    srv = LiveServer(drafting_ckpt, tmp_path / "serve.log", "--speculative", "off", env=ADAPTIVE_OFF)
    try:
        s = srv.health()["speculative"]
        assert s["drafts"] is True and s["default"] == "off"
        client = srv.client()
        kw = dict(model="tiny", messages=USER, max_tokens=24, temperature=0)
        r = client.chat.completions.create(**kw, extra_body=NO_THINK)
        assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0
        r2 = client.chat.completions.create(**kw, extra_body={**NO_THINK, "speculative": True})
        assert r2.usage.completion_tokens_details.accepted_prediction_tokens > 0
        assert r2.choices[0].message.content == r.choices[0].message.content
    finally:
        srv.stop()


def test_without_a_head_drafting_is_a_400_naming_mtp(server, client):
    """The shared server's tiny checkpoint has no MTP head."""
    assert server.health()["speculative"]["drafts"] is False
    for spec in (True, 3):
        r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4,
                                                   "speculative": spec})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "speculative_unavailable" and err["param"] == "speculative"
        assert "no MTP head" in err["message"] and "lily serve --mtp SOURCE" in err["message"]
    o = _post(server, "/api/generate", {"model": "tiny", "prompt": "a", "stream": False,
                                        "options": {"speculative": True}})
    assert o.status_code == 400 and "lily serve --mtp SOURCE" in o.json()["error"]
    for spec in (False, None):  # plain decoding, as without the field
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                           extra_body={**NO_THINK, "speculative": spec})
        assert r.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_a_stopped_request_reports_its_drafts(drafting_ckpt, tmp_path):
    """A request the server stops (here its timeout) answers with what it generated, drafts counted too."""
    srv = LiveServer(drafting_ckpt, tmp_path / "serve.log", "--request-timeout", "1",
                     env={**ADAPTIVE_OFF, "LILY_TEST_STEP_DELAY": "0.02"})
    try:
        r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 3000,
                                                "temperature": 0, "speculative": 2, **NO_THINK})
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert body["choices"][0]["stop_reason"] == "request_timeout"
        d = body["usage"]["completion_tokens_details"]
        assert d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"] > 0, body["usage"]
    finally:
        srv.stop()


@pytest.mark.parametrize("spec", [None, False, 3])  # --speculative auto (the request leaves it out), off, 3
def test_sixteen_concurrent_seeded_requests_give_one_text(drafting_ckpt, tmp_path, spec):
    """One seed, one text (issue 44): 16 identical sampled requests with `seed` at once, on a server whose adaptive
    rule is live (the default), give one text whether or not each drafts; and it is plain decoding's text."""
    from concurrent.futures import ThreadPoolExecutor
    srv = LiveServer(drafting_ckpt, tmp_path / "serve.log")
    try:
        body = {"model": "tiny", "messages": USER, "max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 7,
                **NO_THINK, **({} if spec is None else {"speculative": spec})}
        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda _: _post(srv, "/v1/chat/completions", body), range(16)))
        texts = {r.json()["choices"][0]["message"]["content"] for r in replies if r.status_code == 200}
        assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies if r.status_code != 200]
        assert len(texts) == 1, texts
        plain = _post(srv, "/v1/chat/completions", {**body, "speculative": False}).json()
        assert plain["choices"][0]["message"]["content"] in texts
    finally:
        srv.stop()
