"""Default memory budgets of `lily serve`, from the model's state size and the machine's free memory.

A fixed 4 GiB prefix cache let the bundled 13 MiB model's server grow to 4.3 GiB: every distinct request
leaves a few snapshots. The defaults now scale with what one state of this model costs and with what the
machine has free at startup:
  prefix cache: min(1/4 of the free memory, 4 states at the full context);
  parked requests (all slots busy, see server/worker.py): min(1/8 of the free memory, --parallel states at the
  full context).
A state is the fixed recurrent (DeltaNet + conv) part plus the KV cache of its tokens; a snapshot also keeps
one logits row. On a GPU the states live in device memory, which lily does not query: the host's free memory
stands in for it there, and --cache-gib / --park-gib set either budget exactly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

CACHE_FREE_FRACTION = 4   # the cache takes at most 1/4 of the free memory
CACHE_STATES = 4          # ... and at most this many full-context states
PARK_FREE_FRACTION = 8    # parked requests: at most 1/8 of the free memory
KV_BYTES_PER_VALUE = 4    # fp32 KV on the CPU backend (a bf16 KV is smaller: the estimate errs high)


def available_memory_bytes() -> int | None:
    """Memory the system can give without swapping (Linux MemAvailable), else the free pages; None unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def state_bytes(model: Any, tokens: int) -> int:
    """Bytes one engine state of `model` holds at `tokens` tokens of context, plus one logits row."""
    cfg = model.config
    fixed = int(model.engine.new_state().nbytes)  # recurrent + conv state (no KV yet)
    attention_layers = sum(1 for t in cfg.layer_types if t == "full_attention")
    kv_per_token = attention_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * KV_BYTES_PER_VALUE
    return fixed + kv_per_token * int(tokens) + 4 * cfg.vocab_size


@dataclass(frozen=True)
class MemoryBudgets:
    cache_bytes: int
    park_bytes: int
    how: dict[str, str]  # how each was set, for /health


def memory_budgets(model: Any, parallel: int, cache_bytes: int | None, park_bytes: int | None,
                   free_bytes: int | None = None) -> MemoryBudgets:
    """The budgets in force: the explicit ones (flags) as given, the others derived as the module says."""
    free = available_memory_bytes() if free_bytes is None else free_bytes
    full = state_bytes(model, model.max_context)

    def budget(given: int | None, flag: str, states: int, states_how: str, fraction: int) -> tuple[int, str]:
        """`given` (the flag) as it is, else `states` full-context states capped at 1/fraction of the free memory."""
        if given is not None:
            return int(given), flag
        if free is not None and free // fraction < states * full:
            return int(free // fraction), f"auto: 1/{fraction} of the {free} bytes free at startup"
        return int(states * full), f"auto: {states_how} full-context states of {full} bytes"

    cache, cache_how = budget(cache_bytes, "--cache-gib", CACHE_STATES, str(CACHE_STATES), CACHE_FREE_FRACTION)
    park, park_how = budget(park_bytes, "--park-gib", parallel, f"--parallel {parallel}", PARK_FREE_FRACTION)
    return MemoryBudgets(cache, park, {"cache": cache_how, "park": park_how})


def describe_free_memory() -> str:
    """For `lily serve --help`: the free memory now, or that it is unknown."""
    free = available_memory_bytes()
    return f"{free / 2**30:.1f} GiB free now" if free is not None else "free memory unknown here"
