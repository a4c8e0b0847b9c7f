"""`/v1/responses` through the official openai client: text, streaming, a forced function tool (stream and
not), the tool output sent back with previous_response_id (which reuses the earlier turns' state)."""
from __future__ import annotations

import json

import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_text_response(client):
    r = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=8, temperature=0,
                                extra_body=NO_THINK)
    assert r.object == "response" and r.id.startswith("resp") and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and isinstance(r.output_text, str)
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    if r.usage.output_tokens == 8:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text


def test_streamed_response_matches_whole(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": "Tell me something."}], instructions="Be brief.",
              max_output_tokens=12, temperature=0.8, extra_body={**NO_THINK, "seed": 5})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_and_previous_response_id(client, stream):
    kw = dict(model="tiny", input="What is the weather in Oslo?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120, temperature=0.5,
              extra_body={**NO_THINK, "seed": 2})
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        final = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert any(e.type == "response.output_item.added" and e.item.type == "function_call" for e in events)
    else:
        final = client.responses.create(**kw)
        args = None
    calls = [o for o in final.output if o.type == "function_call"]
    assert final.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    parsed = json.loads(calls[0].arguments)
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str) and len(parsed["city"]) <= 12
    if args is not None:
        assert args == calls[0].arguments
    follow = client.responses.create(
        model="tiny", previous_response_id=final.id, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 20}'}],
        extra_body=NO_THINK)
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == final.id
    # the earlier turn (prompt and the call) came from a held state, not prefilled again
    assert follow.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens


def test_unknown_previous_response_id(client):
    import openai
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope", max_output_tokens=2)


def test_stored_responses_survive_a_restart_and_a_timeout_says_so(tiny_ckpt, tmp_path):
    """With --session-dir the stored responses are files too: previous_response_id continues a conversation after a
    restart, and GET /v1/responses/{id} finds it; a reply the server's timeout cut off says request_timeout, not
    max_output_tokens."""
    from _live import LiveServer
    no_end = {str(i): -100 for i in (503, 504, 505)}  # the tiny model's end-of-turn tokens never come
    sessions = tmp_path / "sessions"
    srv = LiveServer(tiny_ckpt, tmp_path / "a.log", "--session-dir", str(sessions), "--request-timeout", "1",
                     env={"LILY_TEST_STEP_DELAY": "0.02"})
    try:
        c = srv.client()
        first = c.responses.create(model="tiny", input="Hi", max_output_tokens=8, extra_body=NO_THINK)
        cut = c.responses.create(model="tiny", input="Count", max_output_tokens=3000,
                                 extra_body={**NO_THINK, "logit_bias": no_end})
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "request_timeout", cut
        short = c.responses.create(model="tiny", input="Go", max_output_tokens=2,
                                   extra_body={**NO_THINK, "logit_bias": no_end})
        assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    finally:
        srv.stop()
    assert (sessions / "responses" / f"{first.id}.json").exists()
    srv = LiveServer(tiny_ckpt, tmp_path / "b.log", "--session-dir", str(sessions))
    try:
        c = srv.client()
        assert c.responses.retrieve(first.id).id == first.id
        nxt = c.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=4,
                                 extra_body=NO_THINK)
        assert nxt.previous_response_id == first.id and nxt.status in ("completed", "incomplete")
    finally:
        srv.stop()
