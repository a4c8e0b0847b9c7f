"""Full-size synthetic MLX 4-bit checkpoints, fast: codes and scales are views into shared random pools (no
per-tensor random generation, no quantization), shards written by a thread pool.

`conditioned_weights(cfg)` returns engine-contract (tensors, quant) like `random_weights`, but in seconds at the
real Qwen3.6-35B-A3B size (35 B parameters) instead of an hour. `write_fast_checkpoint(folder, cfg_dict)` writes
them as a published-format MLX checkpoint (config.json with `quantization`, sharded safetensors + index,
tokenizer files and chat template from `write_tokenizer`), loadable by `lily.load` and `mlx_lm.load`.

Conditioning (why the defaults are what they are). A 40-layer random MoE is chaotic unless the residual stream
dominates every branch output: a one-ulp change then grows layer over layer and the bf16-vs-fp32 envelope
(docs/numerics.md) says nothing (the second H200 pass measured this on an earlier generator whose embedding had
std 1/sqrt(hidden) = 0.022 while each branch added ~0.05: every layer rewrote the stream; the notes of that pass:
`git show 82eaca8:benchmarks/results/cuda_notes.md`).
  * embed_std = 1.0: the stream starts at RMS 1, as in `random_weights` (tiny configs, envelope top-1 ~1.0);
  * residual_scale (0.1, as `random_weights`): out_proj / o_proj / down_proj weights have std
    residual_scale/sqrt(in), so each of the 80 branches adds ~residual_scale x the stream;
  * router_gain (4): router weights std router_gain/sqrt(hidden): logits of std ~4 leave a margin between the
    8th and 9th expert that bf16 noise rarely crosses (an expert flip is a discrete jump);
  * per-group scales jittered by +-25 % (a pool of random bf16 values) so a kernel that reads the wrong group's
    scale or bias gives a wrong answer (constant scales would hide it); biases = -scale * (levels/2) keep
    every group zero-mean.
benchmarks/cuda_check_full.py explore_conditioning() measures the envelope (bf16 reference vs CPU fp32) on a
reduced-width 40-layer config (real head shapes, hidden 256, 32 experts, 32 positions): embed_std 1 with
residual_scale 0.05 / 0.1 / 0.2 gives top-1 1.000 / 0.969-1.000 / 0.969, rel RMS 2.6e-3 / 4.0e-3 / 8.9e-3;
embed_std 0.022 (the old generator) gives top-1 0.25, rel RMS 0.73 (chaotic).
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..config import ModelConfig
from ..quant import f32_to_bf16
from ..safetensors_mmap import save_file
from .checkpoint_writer import _full_config, quantization_block, write_tokenizer
from .weights import GROUP, default_quant_bits, linear_modules

CODE_POOL_WORDS = 1 << 27          # 512 MB of random uint32 codes shared by every quantized tensor
SCALE_JITTER = 0.25                # per-group scale = nominal * U(1 - j, 1 + j)
SHARD_BYTES = 2 * 1024 ** 3        # ~10 shards at full size: one writer thread each


def _bf16(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16(np.asarray(x, np.float32))


class _Pools:
    """Random pools; every tensor is a slice (a view) at a random offset."""

    def __init__(self, rng: np.random.Generator, code_words: int, group_words: int):
        self.rng = rng
        self.codes = rng.integers(0, 2**32, size=code_words, dtype=np.uint32)
        self.jitter = rng.uniform(1 - SCALE_JITTER, 1 + SCALE_JITTER, size=group_words).astype(np.float32)
        self._by_scale: dict[tuple[float, int], tuple[np.ndarray, np.ndarray]] = {}

    def code_view(self, n_words: int) -> np.ndarray:
        if n_words > self.codes.size:  # a tensor larger than the pool: tile it (only tiny pools hit this)
            reps = -(-n_words // self.codes.size)
            return np.tile(self.codes, reps)[:n_words]
        off = int(self.rng.integers(0, self.codes.size - n_words + 1))
        return self.codes[off:off + n_words]

    def group_views(self, scale: float, bits: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """bf16 (scales, biases) [n], biases = -scale * levels/2 from the same jittered scale."""
        key = (float(scale), bits)
        if key not in self._by_scale:
            s = self.jitter * np.float32(scale)
            s16 = _bf16(s)
            s32 = (s16.astype(np.uint32) << 16).view(np.float32)
            self._by_scale[key] = (s16, _bf16(-s32 * np.float32(((1 << bits) - 1) / 2)))
        s16, b16 = self._by_scale[key]
        if n > s16.size:
            reps = -(-n // s16.size)
            return np.tile(s16, reps)[:n], np.tile(b16, reps)[:n]
        off = int(self.rng.integers(0, s16.size - n + 1))
        return s16[off:off + n], b16[off:off + n]


def conditioned_weights(cfg: ModelConfig, seed: int = 0, *, embed_std: float = 1.0, residual_scale: float = 0.1,
                        router_gain: float = 4.0, code_pool_words: int = CODE_POOL_WORDS
                        ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """Engine-contract (tensors, quant) for cfg: 4-bit g64 codes (8-bit router / shared-expert gate, dense where
    the in-dim is not a multiple of 64) with the conditioning of the module docstring. Quantized tensors are
    views into shared pools: seconds and ~0.6 GB of RAM at full size."""
    rng = np.random.default_rng(seed)
    mods = linear_modules(cfg)
    max_groups = max(int(np.prod(s[:-1])) * (s[-1] // GROUP) for s in mods.values())
    pools = _Pools(rng, min(code_pool_words, max(1 << 16, 2 * sum(int(np.prod(s)) // 8 for s in mods.values()))),
                   2 * max_groups)
    tensors: dict[str, np.ndarray] = {}
    quant: dict[str, tuple[int, int]] = {}
    for mod, shape in mods.items():
        bits = default_quant_bits(mod, shape)
        std = embed_std if mod == "model.embed_tokens" else 1.0 / np.sqrt(shape[-1])
        if mod.endswith((".out_proj", ".o_proj", ".down_proj")):
            std *= residual_scale
        if mod.endswith(".mlp.gate"):
            std *= router_gain
        if bits is None:
            tensors[mod + ".weight"] = _bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
            continue
        rows = int(np.prod(shape[:-1]))
        words = rows * shape[-1] * bits // 32
        tensors[mod + ".weight"] = pools.code_view(words).reshape(*shape[:-1], shape[-1] * bits // 32)
        levels = (1 << bits) - 1
        scale = std / (levels / np.sqrt(12.0))  # uniform codes 0..levels have std levels/sqrt(12) (nearly)
        gshape = (*shape[:-1], shape[-1] // GROUP)
        s16, b16 = pools.group_views(scale, bits, rows * (shape[-1] // GROUP))
        tensors[mod + ".scales"], tensors[mod + ".biases"] = s16.reshape(gshape), b16.reshape(gshape)
        quant[mod] = (bits, GROUP)
    H = cfg.hidden_size

    def norm(n: int) -> np.ndarray:  # bf16-representable float32 (written BF16, lossless)
        return (_bf16(1.0 + 0.1 * rng.standard_normal(n)).astype(np.uint32) << 16).view(np.float32)

    def f32(x: np.ndarray) -> np.ndarray:
        return (_bf16(x).astype(np.uint32) << 16).view(np.float32)

    tensors["model.norm.weight"] = norm(H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[p + ".input_layernorm.weight"] = norm(H)
        tensors[p + ".post_attention_layernorm.weight"] = norm(H)
        if cfg.is_attention(i):
            tensors[p + ".self_attn.q_norm.weight"] = norm(cfg.head_dim)
            tensors[p + ".self_attn.k_norm.weight"] = norm(cfg.head_dim)
        else:
            a = p + ".linear_attn"
            K, Hv = cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads
            tensors[a + ".conv1d.weight"] = f32(rng.uniform(-1, 1, (cfg.conv_dim, K, 1)) * K ** -0.5)
            tensors[a + ".dt_bias"] = f32(rng.uniform(-1.0, 1.0, Hv))
            tensors[a + ".A_log"] = f32(np.log(rng.uniform(0.5, 8.0, Hv)))
            tensors[a + ".norm.weight"] = norm(cfg.linear_value_head_dim)
    return tensors, quant


def _tag(arr: np.ndarray) -> tuple[np.ndarray, str]:
    if arr.dtype == np.uint32:
        return arr, "U32"
    if arr.dtype == np.uint16:
        return arr, "BF16"
    return _bf16(arr), "BF16"  # float32 vectors here are bf16-representable by construction


def write_fast_checkpoint(folder: str | os.PathLike, cfg_dict: Mapping[str, Any], seed: int = 0, *,
                          threads: int = 0, shard_bytes: int = SHARD_BYTES, log=print,
                          **conditioning: float) -> dict[str, Any]:
    """Write conditioned_weights(cfg) as an MLX 4-bit checkpoint folder with a tokenizer; shards in parallel.
    Returns timings and sizes {gen_s, write_s, tokenizer_s, bytes, shards}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    d = dict(cfg_dict)
    tok = write_tokenizer(folder, vocab_size=d["vocab_size"])
    d["eos_token_id"] = tok["eos_token_id"]
    tok_s = time.perf_counter() - t0
    cfg = ModelConfig.from_dict(d)
    t0 = time.perf_counter()
    tensors, quant = conditioned_weights(cfg, seed, **conditioning)
    gen_s = time.perf_counter() - t0
    named = [("language_model." + k, *_tag(np.asarray(v))) for k, v in tensors.items()]
    shards: list[list[tuple[str, np.ndarray, str]]] = [[]]
    size = 0
    for item in named:
        if shards[-1] and size + item[1].nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1].nbytes
    n = len(shards)
    names = ["model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old in folder.glob("model*.safetensors"):  # a previous run with another shard count
        if old.name not in names:
            old.unlink()
    t0 = time.perf_counter()

    def write(i: int) -> int:
        sh = shards[i]
        return save_file(folder / names[i], {k: a for k, a, _ in sh}, dtypes={k: t for k, _, t in sh},
                         metadata={"format": "mlx"})
    with ThreadPoolExecutor(max_workers=threads or min(16, os.cpu_count() or 1)) as ex:
        nbytes = sum(ex.map(write, range(n)))
    write_s = time.perf_counter() - t0
    weight_map = {k: names[i] for i, sh in enumerate(shards) for k, _, _ in sh}
    total = int(sum(a.nbytes for _, a, _ in named))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    config = _full_config(d)
    q = quantization_block(tensors, quant)
    config["quantization"] = q
    config["quantization_config"] = q
    config["lily_synthetic"] = {"generator": "lily.testing.fast_synthetic", "seed": seed,
                                "conditioning": {"embed_std": 1.0, "residual_scale": 0.1, "router_gain": 4.0,
                                                 **conditioning}, "scale_jitter": SCALE_JITTER}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok["eos_token_id"], tok["special"]["<|endoftext|>"]]}, indent=2))
    del tensors
    return {"gen_s": gen_s, "write_s": write_s, "tokenizer_s": tok_s, "bytes": nbytes, "shards": n}
