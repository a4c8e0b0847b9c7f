"""Model configurations for tests and benchmarks, as `text_config` dicts (HF field names).

Tiny ones shrink every runtime dimension (layers, heads, experts, vocab) and include Dk != Dv, odd
head and expert counts, odd vocab, and modules left dense because their in-dim is not a multiple of 64.
"""
from __future__ import annotations

from ..config import ModelConfig


def _layer_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _base(**kw) -> dict:
    d = dict(
        model_type="qwen3_5_moe_text", hidden_size=128, num_hidden_layers=4, vocab_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_output_gate=True,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False, full_attention_interval=4, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    d.update(kw)
    d["layer_types"] = _layer_types(d["num_hidden_layers"], d["full_attention_interval"])
    return d


def tiny_config_dicts() -> dict[str, dict]:
    """name -> text_config dict of the tiny test models."""
    return {
        # the real ratios (GQA 2:1 kv, Hv = 2 Hk) at small size
        "tiny": _base(),
        # Dk != Dv, Hv/Hk = 3, one kv head, 5 experts top-3, odd vocab, 8 layers (2 attention)
        "tiny_dk_ne_dv": _base(hidden_size=192, num_hidden_layers=8, vocab_size=777, num_attention_heads=3,
                               num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                               linear_num_value_heads=6, linear_key_head_dim=48, linear_value_head_dim=32,
                               num_experts=5, num_experts_per_tok=3, moe_intermediate_size=128,
                               shared_expert_intermediate_size=64),
        # dense (unquantized) modules: in-dims 96 / 160 are not multiples of the group size 64
        "tiny_odd": _base(hidden_size=128, num_hidden_layers=5, vocab_size=301, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=5,
                          linear_key_head_dim=16, linear_value_head_dim=32, num_experts=3,
                          num_experts_per_tok=3, moe_intermediate_size=96, shared_expert_intermediate_size=160,
                          linear_conv_kernel_dim=3),
    }


def full_config_dict() -> dict:
    """The real Qwen3.6-35B-A3B text config (docs/model.md §1)."""
    return _base(hidden_size=2048, num_hidden_layers=40, vocab_size=248320, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 max_position_embeddings=262144, eos_token_id=248044)


def tiny_configs() -> dict[str, ModelConfig]:
    return {k: ModelConfig.from_dict(v) for k, v in tiny_config_dicts().items()}


def full_config() -> ModelConfig:
    return ModelConfig.from_dict(full_config_dict())
