"""The `speculative` option, parsed and explained once for every surface (the Python API validates it in
SamplingParams; `lily generate`, `lily chat`, `lily bench` and the server's flags and request bodies use this).

Speculative decoding drafts tokens with the model's MTP head and verifies them in one forward; the output is plain
decoding's token for token (greedy, or sampled with the same seed). The option (lily.sampling.SamplingParams
.speculative): None = automatic (on when the engine runs a head; the stream falls back to plain steps by itself when
drafting does not pay; only this setting adapts), False = off, True = on (an error without a head), k in 1..MAX_DRAFTS = on with k drafted
tokens per step. Flags spell it `auto`, `on`, `off` or `K`; request bodies `null`, `true`, `false` or `K`.
"""
from __future__ import annotations

from typing import Any

from .sampling import MAX_DRAFTS

FLAG_VALUES = f"auto, on, off or 1..{MAX_DRAFTS}"
# where a head comes from (lily.mtp_source): the Hugging Face original ships one
HEAD_SOURCE_HINT = "e.g. Qwen/Qwen3.6-35B-A3B: only the shards holding the head are downloaded"
LOAD_HEAD_HINT = "load the model with lily.load(path, mtp=SOURCE)"  # the Python API's way to a head

# drafted tokens per speculative step by default, by backend: on the CPU a step's cost grows ~0.7 plain steps per
# draft, so one draft is the best k at every acceptance the bundled head reaches (benchmarks/results/README.md,
# speculative decoding); the GPUs' k is not measured yet (3, what MTP and EAGLE engines use on GPUs)
DEFAULT_DRAFTS = 3
DEFAULT_DRAFTS_BY_BACKEND = {"cpu": 1}


def default_drafts(backend: str) -> int:
    """Drafted tokens per speculative step when a request does not say (speculative=None or True)."""
    return DEFAULT_DRAFTS_BY_BACKEND.get(str(backend), DEFAULT_DRAFTS)


def parse_flag(text: str) -> bool | int | None:
    """`auto` -> None, `on` -> True, `off` -> False, `K` -> K (1..MAX_DRAFTS); ValueError naming the valid values."""
    t = str(text).strip().lower()
    named = {"auto": None, "on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
    if t in named:
        return named[t]
    if t.isdigit() and 1 <= int(t) <= MAX_DRAFTS:
        return int(t)
    raise ValueError(f"expected {FLAG_VALUES} (drafted tokens per step), got {text!r}")


def describe(value: bool | int | None) -> str:
    """The flag spelling of a value: auto, on, off or K."""
    return "auto" if value is None else "on" if value is True else "off" if value is False else str(int(value))


def request_value(value: Any) -> tuple[bool, bool | int | None]:
    """A request body's `speculative` -> (valid, value): null (the server's default), true, false, an integer
    1..MAX_DRAFTS, or the flag words "auto" / "on" / "off"."""
    if value is None or isinstance(value, bool):
        return True, value
    if isinstance(value, int) and 1 <= value <= MAX_DRAFTS:
        return True, value
    if isinstance(value, str) and value.strip().lower() in ("auto", "on", "off"):
        return True, parse_flag(value)
    return False, None


REQUEST_VALUES = (f"true (draft with the model's MTP head), false (plain decoding), an integer 1..{MAX_DRAFTS} (the "
                  f"drafted tokens per step) or null (the server's default)")


def drafts(model: Any) -> bool:
    """Whether the model's engine runs an MTP head (speculative decoding is possible)."""
    return bool(getattr(getattr(model, "engine", None), "has_mtp", False))


def no_head_reason(model: Any) -> str | None:
    """Why the model cannot draft (None when it can)."""
    if drafts(model):
        return None
    if getattr(model, "mtp", None) is not None:
        return f"the model has a head, but backend {getattr(model, 'backend', '?')!r} does not run it yet"
    return ("the model has no MTP head (its checkpoint has no mtp.* tensors, as mlx-community exports, or none was "
            "asked for)")


def no_head_message(what: str, model: Any, load_hint: str, otherwise: str | None = None) -> str:
    """`what` (e.g. "speculative=true") cannot run on `model`: why, and how to get a head. load_hint: how this
    surface loads one (e.g. "start the server with `lily serve --mtp SOURCE`"); otherwise: the other way out."""
    reason = no_head_reason(model) or "?"
    if getattr(model, "mtp", None) is not None:
        fix = "load the model on a backend that runs the head (--backend cpu does)"
    else:
        fix = (f"{load_hint}, SOURCE being a folder, .safetensors file or Hugging Face repo that holds the head "
               f"({HEAD_SOURCE_HINT})")
    return (f"{what} needs the model's MTP head (speculative decoding drafts with it), and {reason}. To draft, "
            f"{fix}" + (f"; or {otherwise}" if otherwise else ""))


def head_summary(model: Any, default: bool | int | None = None) -> str:
    """One line for startup messages and /health: whether requests draft, and with what."""
    reason = no_head_reason(model)
    if reason is not None:
        return f"off: {reason}"
    mtp = getattr(model, "mtp", None)
    head = f"MTP head from {mtp.source}" if mtp is not None else "MTP head"
    if default is False:
        return f"off by default, on for requests that ask ({head})"
    k = default_drafts(model.backend) if default is None or default is True else int(default)
    return (f"{'auto' if default is None else 'on'}, {k} drafted token{'s' if k != 1 else ''} per step, plain steps "
            f"where drafting does not pay ({head})")
