"""Checks at the front door of the Python API's generate and prefill calls: chat messages that say something,
and keyword options that exist.

A message without content renders as an empty turn and the model answers it (the server refuses such a
request with a 400; the Python API must not answer it either). An unknown keyword used to go to the chat
template, which ignores every variable it does not read, so a misspelled `temprature=0.5` ran with the default
temperature. Template variables are now passed by name (`enable_thinking`, `preserve_thinking`, `tools`) or in
`chat_template_kwargs={...}` (vLLM's name), and any other keyword is an error that names the valid ones.
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence

from .sampling import SAMPLING_OPTIONS

# template variables that generate() and prefill() take by name; others go in chat_template_kwargs
TEMPLATE_OPTIONS = ("enable_thinking", "preserve_thinking", "tools")


def is_chat(prompt: Any) -> bool:
    """A list of message dicts (as opposed to text or token ids)."""
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)) and len(prompt) > 0
            and all(isinstance(m, Mapping) for m in prompt))


def check_messages(messages: Sequence[Mapping[str, Any]], where: str) -> None:
    """ValueError naming the first message without a role or without content (an assistant message may have
    tool_calls instead of content)."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"[{where}] messages[{i}] has no role: expected 'system', 'user', 'assistant' or "
                             f"'tool'")
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls"):
                continue
            expected = "content (a string) or tool_calls" if role == "assistant" else "content (a string)"
            raise ValueError(f"[{where}] messages[{i}] ({role}) has no content: expected {expected}")
        if not isinstance(content, (str, list)):
            raise TypeError(f"[{where}] messages[{i}].content is {type(content).__name__}: expected a string "
                            f"(or a list of text parts)")


def check_options(options: Mapping[str, Any], where: str) -> None:
    """TypeError for a keyword that is not a sampling option, naming the closest valid one and the list."""
    unknown = sorted(k for k in options if k not in SAMPLING_OPTIONS)
    if not unknown:
        return
    name = unknown[0]
    valid = [*SAMPLING_OPTIONS, "stream", *TEMPLATE_OPTIONS, "chat_template_kwargs"]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(f"[{where}] unknown keyword argument {name!r}{hint}: expected a sampling option "
                    f"({', '.join(SAMPLING_OPTIONS)}), stream, {', '.join(TEMPLATE_OPTIONS)}, or other chat-template "
                    f"variables in chat_template_kwargs={{...}}")


def template_kwargs(chat_template_kwargs: Mapping[str, Any] | None, where: str, **named: Any) -> dict[str, Any]:
    """The variables a chat prompt is rendered with: chat_template_kwargs, then the named ones that are set."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"[{where}] chat_template_kwargs must be a dict of template variables, got "
                        f"{type(chat_template_kwargs).__name__}")
    out = dict(chat_template_kwargs or {})
    out.update({k: v for k, v in named.items() if v is not None})
    return out


def chat_variables(prompt: Any, where: str, chat_template_kwargs: Mapping[str, Any] | None, **named: Any
                   ) -> dict[str, Any]:
    """The checked template variables of a generate / prefill call (its chat messages checked too)."""
    if is_chat(prompt):
        check_messages(prompt, where)
    return template_kwargs(chat_template_kwargs, where, **named)
