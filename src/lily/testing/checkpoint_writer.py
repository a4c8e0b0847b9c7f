"""Write synthetic checkpoints in the published layouts, for tests, benchmarks and `lily convert`.

* `write_mlx_checkpoint`: the mlx-community / mlx-lm format (config.json `model_type: qwen3_5_moe` with a
  nested `text_config` and `quantization` + `quantization_config` blocks holding the per-module
  overrides, `language_model.`-prefixed names, sharded safetensors + `model.safetensors.index.json`,
  bf16 stored with the real `BF16` safetensors dtype).
* `write_hf_checkpoint`: the Hugging Face bf16 original (`model.language_model.*`, fused
  `experts.gate_up_proj`, conv1d [C,1,K], zero-centred norms): the inverse of docs/model.md §2.3.
* `write_tokenizer`: a small byte-level BPE tokenizer with the Qwen special tokens, its
  tokenizer_config.json and a chat template (see chat_template.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ..config import ModelConfig
from ..quant import f32_to_bf16, round_bf16
from ..safetensors_mmap import save_file
from .chat_template import CHAT_TEMPLATE

DEFAULT_SHARD_BYTES = 5 * 1024 ** 3          # mlx-lm's default shard size
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight")
# the MTP head's own norms, zero-centred in HF originals too (docs/model.md §7)
_SHIFTED_MTP_NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")

# Qwen3.5/3.6 special tokens, in their real relative order. `special` as in the real tokenizer.json:
# the think / tool tags are added tokens but not "special", so decoding keeps them.
QWEN_SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
# the pre-tokenizer split of Qwen3.5 (docs/model.md §8)
QWEN35_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                      r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- config --------------------------------------------------------------------------------------------
def text_config_dict(cfg: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A `text_config` dict (HF field names) from a ModelConfig, a text_config dict, or a full config."""
    if isinstance(cfg, ModelConfig):
        d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name not in ("quant_default", "quant_overrides", "eos_token_ids", "rope_theta",
                               "partial_rotary_factor")}
        d["layer_types"] = list(cfg.layer_types)
        d["model_type"] = "qwen3_5_moe_text"
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": cfg.partial_rotary_factor,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
        ids = list(cfg.eos_token_ids)
        if ids:
            d["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    else:
        d = dict(cfg.get("text_config", cfg))
    d.setdefault("model_type", "qwen3_5_moe_text")
    d.setdefault("attn_output_gate", True)
    d.setdefault("hidden_act", "silu")
    d.setdefault("attention_bias", False)
    d.setdefault("mtp_num_hidden_layers", 0)
    d.setdefault("mamba_ssm_dtype", "float32")
    d.setdefault("dtype", "bfloat16")
    lt = d.get("layer_types")
    if lt and "full_attention_interval" not in d:
        # mlx-lm builds its layer schedule from the interval only: keep it consistent
        full = [i for i, t in enumerate(lt) if t == "full_attention"]
        d["full_attention_interval"] = full[0] + 1 if full else len(lt) + 1
    return d


def with_mtp_layers(cfg: ModelConfig | Mapping[str, Any], n: int) -> dict[str, Any]:
    """A full config dict whose text config says mtp_num_hidden_layers = n (the head's tensors are written too)."""
    full = dict(cfg) if isinstance(cfg, Mapping) and "text_config" in cfg else _full_config(cfg)
    full["text_config"] = {**full["text_config"], "mtp_num_hidden_layers": n}
    return full


def _full_config(cfg: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    text = text_config_dict(cfg)
    out = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": False}
    if "eos_token_id" in text:
        out["eos_token_id"] = text["eos_token_id"]
    return out


def _modules_with_weights(tensors: Mapping[str, np.ndarray]) -> Iterable[str]:
    return (n[: -len(".weight")] for n in tensors if n.endswith(".weight"))


def quantization_block(tensors: Mapping[str, np.ndarray], quant: Mapping[str, tuple[int, int]]) -> dict | None:
    """The config `quantization` block for these tensors, as mlx-lm writes it: the most common spec as
    the default, `{bits, group_size}` for modules that differ, `false` for modules left dense that
    the default would otherwise apply to (in-dim a multiple of the group)."""
    if not quant:
        return None
    (bits, group), _ = Counter(quant.values()).most_common(1)[0]
    block: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for m in _modules_with_weights(tensors):
        key = "language_model." + m
        if m in quant:
            b, g = quant[m]
            if (b, g) != (bits, group):
                block[key] = {"group_size": g, "bits": b}
        elif tensors[m + ".weight"].ndim >= 2 and tensors[m + ".weight"].shape[-1] % group == 0:
            block[key] = False
    return block


# ---- writers -------------------------------------------------------------------------------------------
def _write_shards(folder: Path, named: list[tuple[str, np.ndarray, str]], shard_bytes: int,
                  fmt: str) -> int:
    """Write (name, array, dtype tag) in order into shards of at most shard_bytes (a tensor larger
    than that gets its own shard) + model.safetensors.index.json; returns the total tensor bytes."""
    shards: list[list[tuple[str, np.ndarray, str]]] = [[]]
    size = 0
    for item in named:
        nb = item[1].nbytes
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nb
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(folder / fname, {k: a for k, a, _ in shard}, dtypes={k: t for k, _, t in shard},
                  metadata={"format": fmt})
        weight_map.update({k: fname for k, _, _ in shard})
    total = int(sum(a.nbytes for _, a, _ in named))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return total


def _float_tag(arr: np.ndarray, float_dtype: str) -> tuple[np.ndarray, str]:
    """float32 array -> (array to write, tag). "auto": BF16 when lossless (the published format), else F32."""
    if float_dtype == "f32":
        return arr, "F32"
    b = f32_to_bf16(arr)
    if float_dtype == "bf16":
        return b, "BF16"
    exact = np.array_equal(round_bf16(arr).view(np.uint32), np.ascontiguousarray(arr).view(np.uint32))
    return (b, "BF16") if exact else (arr, "F32")


def write_mlx_checkpoint(folder: str | os.PathLike, cfg_dict: ModelConfig | Mapping[str, Any],
                         tensors: Mapping[str, np.ndarray], quant: Mapping[str, tuple[int, int]], *,
                         shard_bytes: int = DEFAULT_SHARD_BYTES, float_dtype: str = "auto",
                         generation_config: Mapping[str, Any] | None = None,
                         extra_tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write engine-contract `tensors`/`quant` (lily.testing.random_weights, or a LoadedCheckpoint) as
    a published-format MLX checkpoint. uint16 arrays are bf16 bits (written BF16); float32 arrays
    are written BF16 when that is lossless, else F32 (`float_dtype` "bf16"/"f32" forces one).
    extra_tensors: full names (e.g. `vision_tower.x`) written as they are, for loader tests."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    named: list[tuple[str, np.ndarray, str]] = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype == np.uint32:
            tag = "U32"
        elif arr.dtype == np.uint16:
            tag = "BF16"
        elif arr.dtype == np.float32:
            arr, tag = _float_tag(arr, float_dtype)
        else:
            raise ValueError(f"write_mlx_checkpoint: tensor {name} has dtype {arr.dtype}; the contract "
                             f"uses uint32 codes, uint16 bf16 bits or float32")
        named.append(("language_model." + name, arr, tag))
    for name, arr in (extra_tensors or {}).items():
        arr = np.asarray(arr)
        named.append((name, *(_float_tag(arr, "bf16") if arr.dtype == np.float32 else (arr, None))))
    config = _full_config(cfg_dict)
    q = quantization_block(tensors, quant)
    if q is not None:
        config["quantization"] = q
        config["quantization_config"] = q
    _write_shards(folder, named, shard_bytes, "mlx")
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2))
    return folder


def write_hf_checkpoint(folder: str | os.PathLike, cfg_dict: ModelConfig | Mapping[str, Any],
                        dense_f32_weights: Mapping[str, np.ndarray], *, expert_layout: str = "fused",
                        a_log_dtype: str = "bf16", shard_bytes: int = DEFAULT_SHARD_BYTES,
                        extra_tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write dense MLX-convention float32 weights (contract names: `module.weight` for linears, norms
    already 1+w, conv1d [C,K,1]; lily.testing.random_dense_weights, plus random_mtp_dense_weights for an MTP
    head) as an HF bf16 original: `model.language_model.*` / `lm_head.weight` / `mtp.*`, experts fused as
    `mlp.experts.gate_up_proj`
    [E, 2I, H] (gate first) + `mlp.experts.down_proj` (expert_layout="per_expert":
    `mlp.experts.{e}.{gate,up,down}_proj.weight`), conv1d [C,1,K], norms stored as w-1 except
    linear_attn.norm. a_log_dtype "bf16" (Qwen3.6) or "f32" (Qwen3.5).
    extra_tensors: HF names (e.g. `mtp.fc.weight`, `model.visual.x`) written bf16, for loader tests."""
    if expert_layout not in ("fused", "per_expert"):
        raise ValueError("expert_layout must be 'fused' or 'per_expert'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = {k: np.asarray(v, dtype=np.float32) for k, v in dense_f32_weights.items()}
    out: dict[str, np.ndarray] = {}
    for name in list(w):
        if ".switch_mlp." not in name:
            continue
        pre, rest = name.split(".switch_mlp.")
        proj = rest[: -len(".weight")]
        if expert_layout == "per_expert":
            for e in range(w[name].shape[0]):
                out[f"{pre}.experts.{e}.{proj}.weight"] = w[name][e]
        elif proj == "down_proj":
            out[f"{pre}.experts.down_proj"] = w[name]
        elif proj == "gate_proj":
            out[f"{pre}.experts.gate_up_proj"] = np.concatenate(
                [w[name], w[f"{pre}.switch_mlp.up_proj.weight"]], axis=-2)
    for name, arr in w.items():
        if ".switch_mlp." in name:
            continue
        if name.endswith(".conv1d.weight"):
            arr = np.moveaxis(arr, 2, 1)                       # MLX [C,K,1] -> HF [C,1,K]
        elif name.endswith(_SHIFTED_NORMS) or name in ("model.norm.weight", *_SHIFTED_MTP_NORMS):
            arr = arr - np.float32(1.0)                        # HF norms are zero-centred
        out[name] = arr
    named: list[tuple[str, np.ndarray, str]] = []
    for name, arr in out.items():
        hf = name if name.startswith(("lm_head.", "mtp.")) else "model.language_model." + name[len("model."):]
        if name.endswith(".A_log") and a_log_dtype == "f32":
            named.append((hf, np.ascontiguousarray(arr), "F32"))
        else:
            named.append((hf, f32_to_bf16(arr), "BF16"))
    for name, arr in (extra_tensors or {}).items():
        named.append((name, f32_to_bf16(np.asarray(arr, np.float32)), "BF16"))
    _write_shards(folder, named, shard_bytes, "pt")
    (folder / "config.json").write_text(json.dumps(_full_config(cfg_dict), indent=2))
    return folder


# ---- tokenizer -----------------------------------------------------------------------------------------
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.
Once upon a time there was a little robot who liked to count: one, two, three, four, five, 6, 7, 8, 9, 10.
It asked many questions. What is the weather like today? The sun is shining and the sky is blue.
The answer is 42, and the question is what you get when you multiply six by seven.
Please write a short poem about the sea, the wind, the stars and the moon over the quiet town.
Reasoning step by step: first we read the problem, then we think, then we write the answer.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The user asked for the time in Tokyo; the assistant called a tool and reported the result.
Numbers like 3.14159, 2.71828 and 1,000,000 appear in text; so do dates such as 2026-01-15.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, \u4f60\u597d\u4e16\u754c, \u3053\u3093\u306b\u3061\u306f and \U0001F600 are handled as bytes.
She said: "I don't think it's ready, but we'll see." He replied: "You're right; they've tried."
Lists: apples, oranges, bananas, grapes; colours: red, green, blue, yellow, purple, orange.
In the beginning the engine loads the weights, tokenizes the prompt and generates new tokens.
Good morning! How are you? I am fine, thank you. Let me help you with that question.
"""


def write_tokenizer(folder: str | os.PathLike, vocab_size: int = 512, *, corpus: str | None = None,
                    chat_template: str | None = None, template_file: bool = True) -> dict[str, Any]:
    """Train a byte-level BPE tokenizer (Qwen3.5 pre-tokenizer split, GPT-2 byte map) on a small
    built-in English text and write tokenizer.json, tokenizer_config.json and chat_template.jinja
    (template_file=False puts the template into tokenizer_config.json instead).

    The Qwen special tokens are appended after the learned vocabulary, so the whole tokenizer has
    at most `vocab_size` ids (pass the model's vocab_size). Returns {"vocab_size", "special": {token:
    id}, "eos_token_id", "pad_token_id"}."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    n_special = len(QWEN_SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"write_tokenizer: vocab_size must be >= {256 + n_special} (256 bytes + special tokens)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    text = corpus if corpus is not None else _CORPUS
    tok.train_from_iterator([line for line in text.splitlines() if line] * 4, trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t, _ in QWEN_SPECIAL_TOKENS}
    template = chat_template if chat_template is not None else CHAT_TEMPLATE
    tcfg: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "model_max_length": 262144,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": s, "normalized": False,
                                               "lstrip": False, "rstrip": False, "single_word": False}
                                 for t, s in QWEN_SPECIAL_TOKENS},
    }
    if template_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        tcfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))
    return {"vocab_size": tok.get_vocab_size(), "special": ids, "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}


def export_checkpoint(ck: Any, folder: str | os.PathLike, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Save a LoadedCheckpoint (e.g. an HF bf16 model quantized at load) as an MLX export that
    load_checkpoint and mlx-lm read back: weights + config + generation_config + tokenizer files
    and chat template copied from the source folder. The basis of `lily convert`."""
    import shutil
    folder = Path(folder)
    config, tensors, quant = ck.raw_config or ck.config, ck.tensors, ck.quant
    if getattr(ck, "mtp", None) is not None:
        # the MTP head travels as language_model.mtp.*, quantized by the main layers' rules (lily.mtp_source)
        config = with_mtp_layers(config, ck.mtp.num_layers)
        tensors, quant = {**tensors, **ck.mtp.tensors}, {**quant, **ck.mtp.quant}
    write_mlx_checkpoint(folder, config, tensors, quant, shard_bytes=shard_bytes,
                         generation_config=ck.generation_config or None)
    src = Path(ck.path)
    for pattern in ("tokenizer*", "chat_template.jinja", "vocab.json", "merges.txt", "special_tokens_map.json"):
        for f in src.glob(pattern):
            if f.is_file() and not (folder / f.name).exists():
                shutil.copy2(f, folder / f.name)
    return folder
