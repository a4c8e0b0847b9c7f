"""Sampling: `SamplingParams` (validated options) and `Sampler` (NumPy, one float32 logits row per step).

One semantics on every backend: the host `Sampler` here and the device samplers (csrc/cuda/sample.cu, the spec of
the rule; metal/sample.metal; the CPU backend's test twin csrc/core/sampling.cpp) draw the same token from the same
row, so one seed gives one text wherever the draws run:
  the options are the float32 values every device receives (lily._lily SampleOptions): T, top_p, min_p and the
  penalties rounded to float32, so top_p=0.9 is 0.89999998 everywhere and a top_p that rounds to 1 is off;
  x = logits + logit_bias; repetition penalty on tokens of the prompt or output (x/rp if x > 0 else x*rp);
  x -= frequency * count + presence on generated tokens (HF / vLLM order); each of these a float32 operation,
  rounded once (no fused multiply-add);
  greedy (T = 0, or a T whose float32 reciprocal overflows: below 2.9e-39): argmax x, the lowest index on ties;
  else w = exp((x - max x) / T); kept = top-k by x (ties at the k-th value all kept), then top-p on the kept (a
  value stays while the kept mass strictly above it is < top_p of the kept mass; ties kept), then min-p
  (w >= min_p, w relative to the row's best token: 1); the token is the first index i (vocab order) whose
  inclusive cumulative kept weight exceeds u * total, u being the step's number of the splitmix64 sequence of the
  seed (`stream_uniform`, the engine's TokenStream::next_uniform).
The processed row x, and so every tie and every cut by value, is bit-identical on every backend; the weights and
their sums are float64 here and in the CPU twin (the same operations), float32 on CUDA and Metal, so a device's
draw can differ from the host's only where u, or a top-p / min-p threshold, lies within float32 rounding of a step
(the tests' CDF_TOL, lily.testing.stream_checks).
Logprobs are the log-softmax of the raw logits (before bias, penalties and temperature), as in vLLM.

A `constraint` (e.g. a grammar, lily.server.grammar) masks the processed logits before the filters: its
`mask(x)` returns the row with disallowed tokens at -inf, and `accept(token)` advances it.
"""
from __future__ import annotations

import inspect
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from .errors import LilyError

MAX_TOP_LOGPROBS = 20
# top-p on more candidates than this finds its cut with a mass histogram instead of sorting them all
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


def _max_drafts() -> int:
    """Drafted tokens per speculative step at most: the extension's Engine::kMaxDrafts (8 for the pure-Python
    reference engine, which does not draft)."""
    try:
        from . import _lily
        return int(_lily.MAX_DRAFTS)
    except (ImportError, AttributeError):
        return 8


MAX_DRAFTS = _max_drafts()


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
    # speculative decoding with the model's MTP head (lily.session): None = on when the model has a head and the
    # request allows it, False = off, True = on (an error without a head), k = on with k drafted tokens per step
    speculative: bool | int | None = None

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

        # finite also as float32, the value the device samplers receive (above 3.4e38 it would be inf there)
        if not 0.0 <= number("temperature") or not _finite_f32(self.temperature):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            bad("top_k", "an integer (<= 0 disables top-k)")
        # top_p and repetition_penalty also as float32, as the engine checks them (open_stream)
        if not 0.0 < number("top_p") <= 1.0 or not np.float32(self.top_p) > 0:
            bad("top_p", "0 < top_p <= 1 (1 disables top-p)")
        if not 0.0 <= number("min_p") <= 1.0:
            bad("min_p", "0 <= min_p <= 1 (0 disables min-p)")
        if not 0.0 < number("repetition_penalty") or not _finite_f32(self.repetition_penalty) \
                or not np.float32(self.repetition_penalty) > 0:
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
        if self.speculative is not None and not isinstance(self.speculative, bool) and (
                not isinstance(self.speculative, (int, np.integer)) or not 1 <= self.speculative <= MAX_DRAFTS):
            bad("speculative", f"None (automatic), True, False or the drafted tokens per step, 1..{MAX_DRAFTS}")
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
    "speculative": ("bool | int | None", None),
}
# the options a checkpoint's generation_config.json may set (HF names == ours)
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                          "frequency_penalty")
# The adapters (the CLI's flags, the OpenAI and Responses request fields, Ollama's `options`) take each option
# under its SAMPLING_OPTIONS name, Ollama's two renames aside (lily.server.ollama). RULE_OPTIONS: those every API
# takes: the rule's own, the seed, stop strings and speculation (ids, biases, logprobs are OpenAI's extras).
RULE_OPTIONS = (*GENERATION_CONFIG_KEYS, "seed", "stop", "speculative")


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
                          top_logprobs=int(n_top or 0), logit_bias=o["logit_bias"], speculative=o["speculative"])


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
    """Applies `SamplingParams` to one logits row per step; tracks token counts for the penalties and the step's
    uniform number.

    sampler = Sampler(params, vocab_size, prompt_tokens)
    token = sampler.sample(logits_row)   # also records `token` as generated
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_tokens: Iterable[int] = (),
                 constraint: TokenConstraint | None = None):
        params.check_vocab(vocab_size)
        self.params = params
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        # the uniform numbers: draw i takes stream_uniform(seed, i); seed=None takes 64 bits of OS entropy
        self.seed = int(params.seed) & _M64 if params.seed is not None else secrets.randbits(64)
        self.draws = 0
        self._bias_ids = self._bias_vals = None
        if params.logit_bias:
            self._bias_ids = np.fromiter(params.logit_bias.keys(), np.int64)
            self._bias_vals = np.fromiter(params.logit_bias.values(), np.float32)
        # The options as the device samplers receive them (SampleOptions holds float32; csrc/core/sampling.h): the
        # host computes with the same values, so a threshold at top_p = 0.9 is 0.89999998 * mass here as there,
        # a top_p that rounds to 1 (or a min_p that rounds to 0) is off on every backend, and T is the float32 T.
        self._rep, self._pres, self._freq = (np.float32(v) for v in (
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty))
        self._top_p, self._min_p = float(np.float32(params.top_p)), float(np.float32(params.min_p))
        t = np.float32(params.temperature)
        with np.errstate(divide="ignore", over="ignore"):
            inv32 = np.float32(1.0) / t if t > 0 else np.float32(np.inf)
        # greedy: T = 0, and a T so small that the devices' float32 1/T overflows (below 2.9e-39): their weights are
        # then NaN at the max and 0 elsewhere, which their kernels count as no weight at all and fall back to the
        # argmax (csrc/cuda/sample.cu: `none_token`, s.token = am); the host takes the argmax directly
        self._greedy = not bool(np.isfinite(inv32))
        self._inv_t = 1.0 / float(t) if not self._greedy else 1.0  # float64 1/T of the float32 T
        self._inv_t32 = inv32 if not self._greedy else np.float32(1.0)
        self._needs_rep = self._rep != 1.0
        self._needs_counts = self._pres != 0.0 or self._freq != 0.0
        # token ids seen in prompt or output (repetition penalty) [vocab]; counts over the output only [vocab]
        self.seen = np.zeros(self.vocab_size, bool)
        self.counts = np.zeros(self.vocab_size, np.int32)
        prompt = np.asarray(list(prompt_tokens), np.int64)
        if prompt.size:
            self.seen[prompt[(prompt >= 0) & (prompt < self.vocab_size)]] = True

    def stream_seed(self) -> int:
        """The seed of an engine token stream that continues this sampler's uniform numbers: a stream opened with
        seed s draws with stream_uniform(s, j) at its step j, which is stream_uniform(s - d, d + j) (splitmix64
        adds one constant per number), so the device's draws are the ones this sampler would make next."""
        return (self.seed + self.draws) & _M64

    # ---- pieces, each a pure function of a logits row (exposed for tests) -------------------------
    def process(self, logits: np.ndarray) -> np.ndarray:
        """Bias and penalties applied: float32 [vocab] (a copy). Every step a float32 operation rounded once, as on
        the devices (CUDA's product and sum of the penalty are __fmul_rn / __fadd_rn: no fused multiply-add), so
        the processed row, and with it every tie at a top-k or top-p cut, is bit-identical on every backend."""
        x = np.array(logits, np.float32, copy=True).reshape(-1)
        if x.shape[0] != self.vocab_size:
            raise ValueError(f"[Sampler] logits row has {x.shape[0]} entries, expected vocab_size {self.vocab_size}")
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if self._needs_rep:
            ids = np.flatnonzero(self.seen)
            v = x[ids]
            x[ids] = np.where(v > 0, v / self._rep, v * self._rep)
        if self._needs_counts:
            ids = np.flatnonzero(self.counts)
            c = self.counts[ids].astype(np.float32)
            x[ids] -= self._freq * c + self._pres  # float32 operands: the product rounded, then the sum
        return x

    def candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Temperature, top-k, top-p, min-p on processed logits [vocab] -> (the kept token ids in vocab order, their
        probabilities summing to 1): the draw walks them in this order. Greedy: the argmax alone."""
        if self._greedy:
            return np.array([int(np.argmax(x))]), np.ones(1)
        ids, weights = self._kept(x)
        return (np.arange(x.shape[0]) if ids is None else ids), weights / weights.sum()

    def _exponent(self, xv: np.ndarray, m: np.float32) -> np.ndarray:
        """a = (x - m) * (1/T), float64 [n], of the float32 row, its float32 max and the float32 T; the weight is exp(a).
        The CPU twin forms it with the same float64 operations (bit-identical); CUDA and Metal in float32 (a within
        float32 rounding of this, as their exp is)."""
        a = xv.astype(np.float64)
        a -= np.float64(m)
        if self._inv_t != 1.0:
            a *= self._inv_t
        return a

    def _kept(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(kept token ids in vocab order, or None for the whole row; their weights exp(a), a = (x - max x) * (1/T),
        float64 (`_exponent`))."""
        p = self.params
        n = x.shape[0]
        m = x.max()
        if m == -np.inf:  # no entry above -inf: token 0, as the devices' argmax of such a row
            return np.zeros(1, np.int64), np.ones(1)
        rest = 0.0  # weight of the row outside the pool, for the top-p total
        if 0 < p.top_k < n:
            # the k largest, then every entry tied with the k-th (temperature keeps the order: picked on x)
            pool = np.flatnonzero(x >= x[_top_k_pool(x, p.top_k)].min())
        elif self._top_p < 1.0 or self._min_p > 0.0:
            pool, rest = self._likely_pool(x)
        else:
            pool = None
        xv = x if pool is None else x[pool]
        w = np.exp(self._exponent(xv, m))
        keep = None  # mask over xv; None = all
        if self._top_p < 1.0:
            keep = xv >= _top_p_cut(xv, w, self._top_p * (w.sum() + rest))
        if self._min_p > 0.0:  # the row's best token has w == 1 and is always kept
            keep = w >= self._min_p if keep is None else keep & (w >= self._min_p)
        if keep is None:
            return pool, w
        at = np.flatnonzero(keep)
        return (at if pool is None else pool[at]), w[at]

    def _likely_pool(self, x: np.ndarray) -> tuple[np.ndarray | None, float]:
        """Tokens sure to hold the top-p and min-p sets (in vocab order), and the weight of the others (relative to
        the best token's 1), from a float32 pass over the row: a float64 exp of a 248k row costs ~8x a float32 one,
        and only the few likely tokens need float64. None when no cheap pool qualifies (a flat row)."""
        e32 = np.exp((x - x.max()) * self._inv_t32)  # float32: this pass only picks the pool
        total = float(e32.sum(dtype=np.float64))
        for tau in (1e-4, 1e-8):
            if self._min_p > 0.0 and tau > 0.5 * self._min_p:  # min-p keeps every token with w >= min_p
                continue
            pool = np.flatnonzero(e32 >= tau)
            mass = float(e32[pool].sum(dtype=np.float64))
            # the pool is every value above a threshold, so once it holds top_p of the mass (with room for float32
            # rounding) the kept mass strictly above any value outside it is >= top_p: the cut lies inside it
            if self._top_p >= 1.0 or mass >= self._top_p * total * (1 + 1e-5):
                return pool, max(total - mass, 0.0)
        return None, 0.0

    def choose(self, x: np.ndarray, uniform: float) -> int:
        """The token of processed (and masked) logits x [vocab] for the uniform number `uniform` in [0, 1)."""
        if self._greedy:
            return int(np.argmax(x))  # the lowest index on ties
        ids, w = self._kept(x)
        i = _vocab_order_draw(w, uniform)
        return i if ids is None else int(ids[i])

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from one logits row ([vocab] or [1, vocab]) and record it as generated. Every call
        takes the next uniform number (also when greedy), so step i draws with number i on every backend."""
        x = self.process(logits)
        if self.constraint is not None:
            x = self.constraint.mask(x)
            if not np.isfinite(x.max()):
                raise LilyError("[Sampler] the constraint (grammar) allows no token at this step: the "
                                "grammar cannot continue the text generated so far")
        token = self.choose(x, stream_uniform(self.seed, self.draws))
        self.draws += 1
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Record a generated token (for the penalties and the constraint)."""
        if self.constraint is not None:
            self.constraint.accept(token)
        if 0 <= token < self.vocab_size:
            self.seen[token] = True
            self.counts[token] += 1

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


def _top_p_cut(xv: np.ndarray, w: np.ndarray, target: float) -> np.floating:
    """The smallest value of xv (float32 [n]) whose weight strictly above it (w: float64 [n]) is below target: top-p
    keeps xv >= it (ties kept; the largest value always). A long row goes by a mass histogram over -log w: every bin
    before the one where the cumulative weight reaches the target is in, every bin after it out, and only that bin
    is sorted (rounding is monotone, so a larger w never lands in a later bin; equal values share a bin)."""
    if xv.size <= _NUCLEUS_HISTOGRAM_MIN:
        before, edge = 0.0, None
    else:
        lg = np.log(w.astype(np.float32))  # <= 0, 0 at the best token (-inf where w underflowed to 0)
        lo = float(np.min(lg, initial=0.0, where=np.isfinite(lg)))
        width = max(-lo, 1e-12) / (_NUCLEUS_BINS - 2)
        b = np.minimum(lg * np.float32(-1.0 / width), np.float32(_NUCLEUS_BINS - 1)).astype(np.int32)
        cum = np.cumsum(np.bincount(b, weights=w, minlength=_NUCLEUS_BINS))
        cut = min(int(np.searchsorted(cum, target, side="left")), _NUCLEUS_BINS - 1)
        before = float(cum[cut - 1]) if cut > 0 else 0.0
        edge = np.flatnonzero(b == cut)
    vals, ws = (xv, w) if edge is None else (xv[edge], w[edge])
    if vals.size == 0:  # the target rounded past the row's total (top_p ~ 1): everything stays
        return xv.min()
    order = np.argsort(-vals, kind="stable")
    vals, ws = vals[order], ws[order]
    starts = np.flatnonzero(np.r_[True, vals[1:] != vals[:-1]])  # each distinct value's first position
    above = before + (np.cumsum(ws) - ws)[starts]                 # the weight strictly above each distinct value
    return vals[starts[max(int(np.count_nonzero(above < target)), 1) - 1]]


def _vocab_order_draw(w: np.ndarray, uniform: float, block: int = 1024) -> int:
    """The first index i of w (float64 [n], in vocab order) whose inclusive cumulative weight exceeds uniform * total;
    past the end (rounding), the last positive one. Two levels (block sums, then one block's cumsum) because a cumsum
    over a 248k row costs more than everything else in a sampling step."""
    if w.size <= 4 * block:
        cdf = np.cumsum(w)
        i = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    else:
        full = w.size // block * block
        sums = w[:full].reshape(-1, block).sum(axis=1)
        if full < w.size:
            sums = np.append(sums, w[full:].sum())
        cdf = np.cumsum(sums)
        target = uniform * cdf[-1]
        b = min(int(np.searchsorted(cdf, target, side="right")), cdf.size - 1)
        target -= cdf[b - 1] if b > 0 else 0.0
        inner = np.cumsum(w[b * block:(b + 1) * block])
        i = b * block + min(int(np.searchsorted(inner, target, side="right")), inner.size - 1)
    if i >= w.size or w[i] <= 0.0:
        i = int(np.flatnonzero(w > 0.0)[-1]) if (w > 0.0).any() else 0
    return i


def draw_token(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None, counts: np.ndarray | None,
               uniform: float) -> int:
    """The token every lily sampler draws from logits [V] with the record seen [V] (prompt or generated) / counts
    [V] (generated; None: all zero) and the uniform number `uniform`: one step of `Sampler` (the device samplers'
    tests compare with it)."""
    x = np.asarray(logits, np.float32).reshape(-1)
    s = Sampler(params, x.size)
    if seen is not None:
        s.seen[:] = np.asarray(seen).astype(bool)
    if counts is not None:
        s.counts[:] = np.asarray(counts, np.int32)
    return s.choose(s.process(x), uniform)


# ---- the uniform numbers, and the device ------------------------------------------------------------------

def device_sampling_supported(params: SamplingParams, constraint: object = None) -> bool:
    """Whether the device sampler covers these options: everything except a constraint (a grammar mask
    runs on the host) and logprobs (they need the logits row on the host anyway)."""
    return constraint is None and not params.logprobs


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (also the seed's multiplier in the engine)


def _finite_f32(v: float) -> bool:
    """Whether v stays finite as float32 (the options' type on the devices)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(v)))


def stream_uniform(seed: int, i: int) -> float:
    """The i-th uniform number of `seed` (csrc/core/engine.cpp TokenStream::next_uniform, splitmix64: the state
    starts at seed * GOLDEN + 0x2545F4914F6CDD1D and adds GOLDEN per number): 24 random bits, exact in float32."""
    z = ((int(seed) + int(i) + 1) * _GOLDEN + 0x2545F4914F6CDD1D) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return (z >> 40) / 16777216.0


def stream_uniforms(seed: int, n: int) -> list[float]:
    """The first n uniform numbers of `seed`: the draws of a token stream opened with it, step by step."""
    return [stream_uniform(seed, i) for i in range(n)]
