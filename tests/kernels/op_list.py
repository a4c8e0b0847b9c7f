"""The kernel suite's op list: each family entry point once, with its operands and their shapes, what it returns, its
lily.reference twin and the tolerance family its test reads (kernel_inputs.rel_tol). Every backend's table (ops_cpu.py,
ops_metal.py, ops_cuda.py) implements these entry points under these names and operand names, and declares nothing
of them again; test_op_tables.py holds each table to this list. llama.cpp's test-backend-ops is the model: an op is
declared once and run on every backend.

Legend: S rows, n / H widths, Hq / Hkv query / KV heads, D head dim, Hv / Dv / Dk DeltaNet value heads and dims, C conv
channels, K conv taps, E experts, k routed experts per row, V vocabulary, cap KV cache rows. A `Weight` is
kernel_inputs.Weight (a linear weight in one checkpoint format with its float32 twin)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    operands: tuple[tuple[str, str], ...]  # (name, shape and type) in call order
    returns: str
    reference: str                          # the lily.reference twin the family's tests compare against
    tolerance: str                          # the family of rel_tol(backend, family)

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.operands)


OPS: tuple[Op, ...] = (
    Op("rms_norm", (("x", "f32 [S, n]"), ("w", "f32 [n]"), ("eps", "float")),
       "f32 [S, n]", "lily.reference.ops.rms_norm", "norm"),
    Op("gated_rms_norm", (("o", "f32 [S, Hv*Dv]"), ("z", "f32 [S, Hv*Dv]"), ("w", "f32 [Dv]"), ("eps", "float")),
       "rms_norm(o per head; w) * silu(z): f32 [S, Hv*Dv]", "lily.reference.deltanet.gated_rms_norm", "norm"),
    Op("embed", (("w", "Weight [V, H]"), ("ids", "int [S]")),
       "the rows of W: f32 [S, H]", "Weight.dense[ids]", "exact"),
    Op("linear", (("w", "Weight [out, in]"), ("x", "f32 [S, in]")),
       "x W^T: f32 [S, out]", "x @ Weight.dense.T", "linear"),
    Op("attention", (("qg", "f32 [S, Hq*2*D] (query and gate per head)"), ("k", "f32 [S, Hkv*D]"),
                     ("v", "f32 [S, Hkv*D]"), ("q_norm", "f32 [D]"), ("k_norm", "f32 [D]"),
                     ("k_cache", "f32 [cap, Hkv*D]"), ("v_cache", "f32 [cap, Hkv*D]"), ("pos0", "int"),
                     ("n_heads", "int"), ("n_kv_heads", "int"), ("head_dim", "int"), ("rotary_dim", "int"),
                     ("rope_theta", "float"), ("eps", "float")),
       "S rows at positions pos0.. against the caches: (o f32 [S, Hq*D], k_cache', v_cache')",
       "lily.reference.attention.attention_core", "attention"),
    Op("deltanet", (("qkv", "f32 [S, C]"), ("z", "f32 [S, Hv*Dv]"), ("b", "f32 [S, Hv]"), ("a", "f32 [S, Hv]"),
                    ("conv_w", "f32 [C, K]"), ("dt_bias", "f32 [Hv]"), ("a_log", "f32 [Hv]"), ("norm_w", "f32 [Dv]"),
                    ("conv_state", "f32 [K-1, C]"), ("ssm", "f32 [Hv, Dv, Dk]"), ("k_heads", "int"),
                    ("norm_eps", "float")),
       "the DeltaNet core of S rows: (y f32 [S, Hv*Dv], conv_state' [K-1, C], ssm' [Hv, Dv, Dk])",
       "lily.reference.deltanet.deltanet_core", "deltanet"),
    Op("moe_route", (("logits", "f32 [S, E]"), ("top_k", "int"), ("norm_topk_prob", "bool")),
       "(ids int32 [S, k], weights f32 [S, k])", "lily.reference.moe.route", "exact"),
    Op("moe", (("h", "f32 [S, H] (the normed rows)"),
               ("W", "{router, gate, up, down, sh_gate, sh_up, sh_down, sh_expert_gate: Weight}"),
               ("top_k", "int"), ("norm_topk_prob", "bool")),
       "MoE(h): f32 [S, H] (no residual)", "lily.reference.moe.moe_ffn", "moe"),
    Op("sample_draw", (("logits", "f32 [V]"), ("uniform", "float in [0, 1)"),
                       ("options", "the keywords of lily._lily.sample_draw")),
       "the token drawn (int)", "lily.sampling.Sampler", "exact"),
)
BY_NAME = {op.name: op for op in OPS}
