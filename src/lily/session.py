"""Session: one conversation's engine state plus the tokens in it, and the decode loop.

The token loop runs in the extension (lily._lily.TokenStream): on a backend with a device sampler the device
draws each token and runs one step ahead of Python, which reads tokens as they arrive (detokenizes, checks stop
strings); elsewhere each step's logits come back and the host Sampler draws (lock-step). Ctrl-C or closing a
stream stops within one step. A sampled token the stream did not run through the model stays *pending* and is
fed at the start of the next prefill/generate, so a finished generation costs no extra forward.

Prefix reuse: a prompt that is the *whole* context (chat messages, or `whole=True`) continues from the
session's state when the session holds a prefix of it, else from the longest snapshot of the session's
`PrefixCache` that is a prefix of it; snapshots are taken at turn boundaries and every N tokens while
prefilling (see lily.prefix_cache). `save(path)` / `load_file(path)` keep a session on disk.

A session is given values, not the `Model` above it (`Model.session()` makes one): the engine, its
`PromptEncoder` (tokenizer, chat template, stop ids), its `SessionLimits` and the `ModelIdentity` its files
carry.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .chat import ChatTemplate
from .errors import ContextLengthError, LilyError, NonFiniteLogitsError
from .generation import (FINISH_LENGTH, FINISH_STOP, GenerationChunk, GenerationResult, GenerationStats,
                         StopStringMatcher, collect, split_reasoning)
from .prompt_checks import chat_variables, check_options
from .sampling import Sampler, SamplingParams, device_sampling_supported, resolve_sampling, takes_sampling_options
from .identity import ModelIdentity
from .speculative import LOAD_HEAD_HINT, default_drafts, no_head_message
from .session_file import load_session_file, read_session_user_metadata, save_session_file
from .snapshot import SessionSnapshot
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache

# progress(done, total) is called between prefill pieces; it may raise (e.g. to cancel a request)
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class SessionLimits:
    """The sizes a session works within."""

    max_context: int     # tokens its state holds at most
    vocab_size: int      # token ids are 0 .. vocab_size - 1 (the logits rows' length)
    chunk_size: int = 0  # prefill rows per engine chunk (0 = the backend's default)


@dataclass(frozen=True)
class PromptEncoder:
    """Prompts to token ids and generated ids back to text: the checkpoint's tokenizer and chat template, and
    the ids that end a reply (from config.json, generation_config.json and the tokenizer)."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    stop_token_ids: tuple[int, ...] = ()

    def encode(self, prompt: Any, vocab_size: int, **template_kwargs: Any) -> tuple[list[int], str | None]:
        """prompt -> (token ids, the rendered chat text or None). str: raw text; ints: token ids (each below
        vocab_size); dicts: chat messages."""
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError("[generate] the prompt is bytes: pass text (prompt.decode('utf-8')) or a list of "
                            "token ids")
        if isinstance(prompt, str):
            if template_kwargs:
                raise TypeError(f"[generate] {', '.join(sorted(template_kwargs))} only apply to chat messages, "
                                f"but the prompt is a string (pass a list of {{'role', 'content'}} messages)")
            return self.tokenizer.encode(prompt), None
        if isinstance(prompt, np.ndarray):
            prompt = prompt.reshape(-1).tolist()
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            kw = {"add_generation_prompt": True, **template_kwargs}
            text = self.chat_template.render(prompt, **kw)
            return self.tokenizer.encode(text), text
        if isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"[generate] token id {bad[0]} is out of range: expected 0..{vocab_size - 1}")
            if template_kwargs:
                raise TypeError(f"[generate] {', '.join(sorted(template_kwargs))} only apply to chat messages, "
                                f"but the prompt is token ids")
            return ids, None
        raise TypeError(f"[generate] prompt must be a string, a list of token ids or a list of chat message "
                        f"dicts, got {type(prompt).__name__}")


@dataclass
class PrefillResult:
    prompt_tokens: int   # tokens in the session after the prefill
    cached_tokens: int   # of those, already in the state before it
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.seconds if self.seconds > 0 else 0.0


class Session:
    """Explicit state for multi-turn use.

    s = model.session()                     # Model.session builds it from the model's values
    s.prefill("Once upon a time")           # text/ids are appended; chat messages are the whole conversation
    r = s.generate(max_tokens=32)           # continues from the state; the reply's tokens join s.tokens
    snap = s.snapshot(); ...; s.restore(snap)
    """

    def __init__(self, engine: Any, encoder: PromptEncoder, limits: SessionLimits, owner: ModelIdentity, *,
                 prefix_cache: "PrefixCache | None" = None, sampling_defaults: Mapping[str, Any] | None = None):
        """engine: runs the model (new_state, forward, open_stream); owner: what its saved files carry;
        sampling_defaults: the checkpoint's generation_config.json (options a request leaves unset)."""
        self.encoder = encoder
        self.limits = limits
        self.owner = owner
        self.sampling_defaults = dict(sampling_defaults or {})
        self._engine = engine
        self._state = self._engine.new_state()
        self._tokens: list[int] = []     # run through the model (in the state)
        self._pending: list[int] = []    # sampled, not yet run through the model
        self._last_logits: np.ndarray | None = None  # [vocab] after the last token in the state
        self.prefix_cache = prefix_cache
        self.progress_tokens = 4096      # prefill piece between progress callbacks (when one is given)
        self.metadata: dict[str, Any] = {}  # what Session.save(path, metadata=...) stored
        self.last_stats: GenerationStats | None = None  # the latest generation's (see _decode_loop)
        self.stream: Any = None          # the engine's token stream while a generation runs (Engine.step_streams)
        # True: generations here are stepped with others' (a server's batch, Model.batch_generate), so a plain
        # stream draws in the extension even where the backend could draw on the device (Engine.step_streams
        # batches only those)
        self.batch_streams = False
        # sample on the device where the engine can (the logits row then never crosses to the host); env
        # LILY_DEVICE_SAMPLING=0 or setting this False keeps every draw on the host (lily.sampling.Sampler)
        self.device_sampling = os.environ.get("LILY_DEVICE_SAMPLING", "1") not in ("0", "false", "no")
        # speculative decoding with the model's MTP head (when the engine has one): drafted tokens per step, and
        # whether a stream falls back to plain steps by itself when drafting does not pay (env
        # LILY_SPECULATIVE_ADAPTIVE=0 keeps drafting: tests and ablations)
        self.speculative_k = default_drafts(getattr(engine, "backend", ""))
        self.speculative_adaptive = os.environ.get("LILY_SPECULATIVE_ADAPTIVE", "1") not in ("0", "false", "no")
        # what = "speculative=..." -> the error's text when the engine cannot draft (Model.session hands the model's)
        self.no_head_message: Callable[[str], str] = lambda what: no_head_message(what, None, LOAD_HEAD_HINT)

    # ---- inspection ----------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Every token of the session, in order (prompt and generated)."""
        return self._tokens + self._pending

    @property
    def state_tokens(self) -> Sequence[int]:
        """The tokens the state holds (the last sampled token, not yet run, excluded); read-only, not a copy."""
        return self._tokens

    @property
    def position(self) -> int:
        return len(self._tokens) + len(self._pending)

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def nbytes(self) -> int:
        return int(getattr(self._state, "nbytes", 0))

    def __repr__(self) -> str:
        return f"Session(position={self.position}, max_context={self.max_context})"

    # ---- state management -----------------------------------------------------------------------
    def reset(self) -> None:
        self._state = self._engine.new_state()
        self._tokens, self._pending, self._last_logits = [], [], None

    def snapshot(self) -> SessionSnapshot:
        return SessionSnapshot(self._state.snapshot(), tuple(self._tokens), tuple(self._pending),
                               None if self._last_logits is None else self._last_logits.copy())

    def restore(self, snap: SessionSnapshot) -> None:
        if not isinstance(snap, SessionSnapshot):
            raise TypeError(f"[Session.restore] expected a SessionSnapshot from Session.snapshot(), "
                            f"got {type(snap).__name__}")
        self._state.restore(snap.state)
        self._tokens, self._pending = list(snap.tokens), list(snap.pending)
        self._last_logits = None if snap.last_logits is None else snap.last_logits.copy()

    # ---- prompts ----------------------------------------------------------------------------------
    def _new_tokens(self, prompt: Any, template_kwargs: Mapping[str, Any], whole: bool = False
                    ) -> tuple[list[int], str | None]:
        """The tokens this prompt adds to the session, and the rendered text when it is chat messages. Chat
        messages (and any prompt with whole=True) are the whole context: the session keeps the longest prefix
        of it that it can, see `_reuse`."""
        ids, chat_text = self.encoder.encode(prompt, self.limits.vocab_size, **template_kwargs)
        if chat_text is None and not whole:
            return ids, None
        return self._reuse(ids), chat_text

    def _reuse(self, ids: Sequence[int]) -> list[int]:
        """Make the state hold the longest available prefix of `ids` (the live state if it is a prefix,
        else the longest usable prefix-cache snapshot, else nothing); returns the tokens still to run."""
        ids = [int(t) for t in ids]
        held = self._tokens
        live = len(held) if len(held) <= len(ids) and ids[:len(held)] == held else -1
        if live == len(ids) and live > 0 and self._last_logits is None:
            live = -1  # holds the whole prompt but not the next-token logits (interrupted): not usable
        cache = self.prefix_cache
        n, snap = cache.lookup(ids) if cache is not None else (0, None)
        if live >= 0 and live >= n:
            if self._pending and ids[live:live + len(self._pending)] != self._pending:
                self._pending = []  # sampled but not in the state: drop it if the prompt goes elsewhere
            return ids[self.position:]
        if cache is not None and held and live < 0 and not cache.contains(held):
            # the live state is about to be replaced: keep it (e.g. a reply end) for a later request
            cache.insert(SessionSnapshot(self._state.snapshot(), tuple(held), (),
                                         None if self._last_logits is None else self._last_logits.copy()))
        if snap is not None:
            self.restore(snap)
        else:
            self.reset()
        return ids[len(self._tokens):]

    def _check_room(self, new: int, max_tokens: int | None) -> int:
        """Raise ContextLengthError unless new prompt tokens (+ max_tokens) fit; returns the max_tokens to use."""
        prompt = self.position + new
        ctx = self.max_context
        if max_tokens == 0:  # prefill only
            if prompt > ctx:
                raise ContextLengthError(f"[prefill] the prompt is {prompt} tokens, which exceeds the context "
                                         f"size {ctx} (shorten it or load with a larger max_context)")
            return 0
        if max_tokens is None:
            if prompt >= ctx:
                raise ContextLengthError(
                    f"[generate] the prompt is {prompt} tokens and the context size is {ctx}: no room to "
                    f"generate (shorten the prompt or load with a larger max_context)")
            return ctx - prompt
        if prompt + max_tokens > ctx:
            raise ContextLengthError(
                f"[generate] the prompt is {prompt} tokens and max_tokens is {max_tokens}, {prompt + max_tokens} "
                f"in all, which exceeds the context size {ctx} (shorten the prompt, lower max_tokens, or load "
                f"with a larger max_context)")
        return max_tokens

    def _feed(self, ids: Sequence[int], logits: str = "last") -> np.ndarray | None:
        """Run pending + ids through the engine; returns the last logits row [vocab] (None if nothing ran
        and none is known)."""
        run = self._pending + [int(t) for t in ids]
        if not run:
            return self._last_logits
        if self.position + len(ids) > self.max_context:
            raise ContextLengthError(f"[prefill] {self.position + len(ids)} tokens exceed the context size "
                                     f"{self.max_context}")
        before = self._state.position
        self._last_logits = None
        try:
            out = self._engine.forward(self._state, np.asarray(run, np.int32), logits=logits,
                                       chunk_size=self.limits.chunk_size)
        finally:  # keep the token bookkeeping true to the state even if interrupted
            done = max(0, min(len(run), self._state.position - before))
            self._tokens.extend(run[:done])
            self._pending = run[done:]
        if logits == "last":
            self._last_logits = np.asarray(out[-1], np.float32)
        return self._last_logits

    def _feed_prompt(self, new: Sequence[int], progress: ProgressCallback | None = None) -> np.ndarray | None:
        """Run pending + new tokens in pieces: snapshots into the prefix cache at the points it asks for,
        and progress(done, total) every `progress_tokens` tokens. Returns the last logits row."""
        start = len(self._tokens)
        full = self._tokens + self._pending + [int(t) for t in new]
        end = len(full)
        if end == start:
            return self._last_logits
        snaps: set[int] = set()
        if self.prefix_cache is not None:
            snaps = set(self.prefix_cache.snapshot_points(full, start, end, self.encoder.tokenizer.im_start_id))
            if start in snaps:  # the state as it is now (its pending token not run yet)
                self.prefix_cache.insert(SessionSnapshot(
                    self._state.snapshot(), tuple(self._tokens), (),
                    None if self._last_logits is None else self._last_logits.copy()))
        cuts = set(snaps)
        if progress is not None and self.progress_tokens > 0:
            cuts.update(range(start + self.progress_tokens, end, self.progress_tokens))
        first = start + len(self._pending)
        logits = None
        for cut in sorted(c for c in cuts if first <= c < end) + [end]:
            if cut <= len(self._tokens):
                continue
            logits = self._feed(full[self.position:cut], logits="last" if (cut in snaps or cut == end) else "none")
            if cut in snaps:
                self.prefix_cache.insert(self.snapshot())
            if progress is not None:
                progress(cut - start, end - start)
        return logits

    def prefill(self, prompt: Any, *, whole: bool = False, progress: ProgressCallback | None = None,
                add_generation_prompt: bool | None = None, enable_thinking: bool | None = None,
                preserve_thinking: bool | None = None, tools: Sequence[Any] | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> PrefillResult:
        """Run a prompt through the model. Text and token ids are appended to the session; a list of chat
        messages is the whole conversation so far (rendered with the chat template, add_generation_prompt
        defaulting to True; its variables by name or in chat_template_kwargs) and reuses the session's state
        (or its prefix cache) for the longest prefix held. whole=True treats text / token ids the same way (the
        prompt is the whole context)."""
        t0 = time.perf_counter()
        template = chat_variables(prompt, "prefill", chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                                  enable_thinking=enable_thinking, preserve_thinking=preserve_thinking, tools=tools)
        new, _ = self._new_tokens(prompt, template, whole)
        cached = len(self._tokens)
        self._check_room(len(new), 0)
        self._feed_prompt(new, progress)
        return PrefillResult(self.position, cached, time.perf_counter() - t0)

    def flush(self) -> None:
        """Run the pending token (sampled, e.g. the final <|im_end|>, not yet run through the model) now,
        so the state holds every token of the session (a later turn then reuses all of them)."""
        if self._pending:
            self._feed([])

    # ---- disk ----------------------------------------------------------------------------------------
    def save(self, path: str | Any, metadata: Mapping[str, Any] | None = None) -> Any:
        """Write the session (state, tokens, and the prefix-cache snapshots on its own token path) to a
        safetensors file; `load_file(path)` (`Model.load_session(path)`) brings it back on the same model.
        `metadata` (JSON data, e.g. the chat messages) comes back as `.metadata` of the loaded session."""
        chain = []
        if self.prefix_cache is not None:
            n = len(self._tokens)
            chain = [e for e in self.prefix_cache.entries()
                     if len(e.tokens) < n and list(e.tokens) == self._tokens[:len(e.tokens)]]
        chain.append(SessionSnapshot(self._state, tuple(self._tokens), (), self._last_logits))
        return save_session_file(path, chain, self.owner, pending=self._pending, metadata=metadata)

    def load_file(self, path: str | Any) -> None:
        """Continue from a file written by `save` with the same model (SessionFileError if it came from another
        one): its state, tokens and metadata replace this session's; its earlier snapshots go into the
        session's prefix cache, when it has one."""
        snaps, pending = load_session_file(path, self.owner, self._engine)
        self.metadata = read_session_user_metadata(path)
        head = snaps[-1]
        self._state, self._tokens, self._pending = head.state, list(head.tokens), list(pending)
        self._last_logits = None if head.last_logits is None else np.asarray(head.last_logits, np.float32)
        if self.prefix_cache is not None:
            for snap in snaps[:-1]:
                self.prefix_cache.insert(snap)

    # ---- generation -------------------------------------------------------------------------------
    @takes_sampling_options
    def generate(self, prompt: Any = None, *, stream: bool = False, sampling: SamplingParams | None = None,
                 whole: bool = False, progress: ProgressCallback | None = None, constraint: Any = None,
                 enable_thinking: bool | None = None, preserve_thinking: bool | None = None,
                 tools: Sequence[Any] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> GenerationResult | Iterator[GenerationChunk]:
        """Generate from the session's state (after running `prompt`, if given, through it).

        The other keywords are the sampling options (max_tokens, temperature, top_p, ... :
        lily.sampling.SAMPLING_OPTIONS; any other keyword is a TypeError naming them). Options left as None come
        from the checkpoint's generation_config.json (sampling_defaults), else neutral defaults (see
        SamplingParams). `sampling=` passes a ready SamplingParams instead. Chat messages (each with a role and
        content) are rendered with enable_thinking, preserve_thinking, tools and the other template variables
        given in chat_template_kwargs (add_generation_prompt, ...).
        whole=True: the prompt (text or ids) is the whole context, reusing the longest prefix held (chat
        messages always are). progress(done, total) is called during the prefill and may raise to cancel.
        constraint: a token mask applied before sampling (see `lily.sampling.Sampler`), e.g. a grammar.
        """
        check_options(kwargs, "generate")
        options = kwargs
        template_kwargs = chat_variables(prompt, "generate", chat_template_kwargs, enable_thinking=enable_thinking,
                                         preserve_thinking=preserve_thinking, tools=tools)
        if sampling is None:
            sampling = resolve_sampling(self.sampling_defaults, **options)
        t0 = time.perf_counter()
        new, chat_text = ([], None) if prompt is None else self._new_tokens(prompt, template_kwargs, whole)
        budget = self._check_room(len(new), sampling.max_tokens)
        if not new and not self._pending and self._last_logits is None:
            raise LilyError("[generate] the session is empty: pass a prompt or prefill() one first")
        chunks = self._decode_loop(new, sampling, budget, time.perf_counter() - t0, progress, constraint)
        if chat_text is not None:  # a chat reply: reasoning and answer apart (GenerationChunk.channel)
            chunks = split_reasoning(chunks, chat_text)
        return chunks if stream else collect(chunks)

    def _decode_loop(self, new: list[int], params: SamplingParams, budget: int, prep_s: float,
                     progress: ProgressCallback | None = None, constraint: Any = None) -> Iterator[GenerationChunk]:
        # timings start when the stream is first pulled (plus the prompt preparation time)
        t0 = time.perf_counter() - prep_s
        stats = GenerationStats(prompt_tokens=self.position + len(new), cached_tokens=len(self._tokens))
        self.last_stats = stats  # filled in as the generation runs (a server that stops it reads what it did)
        logits = self._feed_prompt(new, progress)
        stats.prefill_s = time.perf_counter() - t0
        sampler = Sampler(params, logits.shape[-1], prompt_tokens=self.tokens, constraint=constraint)
        detok = self.encoder.tokenizer.streaming_detokenizer(skip_special_tokens=True)
        matcher = StopStringMatcher(params.stop)
        stop_ids = set(self.encoder.stop_token_ids) | set(params.stop_token_ids)
        t_first = None

        def chunk(token: int, lp: Any) -> GenerationChunk | None:
            """The chunk of one generated token; the last one (with finish_reason and stats) when it ends."""
            nonlocal t_first
            stats.generated_tokens += 1
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            reason = why = None
            if token in stop_ids:
                text, _ = matcher.flush(detok.flush())
                reason, why = FINISH_STOP, token
            else:
                text, hit = matcher.push(detok.add(token))
                if hit is not None:
                    reason, why = FINISH_STOP, hit
                elif stats.generated_tokens == budget:
                    tail, hit = matcher.flush(detok.flush())
                    text += tail
                    reason, why = (FINISH_STOP, hit) if hit else (FINISH_LENGTH, None)
            if reason is None:
                return GenerationChunk(text, token, lp.logprob if lp else None, lp.top if lp else None)
            now = time.perf_counter()
            stats.decode_s = now - t_first
            stats.total_s = now - t0
            return GenerationChunk(text, token, lp.logprob if lp else None, lp.top if lp else None, reason, why,
                                   stats)

        # the first token is drawn on the host from the prompt's logits; the engine's token stream runs the rest
        _check_finite(logits, self.position)
        token = sampler.sample(logits)
        lp = sampler.logprobs(logits, token) if params.logprobs else None
        self._pending.append(token)
        out = chunk(token, lp)
        yield out
        if out.finish_reason is not None:
            return
        yield from self._token_loop(token, params, budget - 1, sampler, stop_ids, constraint, chunk, stats)

    def _speculation(self, params: SamplingParams, constraint: Any, max_tokens: int) -> tuple[int, str | None]:
        """(drafted tokens per step, 0 = plain; the stats' note when plain decoding was chosen over a head)."""
        want = params.speculative
        if want is False:
            return 0, None
        if not getattr(self._engine, "has_mtp", False):
            if want is not None:
                raise LilyError("[generate] " + self.no_head_message(f"speculative={want!r}"))
            return 0, None
        if constraint is not None:
            return 0, "plain: a constrained (grammar) request draws on the host"
        if params.logprobs:
            return 0, "plain: logprobs are reported by plain decoding"
        if max_tokens < 2:
            return 0, "plain: one token left to draw"
        k = self.speculative_k if want is None or want is True else int(want)
        return k, None

    def _token_loop(self, first: int, params: SamplingParams, max_tokens: int, sampler: Sampler,
                    stop_ids: set[int], constraint: Any, chunk: Callable[[int, Any], GenerationChunk],
                    stats: GenerationStats) -> Iterator[GenerationChunk]:
        """Up to max_tokens more tokens after `first` (pending) from one engine TokenStream: speculative (drafts of
        the MTP head verified in one forward, drawn in the extension) where the model has a head, else drawn on the
        device where the engine can (the stream runs one step ahead of this loop), else lock-step (each step's
        logits here, the host Sampler draws). The session's tokens follow the state: the stream reports what it
        fed."""
        k, note = self._speculation(params, constraint, max_tokens)
        stats.speculative = note
        device = k == 0 and self.device_sampling and device_sampling_supported(params, constraint)
        p = params
        start = self._state.position  # (a device stream launches its first step at once)
        stream = self._engine.open_stream(
            self._state, first, max_tokens, stop_ids=sorted(stop_ids), device=device, **p.draw_options(),
            seen=sampler.seen.view(np.uint8) if p.repetition_penalty != 1.0 else None,
            counts=sampler.counts if (p.presence_penalty or p.frequency_penalty) else None,
            seed=sampler.stream_seed(),  # the device draws the numbers the host sampler would take next
            # an explicit k drafts; only speculative=None (auto) adapts (drafting never changes the tokens)
            **({"speculative": k, "adaptive": self.speculative_adaptive and p.speculative is None} if k else {}),
            **({"batch": True} if self.batch_streams else {}))
        self.stream = stream  # open while the generation runs: a server decodes it with others (step_streams)
        generated = list(self._pending)  # [first]
        n_base = len(self._tokens)
        last_logits = None
        speculative = bool(getattr(stream, "speculative", False))  # (the reference engine's streams never are)
        # next() returns tokens: drawn on the device, or in the extension (speculative, or a plain stream of a
        # backend without a device sampler: the host Sampler's rule and uniform numbers); else lock-step
        draws = bool(getattr(stream, "draws", stream.device))

        def settle() -> None:  # tokens the stream ran are in the state; the rest stay pending
            # a speculative stream's state may run ahead of the tokens returned so far (accepted drafts queued for
            # next()): those are the reply's next tokens, in order, and join the session as they are returned
            fed = min(self._state.position - start, len(generated))
            # appended, not rebuilt: a rebuild of the whole context's list per token is quadratic in the reply
            self._tokens.extend(generated[len(self._tokens) - n_base:fed])
            self._pending = generated[fed:]

        def spec_stats() -> None:
            s = stream.spec_stats
            stats.speculative, stats.drafted_tokens = s["status"], s["drafted"]
            stats.accepted_tokens, stats.verify_steps = s["accepted"], s["verifies"]

        try:
            for _ in range(max_tokens):
                if draws:
                    try:
                        token = stream.next()
                    except ValueError as e:  # the extension's check of the rows it draws from
                        if "non-finite logits" in str(e):
                            raise NonFiniteLogitsError(str(e)) from None
                        raise
                    if token < 0:
                        return
                    lp = None  # the stream keeps the penalties' history from here; the host sampler is done
                else:
                    last_logits = stream.step(generated[-1])
                    settle()
                    _check_finite(last_logits, self._state.position)
                    token = sampler.sample(last_logits)
                    lp = sampler.logprobs(last_logits, token) if p.logprobs else None
                generated.append(token)
                settle()
                if speculative:
                    spec_stats()
                out = chunk(token, lp)
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            self.stream = None
            held = stream.close(logits=stream.device)
            settle()
            if speculative:
                spec_stats()
            if stream.device:
                last_logits = held
            self._last_logits = None if last_logits is None else np.asarray(last_logits, np.float32)


def _check_finite(logits: np.ndarray, position: int) -> None:
    """Stop a generation on NaN / inf logits instead of sampling garbage from them."""
    if not np.isfinite(logits).all():
        bad = int((~np.isfinite(logits)).sum())
        raise NonFiniteLogitsError(
            f"[generate] the model produced {bad} non-finite logits (NaN or inf) after position {position}: "
            f"the weights or a kernel are broken (check the checkpoint: a NaN in a weight tensor does this)")
