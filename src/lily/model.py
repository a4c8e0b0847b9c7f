"""`lily.load()` and `Model`: the Python API, written only against docs/engine_contract.md.

The C++ extension is imported lazily (when a cpu/cuda/metal engine is made), so `import lily` works on an
install without it and `backend="reference"` runs the NumPy twin.
"""
from __future__ import annotations

import json
import os
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .chat import ChatTemplate
from .config import ModelConfig
from .errors import BackendUnavailableError, CheckpointError, ContextLengthError
from .generation import GenerationChunk, GenerationResult, collect
from .identity import ModelIdentity, model_fingerprint, weights_digest
from .sampling import takes_sampling_options
from .session import PrefillResult, PromptEncoder, Session, SessionLimits
from .speculative import LOAD_HEAD_HINT, no_head_message
from .tokenizer import Tokenizer

BACKENDS = ("auto", "cpu", "cuda", "metal", "reference")
DEFAULT_MAX_CONTEXT = 32768
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default"


# Test-only (docs/metal.md): with this set to 1 on an install that has the emulated Metal device (Linux),
# backend="auto" considers it as it would an Apple GPU, so CI drives auto's Metal-then-CPU fallback.
AUTO_EMULATED_METAL_ENV = "LILY_TEST_AUTO_EMULATED_METAL"
# The C++ prefix of "Metal unavailable" (csrc/metal/kernel_sources.h: no device, or a kernel that did not
# compile or validate).
_METAL_UNAVAILABLE = "[lily] backend 'metal' unavailable: "


def _engine_factory(backend: str, backend_options: Mapping[str, str] | None = None):
    """backend name -> (engine class/factory, resolved backend name). Fails fast, before weights load."""
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"[lily.load] backend={backend!r} is not known: expected one of "
                                      f"{', '.join(repr(b) for b in BACKENDS)}")
    if backend == "reference":
        from .reference import ReferenceEngine
        return ReferenceEngine, "reference"
    try:
        from . import _lily
    except ImportError as e:
        raise BackendUnavailableError(
            f"[lily.load] backend {backend!r} needs the C++ extension lily._lily, which is not built in this "
            f"install ({e}); reinstall lily from source (pip install .) to build it, or pass "
            f"backend='reference' for the slow NumPy engine") from None
    built = _built_backends(_lily)
    emulated = "metal (emulated)" in built
    if backend_options and backend not in ("metal", "auto"):
        # only Metal takes construction options (auto passes them on when it picks Metal)
        raise ValueError(f"[lily.load] backend_options are for backend='metal' (or 'auto', when it picks "
                         f"Metal), got backend={backend!r}")
    if backend == "metal" and emulated and any(k.startswith("emu_") for k in backend_options or {}):
        built = [*built, "metal"]  # Linux: emu_* options select the emulated device, for tests
    if backend == "auto":
        # README.md: metal on a Mac, cuda where a device is visible, else cpu. Metal that is unavailable
        # (no device, a kernel that does not compile) falls back to cpu with a warning.
        if "metal" in built:
            return _metal_or_cpu(_lily, dict(backend_options or {})), "metal"
        if emulated and os.environ.get(AUTO_EMULATED_METAL_ENV) == "1":
            return _metal_or_cpu(_lily, {"emu_runtime_compile": "1", **(backend_options or {})}), "metal"
        if "cuda" in built and _lily.cuda_device_count() > 0:
            backend = "cuda"
        else:
            backend = "cpu"
    if backend not in built:
        hint = {"cuda": "rebuild with -C cmake.define.LILY_CUDA=ON on a machine with the CUDA toolkit",
                "metal": "Metal is built on macOS (Apple Silicon) only"}.get(backend, "")
        raise BackendUnavailableError(
            f"[lily.load] backend {backend!r} is not built into this install of lily (built: "
            f"{', '.join(built)}, reference){'; ' + hint if hint else ''}")
    if backend == "cpu":
        return _lily.Engine, "cpu"
    if backend == "cuda" and hasattr(_lily, "cuda_device_count") and _lily.cuda_device_count() == 0:
        raise BackendUnavailableError("[lily.load] backend 'cuda' is built but no CUDA device is visible "
                                      "(check the driver and CUDA_VISIBLE_DEVICES), or use backend='cpu'")

    def make(*args, **kwargs):
        try:
            return _lily.Engine(*args, backend=backend, options=dict(backend_options or {}), **kwargs)
        except TypeError as e:
            raise BackendUnavailableError(f"[lily.load] backend {backend!r} is built but lily._lily.Engine did "
                                          f"not accept backend={backend!r}: {e}") from None
        except RuntimeError as e:
            if _METAL_UNAVAILABLE in str(e):  # the message names the kernel file and the compiler's output
                raise BackendUnavailableError(f"[lily.load] {e}") from None
            raise
    return make, backend


def _metal_or_cpu(ext, options: dict[str, str]):
    """backend="auto" where Metal is a candidate: the Metal engine, or, when Metal is unavailable (no device,
    a kernel that did not compile or validate), the CPU engine and a RuntimeWarning carrying the reason."""
    def make(*args, **kwargs):
        try:
            return ext.Engine(*args, backend="metal", options=options, **kwargs)
        except RuntimeError as e:
            if _METAL_UNAVAILABLE not in str(e):
                raise
            warnings.warn(f"[lily.load] backend='auto': Metal is unavailable, running on the CPU backend "
                          f"instead. {e}", RuntimeWarning, stacklevel=3)
            return ext.Engine(*args, backend="cpu", **kwargs)
    return make


def metal_status(backend_options: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The Metal backend's status for `lily info`: None when this install has no Metal backend, else the
    device made as backend='metal' would make it (kernels compiled or loaded from the cache): keys device,
    family, tensor_ops, library, source_hash, cache, cache_hit; or {"error": message} naming what is
    unavailable (for a kernel: the file and the compiler's diagnostics). On Linux the emulated device is
    probed (runtime compile through tools/msl/mslc.py)."""
    import ctypes

    from . import _lily
    built = _built_backends(_lily)
    if "metal" in built:
        options = dict(backend_options or {})
    elif "metal (emulated)" in built:
        options = {"emu_runtime_compile": "1", **(backend_options or {})}
    else:
        return None
    lib = ctypes.CDLL(_lily.__file__)  # the loaded extension: its C entry point lily_metal_probe
    lib.lily_metal_probe.restype = ctypes.c_void_p
    lib.lily_metal_probe.argtypes = [ctypes.c_char_p]
    lib.lily_metal_free.argtypes = [ctypes.c_void_p]
    p = lib.lily_metal_probe("\n".join(f"{k}={v}" for k, v in options.items()).encode())
    try:
        out = ctypes.string_at(p).decode(errors="replace")
    finally:
        lib.lily_metal_free(p)
    if out.startswith("error\t"):
        return {"error": out[len("error\t"):]}
    return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)


def _built_backends(ext) -> list[str]:
    """Backends compiled into the extension (lily._lily.build_info()["backends"])."""
    info = ext.build_info() if hasattr(ext, "build_info") else {}
    return list(info.get("backends") or ["cpu"])


def _count_params(tensors: Mapping[str, np.ndarray], quant: Mapping[str, tuple[int, int]]) -> int:
    """Parameters of the model (quantized codes unpacked; scales and biases are not parameters)."""
    n = 0
    for name, arr in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in quant:
            if leaf == "weight":
                n += arr.size * 32 // quant[module][0]
        else:
            n += arr.size
    return n


def _special_token_strings(tokenizer_path: Path | None) -> dict[str, str]:
    """bos/eos/pad/unk token strings from tokenizer_config.json (templates may reference them)."""
    out: dict[str, str] = {}
    if tokenizer_path is None:
        return out
    cfg = Path(tokenizer_path).with_name("tokenizer_config.json")
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return out
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = raw.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _human_count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


class Model:
    """A loaded model: engine + tokenizer + chat template. Use `lily.load()` to make one.

    weights_digest: `lily.identity.weights_digest` of the checkpoint's tensors (`lily.load` computes it), part of
    the fingerprint that saved sessions carry; None for a model built by hand."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, config: ModelConfig, *,
                 chat_template: ChatTemplate | str | None = None, generation_config: Mapping[str, Any] | None = None,
                 path: str | Path | None = None, nbytes: int = 0, params: int = 0, chunk_size: int = 0,
                 weights_digest: str | None = None, mtp: Any = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template = chat_template if isinstance(chat_template, ChatTemplate) else \
            ChatTemplate(chat_template, origin=str(path or "this model"))
        self.generation_config = dict(generation_config or {})
        self.path = None if path is None else str(path)
        self.nbytes = int(nbytes)
        self.params = int(params)
        self.chunk_size = int(chunk_size)
        self.weights_digest = weights_digest
        # lily.mtp_source.MtpWeights (the draft head, docs/model.md §7), or None: plain decoding
        self.mtp = mtp
        self.stop_token_ids = self._stop_tokens()

    def _stop_tokens(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        gc = self.generation_config.get("eos_token_id")
        ids += gc if isinstance(gc, list) else ([gc] if isinstance(gc, int) else [])
        ids += self.tokenizer.stop_token_ids()
        return tuple(dict.fromkeys(int(i) for i in ids))

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return str(getattr(self.engine, "backend", "?"))

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    @property
    def threads(self) -> int:
        return int(getattr(self.engine, "threads", 0))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def info(self) -> dict[str, Any]:
        return {"path": self.path, "backend": self.backend, "threads": self.threads,
                "max_context": self.max_context, "params": self.params, "bytes": self.nbytes,
                "vocab_size": self.vocab_size, "layers": self.config.num_hidden_layers,
                "experts": f"{self.config.num_experts_per_tok}/{self.config.num_experts}",
                "chat_template": self.chat_template.available, "stop_token_ids": list(self.stop_token_ids),
                "mtp": self.mtp.describe() if self.mtp is not None else
                "none: plain decoding (lily.load(path, mtp=SOURCE) takes the head from an HF original, e.g. "
                "Qwen/Qwen3.6-35B-A3B)"}

    def __repr__(self) -> str:
        return (f"Model(path={self.path!r}, backend={self.backend!r}, params={_human_count(self.params)}, "
                f"weights={_human_bytes(self.nbytes)}, max_context={self.max_context}, threads={self.threads})")

    # ---- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render chat messages with the checkpoint's template (kwargs such as tools, enable_thinking,
        preserve_thinking are passed to the template)."""
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text) if tokenize else text

    # ---- running ---------------------------------------------------------------------------------
    def session(self, prefix_cache: Any = None) -> Session:
        """A fresh session (empty state) for multi-turn use. With a `lily.prefix_cache.PrefixCache`, it keeps
        state snapshots at turn boundaries and continues any later prompt from the longest one it holds."""
        s = Session(self.engine, PromptEncoder(self.tokenizer, self.chat_template, self.stop_token_ids),
                    SessionLimits(self.max_context, self.vocab_size, self.chunk_size), self.identity,
                    prefix_cache=prefix_cache, sampling_defaults=self.generation_config)
        s.no_head_message = lambda what: no_head_message(what, self, LOAD_HEAD_HINT)
        return s

    def load_session(self, path: str | Path, prefix_cache: Any = None) -> Session:
        """A session saved by `Session.save` with this model (SessionFileError for another model's file); the
        file's earlier snapshots go into `prefix_cache` when given."""
        s = self.session(prefix_cache)
        s.load_file(path)
        return s

    @cached_property
    def identity(self) -> ModelIdentity:
        """What saved sessions record of this model (the fingerprint: weights digest + tokenizer + config)."""
        fingerprint = model_fingerprint(self.config.to_dict(), self.tokenizer.path, self.tokenizer.vocab_size,
                                        self.weights_digest)
        return ModelIdentity(fingerprint, self.path, self.vocab_size)

    @property
    def fingerprint(self) -> str:
        """Identity of these weights + tokenizer + config (session files carry it)."""
        return self.identity.fingerprint

    def prefill(self, prompt: Any, *, add_generation_prompt: bool | None = None, enable_thinking: bool | None = None,
                preserve_thinking: bool | None = None, tools: Sequence[Any] | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> Session:
        """Run a prompt; returns the session holding it, ready for `.generate()`. Template variables of a chat
        prompt: the named ones, others in chat_template_kwargs."""
        s = self.session()
        s.prefill(prompt, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                  preserve_thinking=preserve_thinking, tools=tools, chat_template_kwargs=chat_template_kwargs)
        return s

    def prefill_stats(self, prompt: Any, *, add_generation_prompt: bool | None = None,
                      enable_thinking: bool | None = None, preserve_thinking: bool | None = None,
                      tools: Sequence[Any] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None
                      ) -> PrefillResult:
        """Run a prompt in a throwaway session and report its prefill timing."""
        return self.session().prefill(prompt, add_generation_prompt=add_generation_prompt,
                                      enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
                                      tools=tools, chat_template_kwargs=chat_template_kwargs)

    @takes_sampling_options
    def generate(self, prompt: Any, *, stream: bool = False, enable_thinking: bool | None = None,
                 preserve_thinking: bool | None = None, tools: Sequence[Any] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
                 ) -> GenerationResult | Iterator[GenerationChunk]:
        """Generate from a prompt, starting from an empty state.

        prompt: str (raw text, no template), list[int] (token ids), or a list of chat message dicts, each with
        a role and content (rendered with the checkpoint's chat template and add_generation_prompt=True;
        enable_thinking, preserve_thinking, tools and any other template variable, given in
        chat_template_kwargs={...}, apply to these only).
        The other keywords are the sampling options (max_tokens, temperature, top_p, ... :
        lily.sampling.SAMPLING_OPTIONS; any other keyword is a TypeError); left as None they come from the
        checkpoint's generation_config.json, else neutral defaults (SamplingParams). max_tokens=None: until a
        stop token/string or the context is full.
        stream=True returns an iterator of GenerationChunk; the last one has finish_reason and stats.
        Raises ContextLengthError when the prompt plus max_tokens does not fit in max_context.
        """
        return self.session().generate(prompt, stream=stream, enable_thinking=enable_thinking,
                                       preserve_thinking=preserve_thinking, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs, **kwargs)

    @takes_sampling_options
    def stream(self, prompt: Any, *, enable_thinking: bool | None = None, preserve_thinking: bool | None = None,
               tools: Sequence[Any] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> Iterator[GenerationChunk]:
        """`generate(prompt, stream=True, ...)` (mlx-lm's stream_generate): an iterator of GenerationChunk, the last
        one with finish_reason and stats."""
        return self.generate(prompt, stream=True, enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
                             tools=tools, chat_template_kwargs=chat_template_kwargs, **kwargs)

    @takes_sampling_options
    def batch_generate(self, prompts: Sequence[Any], *, enable_thinking: bool | None = None,
                       preserve_thinking: bool | None = None, tools: Sequence[Any] | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
                       ) -> list[GenerationResult]:
        """Generate from several prompts decoded together (mlx-lm's batch_generate): one forward per step serves
        every generation still running, so on a backend that batches streams (the CPU today) the aggregate rate
        grows with their number. Each result equals the prompt's own `generate` call with the same options, token
        for token (a seed gives each prompt the text it gives alone), with its own `.stats`. The prompts are
        prefilled one after another; the options and template variables are those of `generate`, for every prompt.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"batch_generate: prompts must be a list of prompts (each as generate takes it), got "
                            f"{type(prompts).__name__}")
        sessions = [self.session() for _ in prompts]
        step_streams = self.engine.step_streams if getattr(self.engine, "batches_streams", False) else None
        for s in sessions:
            s.batch_streams = step_streams is not None
        runs = [s.generate(p, stream=True, enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
                           tools=tools, chat_template_kwargs=chat_template_kwargs, **kwargs)
                for s, p in zip(sessions, prompts)]
        chunks: list[list[GenerationChunk]] = [[] for _ in runs]
        live = list(range(len(runs)))
        try:
            while live:
                open_streams = [sessions[i].stream for i in live if sessions[i].stream is not None]
                if step_streams is not None and len(open_streams) > 1:
                    step_streams(open_streams)  # the next token of each, in one forward
                for i in list(live):
                    c = next(runs[i], None)
                    if c is None:
                        live.remove(i)
                    else:
                        chunks[i].append(c)
        finally:
            for r in runs:
                r.close()
        return [collect(c) for c in chunks]

    def logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Teacher-forced logits float32 [S, vocab] for token_ids, from an empty state."""
        ids = np.asarray(token_ids, np.int32).reshape(-1)
        if ids.size > self.max_context:
            raise ContextLengthError(f"[logits] {ids.size} tokens exceed the context size {self.max_context}")
        state = self.engine.new_state()
        return np.asarray(self.engine.forward(state, ids, logits="all", chunk_size=self.chunk_size))


def load(path_or_repo_id: str | Path | None = None, backend: str = "auto", max_context: int | None = None,
         threads: int = 0, chunk_size: int = 0, backend_options: Mapping[str, str] | None = None,
         mtp: bool | str | Path | None = None) -> Model:
    """Load a checkpoint (local folder or Hugging Face repo id) onto a backend.

    path_or_repo_id=None loads the small model bundled with the package (lily/models/default).
    backend: "auto" (metal on a Mac, cuda where a device is visible, else cpu), "cpu", "cuda", "metal", or
    "reference" (NumPy, slow, exact).
    max_context: context window in tokens (default min(32768, the model's max_position_embeddings)).
    threads: CPU threads (0 = all cores). chunk_size: prefill chunk rows (0 = backend default).
    backend_options: construction options of the Metal backend (str -> str, csrc/metal/backend_metal.h), for
    backend="metal" or "auto" (used when auto picks Metal); on Linux, backend="metal" with an emu_* option
    ({"emu_runtime_compile": "1"} or {"emu_kernel_libs": ...}) runs the emulated Metal device (tests only).
    Metal that is unavailable (no device, a kernel that does not compile) raises BackendUnavailableError
    with backend="metal"; backend="auto" then runs on the CPU and warns (RuntimeWarning) with the reason.
    mtp: the multi-token-prediction head (Model.mtp, lily.mtp_source): None = the checkpoint's own if it has one,
    False = none, True = the checkpoint's own (an error without), or a folder / .safetensors file / Hugging Face repo
    id to take it from (only the shards its index lists for mtp.* are downloaded); a source that does not match
    the model or is damaged raises CheckpointError and nothing loads.
    """
    factory, backend_name = _engine_factory(backend, backend_options)
    if path_or_repo_id is None:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise CheckpointError(
                f"[lily.load] no model given and this install has no bundled default model (looked in "
                f"{BUNDLED_MODEL_DIR}); pass a local checkpoint folder or a Hugging Face repo id, e.g. "
                f"lily.load('mlx-community/Qwen3.6-35B-A3B-4bit')")
        path_or_repo_id = BUNDLED_MODEL_DIR
    from .mtp_source import load_with_mtp

    ckpt = load_with_mtp(path_or_repo_id, mtp=mtp)
    cfg = ckpt.config if isinstance(ckpt.config, ModelConfig) else ModelConfig.from_dict(ckpt.config)
    if max_context is None:
        max_context = min(DEFAULT_MAX_CONTEXT, cfg.max_position_embeddings)
    if not isinstance(max_context, int) or max_context < 1:
        raise ValueError(f"[lily.load] max_context={max_context!r} is invalid: expected an integer >= 1")
    if max_context > cfg.max_position_embeddings:
        raise ContextLengthError(f"[lily.load] max_context={max_context} exceeds the model's context length "
                                 f"{cfg.max_position_embeddings} (max_position_embeddings in config.json)")
    if ckpt.tokenizer_path is None:
        raise CheckpointError(f"[lily.load] {ckpt.path} has no tokenizer.json: lily needs the checkpoint's "
                              f"tokenizer to encode prompts")
    engine_config = cfg if backend_name == "reference" else cfg.to_dict()
    tensors, quant = ckpt.tensors, ckpt.quant
    if ckpt.mtp is not None and backend_name != "reference":  # the engine runs the head (speculative decoding)
        tensors, quant = {**tensors, **ckpt.mtp.tensors}, {**quant, **ckpt.mtp.quant}
    engine = factory(engine_config, tensors, quant, threads=threads, max_context=max_context)
    tokenizer = Tokenizer(ckpt.tokenizer_path)
    template = ChatTemplate(ckpt.chat_template, _special_token_strings(ckpt.tokenizer_path), origin=str(ckpt.path))
    return Model(engine, tokenizer, cfg, chat_template=template, generation_config=ckpt.generation_config,
                 path=ckpt.path, nbytes=ckpt.nbytes, params=_count_params(ckpt.tensors, ckpt.quant),
                 chunk_size=chunk_size, weights_digest=weights_digest(ckpt.tensors), mtp=ckpt.mtp)
