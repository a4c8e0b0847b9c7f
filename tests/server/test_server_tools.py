"""Tool calls: the XML parser on crafted text (incremental, parallel, typed, inside <think>), and the server
path end to end.

How the tiny random model is made to call a tool deterministically: `tool_choice` naming a function (or
"required") is enforced by a grammar (lily.server.grammar.tool_call_grammar, llguidance) that only allows
the model's own XML call format with that function's parameters typed by its JSON schema. That is a real
feature (peers do the same for forced tool choice), not a test hook, and it exercises the whole path:
template with tools -> constrained sampling -> streaming XML parser -> OpenAI tool_calls -> the tool
result sent back -> the answer.
"""
from __future__ import annotations

import json

import pytest
from _live import NO_THINK

from lily.reasoning import ReasoningParser
from lily.server.tool_calls import ToolCallParser, convert_value, parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city", "days", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detail": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]


def call_xml(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def feed_chars(text: str, tools, in_reasoning: bool = False):
    """Run text through reasoning + tool parsers one character at a time (the worst streaming case)."""
    rp, tp = ReasoningParser(in_reasoning), ToolCallParser(tools)
    reasoning, events = [], []
    for ch in text + "\0":
        parts = rp.finish() if ch == "\0" else rp.feed(ch)
        for kind, t in parts:
            if kind == "reasoning":
                reasoning.append(t)
            else:
                events += tp.feed(t)
    events += tp.finish()
    return "".join(reasoning), events, tp.calls


# ---- parser on crafted text -----------------------------------------------------------------------------------
def test_parser_types_arguments_by_schema():
    text = "Let me look.\n\n" + call_xml("get_weather", city="Paris", days=3, unit="celsius", detail="true")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "unit": "celsius", "detail": True}
    assert convert_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert convert_value("2.5", {"type": "number"}) == 2.5 and convert_value("007", {"type": "string"}) == "007"
    assert convert_value("not a number", {"type": "integer"}) == "not a number"  # kept, not dropped
    assert convert_value("null", {"type": ["integer", "null"]}) is None


def test_parser_streams_incrementally_and_in_parallel():
    text = call_xml("get_weather", city="Oslo", days=2, unit="celsius") + "\n" + call_xml("get_time", zone="UTC")
    _, events, calls = feed_chars(text, TOOLS)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    starts = [e for e in events if e.kind == "start"]
    assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "get_time")]
    frags = [e.text for e in events if e.kind == "args" and e.index == 0]
    assert len(frags) == 4  # one per parameter, then the closing brace: arguments arrive as they complete
    assert json.loads("".join(frags)) == {"city": "Oslo", "days": 2, "unit": "celsius"}
    assert not [e for e in events if e.kind == "content"]  # whitespace between calls is not content
    # the start event comes before the first parameter is complete
    first_args = next(i for i, e in enumerate(events) if e.kind == "args")
    assert events.index(starts[0]) < first_args


def test_call_that_starts_inside_think():
    text = "I should check the weather.\n" + call_xml("get_weather", city="Rome", days=1, unit="celsius") + \
        "\n</think>\n\nDone."
    reasoning, events, calls = feed_chars(text, TOOLS, in_reasoning=True)
    assert reasoning == "I should check the weather."
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] == "Rome"
    assert "".join(e.text for e in events if e.kind == "content") == "Done."  # the stray </think> is dropped


def test_reasoning_then_content_then_call():
    text = "Thinking hard.\n</think>\n\nSure." + call_xml("get_time", zone="CET")
    reasoning, events, calls = feed_chars(text, TOOLS, in_reasoning=True)
    assert reasoning == "Thinking hard." and [c.name for c in calls] == ["get_time"]
    assert "".join(e.text for e in events if e.kind == "content") == "Sure."


def test_hermes_json_form_and_unfinished_calls():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
                                      TOOLS)
    assert content == "" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    # cut off inside a parameter (max_tokens): the call is kept with the parameters completed so far
    content, calls = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n"
                                      "<parameter=days>\n4", TOOLS)
    assert json.loads(calls[0].arguments) == {"city": "Lyon"}
    # no function at all: the text is content, not a call
    content, calls = parse_tool_calls("see <tool_call> maybe", TOOLS)
    assert calls == [] and content == "see <tool_call> maybe"


# ---- the server path --------------------------------------------------------------------------------------
def _force(name="get_weather"):
    return {"type": "function", "function": {"name": name}}


def _check_call(call):
    jsonschema = pytest.importorskip("jsonschema")
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    kw = {"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    req = dict(model="tiny", messages=msgs, tools=TOOLS, tool_choice=_force(), max_tokens=250, temperature=0.7,
               seed=3, extra_body=kw)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **req))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
        assert len(deltas) >= 3  # name first, then the arguments in pieces
        arguments = "".join(d.function.arguments or "" for d in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        whole = client.chat.completions.create(**req)
        assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
        message = whole.choices[0].message
        first = whole
    else:
        first = client.chat.completions.create(**req)
        assert first.choices[0].finish_reason == "tool_calls"
        message = first.choices[0].message
    assert not message.content and len(message.tool_calls) == 1
    args = _check_call(message.tool_calls[0])
    # the tool result goes back; the model answers (noise, so only the structure is checked)
    call = message.tool_calls[0]
    msgs2 = msgs + [{"role": "assistant", "content": None,
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, **args})}]
    answer = client.chat.completions.create(model="tiny", messages=msgs2, tools=TOOLS, tool_choice="none",
                                            max_tokens=6, temperature=0, stream=False, extra_body=kw)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str) and not answer.choices[0].message.tool_calls
    # the call and its exact tokens were kept: the whole first turn is reused
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens


def test_required_tool_choice_and_thinking(client, tokenizer):
    """tool_choice=required with thinking on: the grammar starts after </think> (forced here with logit_bias,
    which the grammar then overrides); the reasoning is empty and the call is parsed."""
    think_end = tokenizer.think_end_id
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Time and weather?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0.5, seed=9,
                                       logit_bias={str(think_end): 100})
    m = r.choices[0].message
    assert m.tool_calls and {c.function.name for c in m.tool_calls} <= {"get_weather", "get_time"}
    assert not m.model_extra.get("reasoning_content")
    # up to 8 parallel calls may not fit in max_tokens: then the last one is cut off and says so
    complete = m.tool_calls if r.choices[0].finish_reason == "tool_calls" else m.tool_calls[:-1]
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    for c in complete:
        assert isinstance(json.loads(c.function.arguments), dict)
    if r.choices[0].finish_reason == "length":
        with pytest.raises(ValueError):
            json.loads(m.tool_calls[-1].function.arguments)


def test_tool_errors(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       tool_choice=_force("nope"), max_tokens=4, extra_body=NO_THINK)
    with pytest.raises(openai.BadRequestError, match="arguments is not valid JSON"):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "get_time", "arguments": "{bad"}}]}])
