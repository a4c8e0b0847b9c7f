"""Random but well-scaled weights in the engine-contract format (docs/engine_contract.md).

Conditioning (docs/numerics.md): residual-branch output projections (out_proj, o_proj, expert and shared
expert down_proj) are scaled by 0.1 so rounding noise does not grow chaotically through the layers and
the fp32-vs-bf16 envelope stays tight enough to catch real bugs.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..checkpoint import CONVERT_GROUP, convert_spec, expected_modules
from ..quant import f32_to_bf16, quantize, round_bf16

RESIDUAL_SCALE = 0.1
GROUP = CONVERT_GROUP


def linear_modules(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every linear module -> logical weight shape (out, in) or (E, out, in) (the loader's own table)."""
    return expected_modules(cfg)[0]


def default_quant_bits(module: str, shape: tuple[int, ...]) -> int | None:
    """mlx-lm's predicate for this model: 8-bit router and shared-expert gate, 4-bit otherwise,
    dense when the in-dim is not a multiple of the group size."""
    spec = convert_spec(module, shape[-1])
    return None if spec is None else spec[0]


def _is_residual_out(module: str) -> bool:
    return module.endswith((".out_proj", ".o_proj", ".down_proj"))


def random_weights(cfg: ModelConfig, seed: int = 0, quantized: bool = True
                   ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """Fresh random weights for cfg -> (tensors, quant) in the engine-contract format.

    quantized=False keeps every linear dense bf16 (the HF-like source for quantize-at-load tests).
    """
    return _contract_format(random_dense_weights(cfg, seed), linear_modules(cfg), quantized)


def random_mtp_weights(cfg: ModelConfig, seed: int = 0, quantized: bool = True
                       ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """A random MTP head for cfg (docs/model.md §7) -> (tensors, quant) in the contract format, `mtp.*` names,
    quantized by the main layers' rules; lily.mtp_source.MtpWeights holds the same."""
    from ..mtp_source import expected_mtp_modules
    return _contract_format(random_mtp_dense_weights(cfg, seed), expected_mtp_modules(cfg)[0], quantized)


def drafting_weights(cfg: ModelConfig, seed: int = 0, trunk_scale: float = 0.0
                     ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """A model with an MTP head that drafts what its trunk says next -> (tensors, quant), main and `mtp.*` in one
    dict (for speculative decoding's tests and benchmarks: random heads draft nothing that verifies).

    The trunk's residual outputs (mixers' out/o_proj, the MoE's down projections) are scaled by trunk_scale: at 0 the
    trunk is a bigram model (its logits after token x are lm_head(final_norm(E[x]))); above 0 the context moves them
    away from that now and then, so drafts part from the trunk. The head (dense bf16) has fc = [I | 0] (the embedding
    half only), no attention or MoE output, pre_fc_norm_embedding = 1 and mtp.norm = the trunk's final norm: its
    logits for (h_p, x_{p+1}) are the bigram logits after x_{p+1}, i.e. the trunk's own next token at trunk_scale 0.
    """
    from ..mtp_source import expected_mtp_modules
    dense = random_dense_weights(cfg, seed)
    for name in dense:
        if name.endswith(".weight") and _is_residual_out(name[:-len(".weight")]):
            dense[name] = _bf(dense[name] * trunk_scale)
    head = random_mtp_dense_weights(cfg, seed)
    H = cfg.hidden_size
    head["mtp.fc.weight"] = np.concatenate([np.eye(H), np.zeros((H, H))], axis=1).astype(np.float32)
    for name in head:
        if name.endswith(".weight") and _is_residual_out(name[:-len(".weight")]):
            head[name] = np.zeros_like(head[name])
    head["mtp.pre_fc_norm_embedding.weight"] = np.ones(H, np.float32)
    head["mtp.norm.weight"] = dense["model.norm.weight"].copy()
    tensors, quant = _contract_format(dense, linear_modules(cfg), True)
    head_tensors, _ = _contract_format(head, expected_mtp_modules(cfg)[0], False)
    return {**tensors, **head_tensors}, quant


def _contract_format(dense: dict[str, np.ndarray], mods: dict[str, tuple[int, ...]], quantized: bool
                     ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    tensors: dict[str, np.ndarray] = {}
    quant: dict[str, tuple[int, int]] = {}
    for name, arr in dense.items():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module in mods:
            bits = default_quant_bits(module, mods[module]) if quantized else None
            if bits is None:
                tensors[name] = f32_to_bf16(arr)
            else:
                tensors[name], tensors[module + ".scales"], tensors[module + ".biases"] = quantize(arr, bits, GROUP)
                quant[module] = (bits, GROUP)
        else:
            tensors[name] = arr.astype(np.float32)
    return tensors, quant


def _bf(x: np.ndarray) -> np.ndarray:
    return round_bf16(np.asarray(x, np.float32))


def _random_linears(rng: np.random.Generator, mods: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for module, shape in mods.items():
        fan_in = shape[-1]
        std = 1.0 if module == "model.embed_tokens" else fan_in ** -0.5
        if _is_residual_out(module):
            std *= RESIDUAL_SCALE
        if module.endswith(".mlp.gate"):
            std *= 2.0  # a decisive router: top-k choices that bf16 noise rarely flips
        out[module + ".weight"] = _bf(rng.standard_normal(shape, dtype=np.float32) * std)
    return out


def random_mtp_dense_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights of a random MTP head with MLX names (`mtp.fc.weight`, `mtp.layers.0.*`, norms already 1 + γ),
    bf16-representable, before quantization (lily.testing.write_hf_checkpoint writes them as an HF original)."""
    from ..mtp_source import expected_mtp_modules
    rng = np.random.default_rng([seed, 0x6D7470])  # apart from the main weights' stream of the same seed
    lin, vec = expected_mtp_modules(cfg)
    out = _random_linears(rng, lin)
    for name, shape in vec.items():
        out[name] = _bf(1.0 + 0.1 * rng.standard_normal(shape))
    return out


def random_dense_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights with MLX names (no prefix), bf16-representable, before quantization."""
    rng = np.random.default_rng(seed)
    out = _random_linears(rng, linear_modules(cfg))
    bf = _bf
    H = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        out[p + ".input_layernorm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(H))
        out[p + ".post_attention_layernorm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(H))
        if cfg.is_attention(i):
            out[p + ".self_attn.q_norm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(cfg.head_dim))
            out[p + ".self_attn.k_norm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(cfg.head_dim))
        else:
            a = p + ".linear_attn"
            K = cfg.linear_conv_kernel_dim
            out[a + ".conv1d.weight"] = bf(rng.uniform(-1, 1, (cfg.conv_dim, K, 1)) * K ** -0.5)
            out[a + ".dt_bias"] = bf(rng.uniform(-1.0, 1.0, cfg.linear_num_value_heads))
            out[a + ".A_log"] = np.log(rng.uniform(0.5, 8.0, cfg.linear_num_value_heads)).astype(np.float32)
            out[a + ".norm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(cfg.linear_value_head_dim))
    out["model.norm.weight"] = bf(1.0 + 0.1 * rng.standard_normal(H))
    return out
