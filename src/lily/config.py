"""Model configuration: parses a Qwen3.5/3.6-MoE `config.json` (flat or nested `text_config`).

The C++ engine and the NumPy reference both take a `ModelConfig`; every dimension is a runtime value
here so tiny test models (Dk != Dv, odd head counts, few experts) run through the same code.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next_moe_hybrid")


@dataclass(frozen=True)
class QuantSpec:
    """MLX affine quantization of one linear module: w = scales * q + biases, per group of inputs."""

    bits: int
    group_size: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    vocab_size: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # sparse MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # default quantization and per-module overrides (module name without "language_model." prefix)
    quant_default: QuantSpec | None = None
    quant_overrides: dict[str, QuantSpec | None] = field(default_factory=dict, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def quant_for(self, module: str) -> QuantSpec | None:
        """Quantization of `module` ("model.layers.3.mlp.gate"), or None if it is stored dense."""
        if module in self.quant_overrides:
            return self.quant_overrides[module]
        return self.quant_default

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the C++ engine (no nested objects)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("quant_default", "quant_overrides")}
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rotary_dim"] = self.rotary_dim
        return d

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"[lily.load] {path} not found: a checkpoint folder needs a config.json") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"[lily.load] {path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise CheckpointError(f"[lily.load] {source}: expected a JSON object, got {type(raw).__name__}")
        text = raw.get("text_config", raw)
        model_type = text.get("model_type", raw.get("model_type"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"[lily.load] {source}: model_type {model_type!r} is not supported; lily runs the "
                f"Qwen3.5/3.6-MoE hybrid architecture (model_type 'qwen3_5_moe')")

        def req(key: str) -> Any:
            if key not in text:
                raise CheckpointError(f"[lily.load] {source}: missing field {key!r} (needed by the "
                                      f"Qwen3.5/3.6-MoE architecture)")
            return text[key]

        n_layers = int(req("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers or any(t not in ("full_attention", "linear_attention")
                                               for t in layer_types):
            raise CheckpointError(f"[lily.load] {source}: layer_types must list 'full_attention' or "
                                  f"'linear_attention' for each of the {n_layers} layers")
        if int(text.get("num_experts", 0)) <= 0:
            raise CheckpointError(f"[lily.load] {source}: num_experts is missing or 0; lily runs the "
                                  f"sparse-MoE model (Qwen3.5/3.6-MoE), not the dense one")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)))
        prf = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise CheckpointError(f"[lily.load] {source}: rope type {rope_type!r} is not supported "
                                  f"(expected 'default')")
        for flag in ("attention_bias",):
            if text.get(flag):
                raise CheckpointError(f"[lily.load] {source}: {flag}=true is not this architecture")
        hidden = int(req("hidden_size"))
        n_heads = int(req("num_attention_heads"))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

        qd, qo = _parse_quantization(raw.get("quantization") or raw.get("quantization_config"), source)
        cfg = cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            vocab_size=int(req("vocab_size")),
            num_attention_heads=n_heads,
            num_key_value_heads=int(req("num_key_value_heads")),
            head_dim=int(text.get("head_dim") or hidden // n_heads),
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            linear_num_key_heads=int(req("linear_num_key_heads")),
            linear_num_value_heads=int(req("linear_num_value_heads")),
            linear_key_head_dim=int(req("linear_key_head_dim")),
            linear_value_head_dim=int(req("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=int(req("num_experts")),
            num_experts_per_tok=int(req("num_experts_per_tok")),
            moe_intermediate_size=int(req("moe_intermediate_size")),
            shared_expert_intermediate_size=int(req("shared_expert_intermediate_size")),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            eos_token_ids=eos_ids,
            quant_default=qd,
            quant_overrides=qo,
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def fail(msg: str) -> None:
            raise CheckpointError(f"[lily.load] {source}: {msg}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            fail(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                 f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            fail(f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even and <= head_dim")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            fail(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})")
        if self.linear_conv_kernel_dim < 1:
            fail("linear_conv_kernel_dim must be >= 1")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings=true is not this architecture (Qwen3.5/3.6-MoE has a separate lm_head)")


def _parse_quantization(q: Any, source: str) -> tuple[QuantSpec | None, dict[str, QuantSpec | None]]:
    if not q:
        return None, {}
    if not isinstance(q, dict):
        raise CheckpointError(f"[lily.load] {source}: 'quantization' must be an object")
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"[lily.load] {source}: quantization mode {mode!r} is not supported "
                              f"(lily reads MLX affine 4-bit/8-bit checkpoints)")
    default = QuantSpec(int(q.get("bits", 4)), int(q.get("group_size", 64)))
    overrides: dict[str, QuantSpec | None] = {}
    for k, v in q.items():
        if k in ("bits", "group_size", "mode", "quant_method"):
            continue
        name = k[len("language_model."):] if k.startswith("language_model.") else k
        if v is False:
            overrides[name] = None
        elif isinstance(v, dict):
            overrides[name] = QuantSpec(int(v.get("bits", default.bits)),
                                        int(v.get("group_size", default.group_size)))
    for spec in [default, *[s for s in overrides.values() if s]]:
        if spec.bits not in (4, 8) or spec.group_size not in (32, 64, 128):
            raise CheckpointError(f"[lily.load] {source}: quantization bits={spec.bits} "
                                  f"group_size={spec.group_size} is not supported (bits 4 or 8; group 32/64/128)")
    return default, overrides
