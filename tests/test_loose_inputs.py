"""Loose inputs are clear errors: a chat message without content, a misspelled keyword option (the chat template
would ignore it), a config with fewer layers than the checkpoint's tensors, bfloat16 bytes labelled F16 (they
would load as garbage weights)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import lily
from lily.errors import CheckpointError
from lily.testing import write_synthetic_checkpoint


@pytest.fixture(scope="module")
def model():
    return lily.load(backend="cpu", max_context=512, threads=2)


def test_a_message_without_content_raises(model):
    with pytest.raises(ValueError, match=r"messages\[0\] \(user\) has no content"):
        model.generate([{"role": "user"}], max_tokens=2)
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\) has no content.*tool_calls"):
        model.generate([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], max_tokens=2)
    with pytest.raises(ValueError, match=r"messages\[0\] has no role"):
        model.prefill([{"content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\] \(user\) has no content"):
        model.session().generate([{"role": "user", "content": None}], max_tokens=2)
    # an assistant turn that only calls a tool is complete
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    model.generate([{"role": "user", "content": "hi"}, call, {"role": "tool", "content": "1"}], max_tokens=1)


def test_a_misspelled_option_raises_naming_the_valid_ones(model):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError) as e:
        model.generate(msgs, max_tokens=4, temprature=0.5)
    text = str(e.value)
    assert "'temprature'" in text and "did you mean 'temperature'" in text
    assert "max_tokens" in text and "top_p" in text and "chat_template_kwargs" in text
    with pytest.raises(TypeError, match="unknown keyword argument 'enable_thinkng'"):
        model.generate(msgs, max_tokens=2, enable_thinkng=False)
    with pytest.raises(TypeError, match="did you mean 'top_p'"):
        model.session().generate(msgs, max_tokens=2, topp=0.5)
    with pytest.raises(TypeError, match="enable_thinkng"):
        model.session().prefill(msgs, enable_thinkng=False)


def test_template_variables_go_by_name_or_in_chat_template_kwargs(model):
    msgs = [{"role": "user", "content": "hi"}]
    named = model.generate(msgs, max_tokens=4, temperature=0, enable_thinking=False)
    given = model.generate(msgs, max_tokens=4, temperature=0, chat_template_kwargs={"enable_thinking": False})
    thinking = model.generate(msgs, max_tokens=4, temperature=0)
    assert named.token_ids == given.token_ids
    assert named.stats.prompt_tokens != thinking.stats.prompt_tokens  # the variable reached the template
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        model.generate(msgs, max_tokens=2, chat_template_kwargs=["enable_thinking"])


def test_a_config_with_fewer_layers_than_the_tensors_is_refused(tmp_path):
    folder = write_synthetic_checkpoint(tmp_path / "ck", "tiny")
    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())
    text = raw.get("text_config", raw)
    n = text["num_hidden_layers"]
    text["num_hidden_layers"] = n - 1
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:n - 1]
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"num_hidden_layers={n - 1}.*layer {n - 1} .*expected "
                                              rf"num_hidden_layers={n}"):
        lily.load(folder, backend="cpu")


def _relabel(shard: Path, old: str, new: str) -> int:
    """Rewrite a safetensors header's dtype tags in place (padded to the same length), bytes untouched."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    count = 0
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] == old:
            info["dtype"] = new
            count += 1
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])
    return count


def test_bf16_bytes_labelled_f16_are_refused(tmp_path):
    from lily.testing import random_dense_weights
    from lily.testing.checkpoint_writer import write_hf_checkpoint, write_tokenizer
    from lily.testing.configs import tiny_config_dicts
    from lily.config import ModelConfig

    d = dict(tiny_config_dicts()["tiny"])
    write_tokenizer(tmp_path, vocab_size=d["vocab_size"])
    write_hf_checkpoint(tmp_path, d, random_dense_weights(ModelConfig.from_dict(d), 0))
    lily.load(tmp_path, backend="cpu")  # as written (BF16): fine
    assert sum(_relabel(p, "BF16", "F16") for p in tmp_path.glob("*.safetensors")) > 0
    with pytest.raises(CheckpointError, match=r"labelled F16, but its bytes are bfloat16.*expected BF16"):
        lily.load(tmp_path, backend="cpu")
