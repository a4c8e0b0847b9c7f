"""The architecture of lily's default model: Qwen3.6-35B-A3B's (docs/model.md §1), scaled down.

Same layer schedule (3 Gated DeltaNet layers, then 1 gated full-attention layer), GQA attention with an
output gate and partial rotary embedding (0.25), DeltaNet with Hv = 2 Hk, sparse MoE in every layer
with a shared expert and a sigmoid shared-expert gate, untied lm_head. Every quantized in-dim is a
multiple of 64, so every linear is stored 4-bit (router and shared-expert gate 8-bit).
"""
from __future__ import annotations

TEXT_CONFIG = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=4096,
    hidden_size=320,
    num_hidden_layers=8,
    full_attention_interval=4,          # layers 3 and 7 are full attention
    # gated full attention: 4 query heads of 128 (q_proj doubled by the output gate), 2 KV heads
    num_attention_heads=4, num_key_value_heads=2, head_dim=128, attn_output_gate=True,
    # gated DeltaNet: Hk = 4, Hv = 8, Dk = Dv = 64, conv kernel 4
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    # sparse MoE: 32 routed experts of 64, top-4 (renormalized), one shared expert of 128
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
    norm_topk_prob=True,
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    # <|endoftext|>; chat turns end with <|im_end|> (generation_config below)
    bos_token_id=None, eos_token_id=4087, pad_token_id=None,
)
TEXT_CONFIG["layer_types"] = ["full_attention" if (i + 1) % TEXT_CONFIG["full_attention_interval"] == 0
                              else "linear_attention" for i in range(TEXT_CONFIG["num_hidden_layers"])]

ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 4087, 4088, 4089
GENERATION_CONFIG = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID,
                     "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95,
                     "repetition_penalty": 1.0}

# fields the transformers Qwen3_5MoeTextConfig takes
HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
             "attention_bias", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
             "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
             "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "layer_types",
             "eos_token_id", "pad_token_id", "bos_token_id")


def hf_text_config(overrides: dict | None = None):
    """transformers' Qwen3_5MoeTextConfig for this model (overrides: e.g. a tiny CPU test size)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    d = dict(TEXT_CONFIG)
    d.update(overrides or {})
    if "num_hidden_layers" in (overrides or {}):
        d["layer_types"] = ["full_attention" if (i + 1) % d["full_attention_interval"] == 0
                            else "linear_attention" for i in range(d["num_hidden_layers"])]
    return Qwen3_5MoeTextConfig(**{k: d[k] for k in HF_FIELDS})
