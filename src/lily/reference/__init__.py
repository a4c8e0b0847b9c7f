"""lily.reference: a readable NumPy implementation of the whole model, op by op (docs/model.md §4), and of the MTP
draft head (§7).

The spec in code: every backend kernel family has its twin here.
"""
from .attention import attention_core, attention_mixer
from .deltanet import (causal_conv, deltanet_core, deltanet_mixer, deltanet_scan, gated_delta_recurrence,
                  gated_rms_norm)
from .linear import Bf16Matrix, Weights
from .model import ReferenceEngine, ReferenceState, SubBlock, forward_hidden, subblock_references
from .moe import moe_ffn, route
from .mtp import MtpState, mtp_draft_greedy, mtp_forward
from .ops import rms_norm, rope, sigmoid, silu, softmax, softplus

__all__ = ["Bf16Matrix", "MtpState", "ReferenceEngine", "ReferenceState", "SubBlock", "Weights", "forward_hidden",
           "mtp_draft_greedy", "mtp_forward",
           "subblock_references", "attention_core", "attention_mixer", "deltanet_core", "deltanet_mixer",
           "deltanet_scan", "gated_rms_norm", "causal_conv", "gated_delta_recurrence", "moe_ffn", "route", "rms_norm",
           "rope", "sigmoid", "silu", "softmax", "softplus"]
