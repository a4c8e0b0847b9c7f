"""Test helpers for the Python API: a tiny byte-level BPE tokenizer with the Qwen special tokens, a compact
Qwen-style chat template, and a tiny random-weight `Model` on the reference engine.

(Until lily.testing ships a synthetic checkpoint folder with tokenizer.json + chat_template.jinja, the API
tests build their pieces here.)
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello world! Hello there, how are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Café naïve résumé — déjà vu. Ünïcödé façade.",
    "中文测试：你好，世界！我们来测试一下分词器。",
    "Emoji 🙂🚀🎉 and symbols ∑∫√ ≠ ≤ ≥.",
    "user assistant system think answer question tool call function parameter",
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# A compact template in the Qwen3.6 shape (system, tools, think blocks, preserve_thinking, tool turns).
QWEN_STYLE_TEMPLATE = """\
{%- if not messages %}{{ raise_exception('No messages provided.') }}{% endif %}
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>' }}
{%- if messages[0].role == 'system' %}{{ '\\n\\n' + messages[0].content | trim }}{% endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.last_query_index = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content | default('', true) %}
{%- set reasoning = message.reasoning_content | default('', true) %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{%- for call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{ raise_exception('Unexpected message role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{ '<think>\\n' }}{% endif %}
{%- endif %}
"""


def build_tokenizer_json(vocab_size: int = 400) -> str:
    """A byte-level BPE tokenizer.json (all 256 bytes + merges + the Qwen special/added tokens at the end)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok.to_str()


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    return build_tokenizer_json()


def write_tokenizer(folder: Path) -> Path:
    path = Path(folder) / "tokenizer.json"
    path.write_text(tokenizer_json())
    return path


def tiny_model(tmp_path: Path, *, max_context: int = 256, template: str | None = QWEN_STYLE_TEMPLATE,
               generation_config: dict | None = None, seed: int = 0):
    """A `lily.Model` on the reference engine: tiny random weights + the tokenizer above."""
    from lily.chat import ChatTemplate
    from lily.config import ModelConfig
    from lily.model import Model
    from lily.reference import ReferenceEngine
    from lily.testing import random_weights, tiny_config_dicts
    from lily.tokenizer import Tokenizer

    tokenizer = Tokenizer(write_tokenizer(tmp_path))
    raw = dict(tiny_config_dicts()["tiny"])
    raw["eos_token_id"] = tokenizer.endoftext_id
    assert tokenizer.vocab_size <= raw["vocab_size"]
    cfg = ModelConfig.from_dict(raw)
    tensors, quant = random_weights(cfg, seed=seed)
    engine = ReferenceEngine(cfg, tensors, quant, max_context=max_context)
    return Model(engine, tokenizer, cfg, chat_template=ChatTemplate(template, origin="tiny test model"),
                 generation_config=generation_config, path=str(tmp_path), nbytes=sum(a.nbytes for a in tensors.values()))
