"""Sampling: `SamplingParams` (validated options) and `Sampler` (NumPy, one float32 logits row per step).

Order of operations (HF / vLLM): logit bias -> repetition penalty (prompt + generated tokens) ->
presence / frequency penalties (generated tokens) -> temperature -> top-k -> top-p -> min-p -> draw from
a seeded `np.random.Generator`. Temperature 0 is greedy argmax of the biased, penalised logits.
Logprobs are the log-softmax of the raw logits (before bias, penalties and temperature), as in vLLM.

A `constraint` (e.g. a grammar, lily.server.grammar) masks the processed logits before the filters: its
`mask(x)` returns the row with disallowed tokens at -inf, and `accept(token)` advances it.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from .errors import LilyError

MAX_TOP_LOGPROBS = 20
# top-p first looks at this many best candidates and sorts the whole row only when they do not reach top_p
_TOP_P_CANDIDATES = 1024
# ... and on rows longer than this it finds the nucleus with a mass histogram instead of the full sort
_NUCLEUS_HISTOGRAM_MIN = 32 * 1024
_NUCLEUS_BINS = 4096


def _top_k_pool(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of x (any order). A mask is a quarter of an argpartition over 248k
    entries, so the row is narrowed to a pool first: the entries within 8 of the max (a peaked row: a few);
    else, on a long row, the entries at or above the k-th largest of its 64-entry block maxima (k distinct
    blocks reach that value, so the pool holds the top k whatever the row's shape); else a widening
    threshold below the max."""
    m = x.max()
    pool = np.flatnonzero(x >= m - 8.0)
    n = x.size
    if pool.size > max(4096, 64 * k) and n >= 64 * k:  # a flat row: narrow by the block maxima
        full = n // 64 * 64
        bm = x[:full].reshape(-1, 64).max(axis=1)
        if full < n:
            bm = np.append(bm, x[full:].max())
        tau = np.partition(bm, bm.size - k)[bm.size - k]
        pool = np.flatnonzero(x >= tau)
    delta = 8.0
    while pool.size < k and delta != np.inf:
        delta = delta * 4 if delta < 1e6 else np.inf
        pool = np.flatnonzero(x >= m - delta)
    if pool.size < k:  # fewer than k entries compare at all (NaN): the old full partition
        return np.argpartition(x, x.size - k)[x.size - k:]
    if pool.size > k:
        pool = pool[np.argpartition(x[pool], pool.size - k)[pool.size - k:]]
    return pool


class SamplingParamsError(LilyError, ValueError):
    """A sampling option is outside its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """Options of one generation. Neutral defaults: plain sampling at temperature 1 over the whole vocab.

    top_k <= 0 disables top-k; top_p = 1 and min_p = 0 disable those filters; repetition_penalty = 1 and
    presence/frequency penalties = 0 disable the penalties. seed=None draws fresh OS entropy.
    max_tokens=None generates until a stop condition or the end of the context window.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        # normalise containers so a frozen instance is hashable-ish and never aliases caller data
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()})
        self.validate()

    def validate(self) -> None:
        def bad(name: str, expected: str) -> None:
            raise SamplingParamsError(f"[SamplingParams] {name}={getattr(self, name)!r} is invalid: "
                                      f"expected {expected}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or math.isnan(v):
                bad(name, "a number")
            return float(v)

        if not 0.0 <= number("temperature") or math.isinf(self.temperature):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            bad("top_k", "an integer (<= 0 disables top-k)")
        if not 0.0 < number("top_p") <= 1.0:
            bad("top_p", "0 < top_p <= 1 (1 disables top-p)")
        if not 0.0 <= number("min_p") <= 1.0:
            bad("min_p", "0 <= min_p <= 1 (0 disables min-p)")
        if not 0.0 < number("repetition_penalty") or math.isinf(self.repetition_penalty):
            bad("repetition_penalty", "a finite number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                bad(name, "-2 <= value <= 2 (0 disables it)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or self.seed < 0):
            bad("seed", "None or an integer >= 0")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, (int, np.integer))
                                            or self.max_tokens < 1):
            bad("max_tokens", "None or an integer >= 1")
        if not isinstance(self.logprobs, bool):
            bad("logprobs", "True or False")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, (int, np.integer)) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"an integer 0..{MAX_TOP_LOGPROBS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(f"[SamplingParams] stop={self.stop!r} is invalid: expected "
                                          f"non-empty strings")
        for t in self.stop_token_ids:
            if t < 0:
                bad("stop_token_ids", "token ids >= 0")
        for k, v in (self.logit_bias or {}).items():
            if k < 0 or not -100.0 <= v <= 100.0:
                raise SamplingParamsError(f"[SamplingParams] logit_bias entry {k}: {v} is invalid: expected "
                                          f"token id >= 0 and bias -100..100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def draw_options(self) -> dict[str, Any]:
        """The draw's options as the engine's keyword arguments (lily._lily Engine.open_stream, sample_draw)."""
        bias = self.logit_bias or {}
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, bias_ids=[int(k) for k in bias],
                    bias_vals=[float(v) for v in bias.values()])

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the options must exist in a vocab of vocab_size rows."""
        for name, ids in (("logit_bias", list((self.logit_bias or {}).keys())),
                          ("stop_token_ids", list(self.stop_token_ids))):
            for t in ids:
                if t >= vocab_size:
                    raise SamplingParamsError(f"[SamplingParams] {name} names token id {t}: expected ids "
                                              f"0..{vocab_size - 1} (the model's vocab)")


# ---- the options of one request, declared once -------------------------------------------------------------
# name -> (annotation, default) of each sampling keyword that generate() takes (Model.generate, Session.generate,
# through `takes_sampling_options`) and `resolve_sampling` turns into SamplingParams; None = not set by the user
SAMPLING_OPTIONS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("int | None", None),
    "temperature": ("float | None", None),
    "top_p": ("float | None", None),
    "top_k": ("int | None", None),
    "min_p": ("float | None", None),
    "repetition_penalty": ("float | None", None),
    "presence_penalty": ("float | None", None),
    "frequency_penalty": ("float | None", None),
    "seed": ("int | None", None),
    "stop": ("str | Sequence[str] | None", None),
    "stop_token_ids": ("Sequence[int] | None", None),
    "logprobs": ("bool | int", False),
    "top_logprobs": ("int | None", None),
    "logit_bias": ("Mapping[int, float] | None", None),
}
# the options a checkpoint's generation_config.json may set (HF names == ours)
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                          "frequency_penalty")


def split_sampling_options(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """kwargs -> (the sampling options among them, the rest)."""
    options = {k: v for k, v in kwargs.items() if k in SAMPLING_OPTIONS}
    return options, {k: v for k, v in kwargs.items() if k not in SAMPLING_OPTIONS}


def takes_sampling_options(fn: Callable) -> Callable:
    """Decorator for a function that takes the SAMPLING_OPTIONS in its **kwargs: its signature (help(),
    inspect) lists them as keyword-only parameters, before its own keyword-only ones."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    at = next((i for i, q in enumerate(params) if q.kind in (q.KEYWORD_ONLY, q.VAR_KEYWORD)), len(params))
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
               for name, (annotation, default) in SAMPLING_OPTIONS.items()]
    fn.__signature__ = sig.replace(parameters=params[:at] + options + params[at:])
    return fn


def resolve_sampling(generation_config: Mapping[str, Any] | None, **options: Any) -> SamplingParams:
    """User options (SAMPLING_OPTIONS) over the checkpoint's generation_config.json over neutral defaults
    (vLLM's "auto").

    logprobs may be an int (OpenAI completions style): logprobs=5 means the sampled token's logprob plus
    the 5 best alternatives.
    """
    unknown = [k for k in options if k not in SAMPLING_OPTIONS]
    if unknown:
        raise TypeError(f"resolve_sampling() got an unexpected keyword argument {unknown[0]!r}")
    o = {name: options.get(name, default) for name, (_, default) in SAMPLING_OPTIONS.items()}
    gc = dict(generation_config or {})
    defaults: dict[str, Any] = {k: gc[k] for k in GENERATION_CONFIG_KEYS if gc.get(k) is not None}
    if gc.get("do_sample") is False:
        defaults["temperature"] = 0.0
    opts = {**defaults, **{k: o[k] for k in GENERATION_CONFIG_KEYS if o[k] is not None}}
    if "top_k" in opts and opts["top_k"] is not None:
        opts["top_k"] = int(opts["top_k"]) if not isinstance(opts["top_k"], bool) else opts["top_k"]
    n_top = o["top_logprobs"]
    want = o["logprobs"]
    if isinstance(want, int) and not isinstance(want, bool):
        n_top = want if n_top is None else n_top
        want = True
    return SamplingParams(**opts, seed=o["seed"], stop=o["stop"], stop_token_ids=tuple(o["stop_token_ids"] or ()),
                          max_tokens=o["max_tokens"], logprobs=bool(want) or bool(n_top),
                          top_logprobs=int(n_top or 0), logit_bias=o["logit_bias"])


class TokenConstraint(Protocol):
    """What `Sampler` needs of a constrained-decoding mask (a grammar matcher)."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The float32 [vocab] row with every token the constraint forbids set to -inf."""

    def accept(self, token: int) -> None:
        """Advance past the sampled token."""


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top alternatives (log-softmax of the raw logits)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=False)
    m = np.max(x)
    return (x - m - np.log(np.sum(np.exp(x - m)))).astype(np.float32)


class Sampler:
    """Applies `SamplingParams` to one logits row per step; tracks token counts for the penalties.

    sampler = Sampler(params, vocab_size, prompt_tokens)
    token = sampler.sample(logits_row)   # also records `token` as generated
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_tokens: Iterable[int] = (),
                 constraint: TokenConstraint | None = None):
        params.check_vocab(vocab_size)
        self.params = params
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        self.rng = np.random.default_rng(params.seed)
        self._bias_ids = self._bias_vals = None
        if params.logit_bias:
            self._bias_ids = np.fromiter(params.logit_bias.keys(), np.int64)
            self._bias_vals = np.fromiter(params.logit_bias.values(), np.float32)
        self._needs_rep = params.repetition_penalty != 1.0
        self._needs_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        # token ids seen in prompt or output (repetition penalty); counts over the output only
        self._seen = np.zeros(self.vocab_size, bool)
        self._counts = np.zeros(self.vocab_size, np.int32)
        prompt = np.asarray(list(prompt_tokens), np.int64)
        if prompt.size:
            self._seen[prompt[(prompt >= 0) & (prompt < self.vocab_size)]] = True

    # ---- pieces, each a pure function of a logits row (exposed for tests) -------------------------
    def process(self, logits: np.ndarray) -> np.ndarray:
        """Bias and penalties applied: float32 [vocab] (a copy)."""
        x = np.array(logits, np.float32, copy=True).reshape(-1)
        if x.shape[0] != self.vocab_size:
            raise ValueError(f"[Sampler] logits row has {x.shape[0]} entries, expected vocab_size {self.vocab_size}")
        p = self.params
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if self._needs_rep:
            ids = np.flatnonzero(self._seen)
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._needs_counts:
            ids = np.flatnonzero(self._counts)
            c = self._counts[ids].astype(np.float32)
            x[ids] -= p.frequency_penalty * c + p.presence_penalty
        return x

    def candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Temperature, top-k, top-p, min-p on processed logits -> (token ids, probabilities summing to 1).

        The best token first when top-p is active; otherwise in no particular order.
        """
        ids, weights = self._weights(x)
        return (np.arange(x.shape[0]) if ids is None else ids), weights / weights.sum()

    def _weights(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(token ids or None for the whole row, unnormalised probabilities) after the filters."""
        p = self.params
        n = x.shape[0]
        # temperature keeps the order, so top-k picks on the float32 row; the maths runs in float64
        pool = _top_k_pool(x, p.top_k) if 0 < p.top_k < n else None
        rest = 0.0  # probability mass (unnormalised) of the row outside the pool, for the top-p total
        if pool is None and (p.top_p < 1.0 or p.min_p > 0.0):
            pool, rest = self._likely_pool(x)
        zp = (x if pool is None else x[pool]).astype(np.float64)
        zp -= zp.max()
        if p.temperature != 1.0:
            zp *= 1.0 / p.temperature
        e = np.exp(zp, out=zp)
        keep = None  # indices into e; None = all
        if p.top_p < 1.0:
            keep = self._nucleus(e, e.sum() + rest)
        if p.min_p > 0.0:
            threshold = p.min_p * (1.0 if keep is None else e[keep[0]])  # the best token has e == 1
            keep = np.flatnonzero(e >= threshold) if keep is None else keep[e[keep] >= threshold]
        if keep is None:
            return pool, e
        return (keep if pool is None else pool[keep]), e[keep]

    def _likely_pool(self, x: np.ndarray) -> tuple[np.ndarray | None, float]:
        """Tokens sure to hold the top-p and min-p sets, and the mass of the others (relative to the best
        token's 1), from a float32 pass over the row: a float64 exp of a 248k row costs ~8x a float32 one, and
        only the few likely tokens need float64. None when no cheap pool qualifies (a flat row)."""
        p = self.params
        m = x.max()
        e32 = np.exp((x - m) * np.float32(1.0 / p.temperature))
        total = float(e32.sum(dtype=np.float64))
        for tau in (1e-4, 1e-8):
            if p.min_p > 0.0 and tau > 0.5 * p.min_p:  # min-p keeps every token with e >= min_p
                continue
            pool = np.flatnonzero(e32 >= tau)
            mass = float(e32[pool].sum(dtype=np.float64))
            # every token outside the pool is below all inside it, so once the pool holds top_p of the mass
            # (with room for float32 rounding) the nucleus lies inside it
            if p.top_p >= 1.0 or mass >= p.top_p * total * (1 + 1e-5):
                return pool, max(total - mass, 0.0)
        return None, 0.0

    def _nucleus(self, e: np.ndarray, total: float) -> np.ndarray:
        """Indices into e (unnormalised probabilities) of the top-p set, the best first (min-p reads it). Sorts
        only the best few when they already hold top_p of the mass (the usual case for a language model); a
        long flat row goes by histogram (`_nucleus_by_histogram`)."""
        top_p = self.params.top_p
        if e.size > _NUCLEUS_HISTOGRAM_MIN:  # a long row here is a flat one (the likely pool did not narrow it)
            return self._nucleus_by_histogram(e, total)
        order = None
        for m in (_TOP_P_CANDIDATES, 16 * _TOP_P_CANDIDATES):
            if e.size <= 2 * m:
                break
            part = np.argpartition(e, e.size - m)[e.size - m:]
            if e[part].sum() >= top_p * total * (1 + 1e-9):
                order = part[np.argsort(-e[part])]
                break
        if order is None:
            order = np.argsort(-e)
        probs = e[order] / total
        mass_before = np.cumsum(probs) - probs
        return order[:max(int(np.count_nonzero(mass_before < top_p)), 1)]

    def _nucleus_by_histogram(self, e: np.ndarray, total: float) -> np.ndarray:
        """The top-p set of a flat row without sorting it: a mass histogram over -log e (4,096 bins) finds the
        bin where the cumulative mass from the top reaches top_p; every token above that bin is in, every token
        below is out, and only that bin is sorted. Returns the best token first, the others in index order."""
        target = self.params.top_p * total
        # float32 bins are enough: rounding is monotone, so a larger e never lands in a later bin, and the one
        # bin that is cut is sorted on the float64 e
        lg = np.log(e.astype(np.float32))  # <= 0, 0 at the best token (-inf for e == 0)
        lo = float(lg.min())
        if not np.isfinite(lo):  # some weights underflowed to 0: they go to the last bin
            lo = float(np.min(lg, initial=0.0, where=np.isfinite(lg)))
        width = max(-lo, 1e-12) / (_NUCLEUS_BINS - 2)
        b = np.minimum(lg * np.float32(-1.0 / width), np.float32(_NUCLEUS_BINS - 1)).astype(np.int32)
        cum = np.cumsum(np.bincount(b, weights=e, minlength=_NUCLEUS_BINS))
        cut = min(int(np.searchsorted(cum, target, side="left")), _NUCLEUS_BINS - 1)
        before = float(cum[cut - 1]) if cut > 0 else 0.0
        edge = np.flatnonzero(b == cut)
        edge = edge[np.argsort(-e[edge], kind="stable")]
        edge = edge[before + np.cumsum(e[edge]) - e[edge] < target]
        keep = np.concatenate([np.flatnonzero(b < cut), edge])
        best = int(np.argmax(e))
        return np.concatenate([[best], keep[keep != best]]) if keep.size else np.array([best])

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from one logits row ([vocab] or [1, vocab]) and record it as generated."""
        x = self.process(logits)
        if self.constraint is not None:
            x = self.constraint.mask(x)
            if not np.isfinite(x.max()):
                raise LilyError("[Sampler] the constraint (grammar) allows no token at this step: the "
                                "grammar cannot continue the text generated so far")
        if self.params.greedy:
            token = int(np.argmax(x))
        else:
            ids, weights = self._weights(x)
            i = self._draw(weights)
            token = i if ids is None else int(ids[i])
        self.accept(token)
        return token

    def _draw(self, w: np.ndarray, block: int = 1024) -> int:
        """Index drawn with probability w / w.sum(). Two levels (block sums, then one block's cumsum)
        because a cumsum over a 248k row costs more than everything else in a sampling step."""
        r = self.rng.random()
        if w.size <= 4 * block:
            cdf = np.cumsum(w)
            return min(int(np.searchsorted(cdf, r * cdf[-1], side="right")), w.size - 1)
        full = w.size // block * block
        sums = w[:full].reshape(-1, block).sum(axis=1)
        if full < w.size:
            sums = np.append(sums, w[full:].sum())
        cdf = np.cumsum(sums)
        target = r * cdf[-1]
        b = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
        target -= cdf[b - 1] if b > 0 else 0.0
        inner = np.cumsum(w[b * block:(b + 1) * block])
        return b * block + min(int(np.searchsorted(inner, target, side="right")), inner.size - 1)

    def accept(self, token: int) -> None:
        """Record a generated token (for the penalties and the constraint)."""
        if self.constraint is not None:
            self.constraint.accept(token)
        if 0 <= token < self.vocab_size:
            self._seen[token] = True
            self._counts[token] += 1

    def logprobs(self, logits: np.ndarray, token: int) -> TokenLogprobs:
        """Log-softmax of the raw logits: the chosen token's logprob and the top_logprobs best."""
        x = np.asarray(logits, np.float32).reshape(-1)
        m = float(x.max())
        log_z = m + math.log(float(np.exp(x - m).sum(dtype=np.float64)))
        top: dict[int, float] = {}
        n = self.params.top_logprobs
        if n > 0:
            ids = np.argpartition(x, x.size - n)[x.size - n:]
            ids = ids[np.argsort(-x[ids], kind="stable")]
            top = {int(i): float(x[i]) - log_z for i in ids}
        return TokenLogprobs(int(token), float(x[token]) - log_z, top)


# ---- sampling on the device (csrc/cuda/sample.cu) ------------------------------------------------------

def device_sampling_supported(params: SamplingParams, constraint: object = None) -> bool:
    """Whether the device sampler covers these options: everything except a constraint (a grammar mask
    runs on the host) and logprobs (they need the logits row on the host anyway)."""
    return constraint is None and not params.logprobs


_M64 = (1 << 64) - 1


def stream_uniforms(seed: int, n: int) -> list[float]:
    """The uniform numbers of a device-mode token stream opened with `seed` (csrc/core/engine.cpp
    TokenStream::next_uniform, splitmix64): the i-th is the draw of the stream's i-th step, 24 random bits."""
    state = (int(seed) * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) & _M64
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        out.append((z >> 40) / 16777216.0)
    return out


def device_sample_reference(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None,
                            counts: np.ndarray | None, uniform: float) -> int:
    """The NumPy twin of the device sampler (float64; csrc/cuda/sample.cuh states the semantics): same
    processed logits as `Sampler.process`, same kept set as `Sampler._weights` except that ties at the top-k
    or top-p boundary are all kept, and the token is the first index (vocab order) whose inclusive cumulative
    kept weight exceeds uniform * total (the host sampler walks its candidates in another order)."""
    x = np.array(logits, np.float64).reshape(-1)
    p = params
    for k, v in (p.logit_bias or {}).items():
        x[k] += v
    if p.repetition_penalty != 1.0 and seen is not None:
        s = np.asarray(seen, bool)
        x[s] = np.where(x[s] > 0, x[s] / p.repetition_penalty, x[s] * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and counts is not None:
        c = np.asarray(counts, np.float64)
        x -= np.where(c > 0, p.frequency_penalty * c + p.presence_penalty, 0.0)
    if p.greedy:
        return int(np.argmax(x))
    m = x.max()
    w = np.exp((x - m) / p.temperature)
    keep = np.ones(x.size, bool)
    if 0 < p.top_k < x.size:
        keep &= x >= np.sort(x)[x.size - p.top_k]
    if p.top_p < 1.0:
        kept_mass = w[keep].sum()
        vals = np.unique(x[keep])[::-1]                    # distinct kept values, best first
        mass_at = np.array([w[keep & (x == v)].sum() for v in vals]) if vals.size < 4096 else None
        if mass_at is None:                                 # many distinct values: group by sorting
            order = np.argsort(-x[keep], kind="stable")
            xs, ws = x[keep][order], w[keep][order]
            starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
            vals, mass_at = xs[starts], np.add.reduceat(ws, starts)
        above = np.cumsum(mass_at) - mass_at               # kept mass strictly above each value
        cut = vals[above < p.top_p * kept_mass].min()
        keep &= x >= cut
    if p.min_p > 0.0:
        keep &= w >= p.min_p
    cdf = np.cumsum(np.where(keep, w, 0.0))
    i = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(keep)[-1]))
