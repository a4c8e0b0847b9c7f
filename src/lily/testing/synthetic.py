"""One call to write a complete synthetic checkpoint folder (config, weights, tokenizer, template)."""
from __future__ import annotations

import os
from pathlib import Path

from ..config import ModelConfig
from .checkpoint_writer import write_mlx_checkpoint, write_tokenizer
from .configs import full_config_dict, tiny_config_dicts
from .weights import random_mtp_weights, random_weights


def config_dict(name: str) -> dict:
    """A named test config ("tiny", "tiny_dk_ne_dv", "tiny_odd", "full") as a text_config dict."""
    if name == "full":
        return full_config_dict()
    dicts = tiny_config_dicts()
    if name not in dicts:
        raise ValueError(f"unknown synthetic config {name!r}; expected one of {sorted(dicts) + ['full']}")
    return dicts[name]


def write_synthetic_checkpoint(folder: str | os.PathLike, name: str = "tiny", seed: int = 0, mtp: bool = False) -> Path:
    """Write an MLX 4-bit checkpoint of random, well-conditioned weights with a small tokenizer.

    The tokenizer's special tokens get ids inside the model's vocabulary; the remaining rows of the
    (small) vocabulary are ordinary learned BPE pieces. mtp=True adds a random MTP head (`language_model.mtp.*`,
    mtp_num_hidden_layers 1), as `lily convert` writes one.
    """
    folder = Path(folder)
    d = dict(config_dict(name))
    tok = write_tokenizer(folder, vocab_size=d["vocab_size"])
    d["eos_token_id"] = tok["eos_token_id"]
    cfg = ModelConfig.from_dict(d)
    tensors, quant = random_weights(cfg, seed)
    if mtp:
        head, head_quant = random_mtp_weights(cfg, seed)
        tensors, quant = {**tensors, **head}, {**quant, **head_quant}
        d["mtp_num_hidden_layers"] = 1
    write_mlx_checkpoint(folder, d, tensors, quant,
                         generation_config={"eos_token_id": [tok["eos_token_id"], tok["special"]["<|endoftext|>"]]})
    return folder
