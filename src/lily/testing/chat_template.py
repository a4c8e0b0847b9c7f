"""A Jinja chat template with the documented behaviour of Qwen3.6's (docs/model.md §8), written for the
synthetic test checkpoints (text only; image/video parts raise).

Behaviour:
  * system: `<|im_start|>system\\n{system}<|im_end|>\\n` (content trimmed);
  * tools: the system turn becomes `# Tools` + the `<tools>` JSON list + the XML call instructions,
    followed by `\\n\\n{system}` when there is a system message;
  * user: `<|im_start|>user\\n{content}<|im_end|>\\n`;
  * assistant: reasoning from `reasoning_content`, else split out of `<think>...</think>` in content;
    rendered as `<think>\\n{reasoning}\\n</think>\\n\\n{content}` for turns after the last real user
    query (or for every turn when `preserve_thinking` is true), else content only; tool calls as
    `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
    (mappings/lists as JSON, other values as strings);
  * tool: consecutive tool messages merge into one user turn of `\\n<tool_response>\\n...\\n</tool_response>`;
  * generation prompt: `<|im_start|>assistant\\n<think>\\n`, or with `enable_thinking=false`
    `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
Tool-call `arguments` must be a mapping (parse an OpenAI JSON string first).
"""

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n- If there is no function call available, answer the question like normal with "
    "your current knowledge and do not tell the user about function calls\n</IMPORTANT>")


def _jinja_str(s: str) -> str:
    """A Python string as a Jinja string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHAT_TEMPLATE = (
    # text of a message content: a string, or a list of {"type": "text", "text": ...} parts
    "{%- macro text_of(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is none or c is undefined -%}"
    "{%- elif c is iterable and c is not mapping -%}"
    "{%- for part in c -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part.text is defined and part.text is not none -%}{{- part.text -}}"
    "{%- else -%}{{- raise_exception('lily test template: only text content is supported') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{- raise_exception('message content must be a string or a list of text parts') -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}"
    "{%- set has_system = messages[0].role == 'system' -%}"
    "{%- set system_text = text_of(messages[0].content) | trim if has_system else '' -%}"
    # system turn
    "{%- if tools and tools is iterable and tools is not mapping -%}"
    "{{- '<|im_start|>system\\n' + " + _jinja_str(TOOLS_PREAMBLE) + " -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>' + " + _jinja_str(TOOLS_INSTRUCTIONS) + " -}}"
    "{%- if system_text -%}{{- '\\n\\n' + system_text -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    # index of the last user message that is a real query (not a wrapped tool response)
    "{%- set st = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- set u = text_of(m.content) | trim -%}"
    "{%- if not (u.startswith('<tool_response>') and u.endswith('</tool_response>')) -%}"
    "{%- set st.last_query = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if st.last_query < 0 -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}"
    "{%- set keep_all = preserve_thinking is defined and preserve_thinking is true -%}"
    "{%- for m in messages -%}"
    "{%- set text = text_of(m.content) | trim -%}"
    "{%- if m.role == 'system' -%}"
    "{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}"
    "{%- elif m.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}"
    "{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in text -%}"
    "{%- set head = text.split('</think>')[0] -%}"
    "{%- set reasoning = head.rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if keep_all or loop.index0 > st.last_query -%}"
    "{{- '<think>\\n' + (reasoning | trim) + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- text -}}"
    "{%- if m.tool_calls and m.tool_calls is iterable and m.tool_calls is not mapping -%}"
    "{%- for call in m.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- elif text | trim -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + fn.name + '>\\n' -}}"
    "{%- if fn.arguments is defined and fn.arguments is mapping -%}"
    "{%- for key, value in fn.arguments | items -%}"
    "{%- if value is mapping or (value is sequence and value is not string) -%}"
    "{%- set value = value | tojson -%}"
    "{%- endif -%}"
    "{{- '<parameter=' + key + '>\\n' + (value | string) + '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('Unexpected message role.') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
