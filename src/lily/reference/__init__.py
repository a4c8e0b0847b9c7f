"""lily.reference: a readable NumPy implementation of the whole model, op by op (model.md §4).

The spec in code: every backend kernel family has its twin here.
"""
from .attention import attention_mixer
from .gdn import causal_conv, deltanet_mixer, gated_delta_recurrence
from .linear import Bf16Matrix, Weights
from .model import ReferenceEngine, ReferenceState, forward_hidden
from .moe import moe_ffn, route
from .ops import rms_norm, rope, sigmoid, silu, softmax, softplus

__all__ = ["Bf16Matrix", "ReferenceEngine", "ReferenceState", "Weights", "forward_hidden", "attention_mixer",
           "deltanet_mixer", "causal_conv", "gated_delta_recurrence", "moe_ffn", "route", "rms_norm",
           "rope", "sigmoid", "silu", "softmax", "softplus"]
