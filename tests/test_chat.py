"""Chat template rendering: Qwen format, thinking switches, tools, errors, parity with transformers."""
import pytest

from lily.chat import ChatTemplate, ChatTemplateError, render_chat
from tiny_model_fixtures import QWEN_STYLE_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — °C",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi & <b>bye</b>"}],
    "multi_turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "reasoning_field": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning": "r2"},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": 2}}}]},
        {"role": "tool", "content": "18 °C"},
    ],
}


@pytest.fixture(scope="module")
def tpl():
    return ChatTemplate(QWEN_STYLE_TEMPLATE)


def test_generation_prompt_thinking_on_and_off(tpl):
    msgs = CONVERSATIONS["single"]
    assert tpl.render(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tpl.render(msgs, enable_thinking=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tpl.render(msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_history_think_blocks_stripped_unless_preserved(tpl):
    msgs = CONVERSATIONS["multi_turn"]
    plain = tpl.render(msgs)
    assert "add them" not in plain and "<|im_start|>assistant\n4<|im_end|>" in plain
    kept = tpl.render(msgs, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>" in kept
    # preserve_thinking=None means "not passed": the template's own default applies
    assert tpl.render(msgs, preserve_thinking=None) == plain


def test_reasoning_aliases_reach_the_template(tpl):
    out = tpl.render(CONVERSATIONS["reasoning_field"], add_generation_prompt=False)
    assert "<think>\nr2\n</think>\n\na2" in out  # `reasoning` is aliased to reasoning_content
    assert "r1" not in out


def test_tools_rendered_with_tojson_not_html_escaped(tpl):
    out = tpl.render(CONVERSATIONS["single"], tools=TOOLS)
    assert '"description": "Weather for a city — °C"' in out  # ensure_ascii=False, no &quot; escaping
    assert out.startswith("<|im_start|>system\n# Tools\n\n<tools>\n{")


def test_tool_call_and_response_turns(tpl):
    out = tpl.render(CONVERSATIONS["tool_call"])
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
           "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>" in out
    assert "<|im_start|>user\n<tool_response>\n18 °C\n</tool_response><|im_end|>" in out


def test_raise_exception_becomes_chat_template_error(tpl):
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):
        tpl.render([{"role": "robot", "content": "a"}])


def test_missing_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate(None, origin="/models/x").render(CONVERSATIONS["single"])


def test_bad_messages_and_syntax():
    with pytest.raises(ChatTemplateError, match="list of"):
        render_chat(QWEN_STYLE_TEMPLATE, "hello")
    with pytest.raises(ChatTemplateError, match="'role'"):
        render_chat(QWEN_STYLE_TEMPLATE, [{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% if %}")


def test_sandbox_blocks_attribute_escapes():
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):
        render_chat(evil, CONVERSATIONS["single"])


def test_extra_kwargs_and_generation_block():
    t = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ greeting }}"
    assert render_chat(t, CONVERSATIONS["single"], greeting="!") == "Hi!"


def test_continue_final_message(tpl):
    msgs = CONVERSATIONS["single"] + [{"role": "assistant", "content": "<think>\nx\n</think>\n\nThe answer is"}]
    out = tpl.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert out.endswith("<|im_start|>assistant\n<think>\nx\n</think>\n\nThe answer is")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"preserve_thinking": True}, {"tools": TOOLS}])
def test_parity_with_transformers(name, kwargs):
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    msgs = CONVERSATIONS[name]
    want, _ = cu.render_jinja_template([msgs], chat_template=QWEN_STYLE_TEMPLATE, add_generation_prompt=True,
                                       **kwargs)
    assert ChatTemplate(QWEN_STYLE_TEMPLATE).render(msgs, add_generation_prompt=True, **kwargs) == want[0]
