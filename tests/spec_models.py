"""Models for the speculative-decoding tests: tiny configs with an MTP head on the C++ CPU engine.

head="drafting" (lily.testing.drafting_weights): a head that drafts what its trunk says next (trunk_scale 0: every
draft verifies; 0.3-0.5: some do, some do not); head="random": a random head, whose drafts the trunk rejects.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tiny_model_fixtures import QWEN_STYLE_TEMPLATE, write_tokenizer


def weights(name: str = "tiny", head: str = "drafting", trunk_scale: float = 0.4, seed: int = 3, vocab: int | None = None):
    """(cfg, tensors, quant) with mtp.* in the same dicts (as lily.load hands them to the engine)."""
    from lily.config import ModelConfig
    from lily.testing import drafting_weights, random_mtp_weights, random_weights, tiny_config_dicts
    raw = dict(tiny_config_dicts()[name])
    if vocab is not None:
        raw["vocab_size"] = vocab
    cfg = ModelConfig.from_dict(raw)
    if head == "drafting":
        t, q = drafting_weights(cfg, seed, trunk_scale)
    else:
        t, q = random_weights(cfg, seed)
        ht, hq = random_mtp_weights(cfg, seed)
        t, q = {**t, **ht}, {**q, **hq}
    return cfg, t, q


def engine(name: str = "tiny", head: str = "drafting", trunk_scale: float = 0.4, seed: int = 3, vocab: int | None = None,
           max_context: int = 2048, backend: str = "cpu", options: dict | None = None):
    from lily import _lily
    cfg, t, q = weights(name, head, trunk_scale, seed, vocab)
    kw = {"backend": backend, "options": options} if backend != "cpu" else {}
    return cfg, t, q, _lily.Engine(cfg.to_dict(), t, q, threads=2, max_context=max_context, **kw)


def model(tmp_path: Path, head: str = "drafting", trunk_scale: float = 0.4, seed: int = 3, max_context: int = 4096,
          backend: str = "cpu", options: dict | None = None):
    """A lily.Model (tokenizer, chat template) over the tiny config with an MTP head."""
    from lily import _lily
    from lily.chat import ChatTemplate
    from lily.config import ModelConfig
    from lily.model import Model
    from lily.testing import tiny_config_dicts
    from lily.tokenizer import Tokenizer
    tokenizer = Tokenizer(write_tokenizer(tmp_path))
    raw = dict(tiny_config_dicts()["tiny"])
    raw["eos_token_id"] = tokenizer.endoftext_id
    cfg = ModelConfig.from_dict(raw)
    _, t, q = weights("tiny", head, trunk_scale, seed)
    kw = {"backend": backend, "options": options} if backend != "cpu" else {}
    eng = _lily.Engine(cfg.to_dict(), t, q, threads=2, max_context=max_context, **kw)
    return Model(eng, tokenizer, cfg, chat_template=ChatTemplate(QWEN_STYLE_TEMPLATE, origin="tiny drafting model"),
                 path=str(tmp_path))


def stream_tokens(stream) -> list[int]:
    out = []
    while (t := stream.next()) >= 0:
        out.append(t)
    stream.close()
    return out


def greedy_prompt_and_first(eng, cfg, n: int = 37, seed: int = 0):
    """A random prompt run into a fresh state; returns (state, first greedy token)."""
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)
    st = eng.new_state()
    lg = eng.forward(st, prompt, logits="last")
    return prompt, st, int(np.argmax(lg[-1]))
