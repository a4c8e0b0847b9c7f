"""Load a Qwen3.5/3.6-MoE checkpoint into the engine-contract format (docs/engine_contract.md).

Sources:
  * MLX exports (mlx-community 4-bit/8-bit, mlx-lm / mlx-vlm): `language_model.model.*` or `model.*`
    names, quantized modules as weight (U32) + scales + biases (BF16). Tensors are returned as
    read-only memory maps of the shards (zero copy).
  * Hugging Face bf16 originals (`model.language_model.*`, fused `experts.gate_up_proj` or per-expert
    `experts.{e}.*_proj`, conv1d [C,1,K], zero-centred norms): converted exactly as
    `mlx_lm.convert -q` would (docs/model.md §2.3; mlx_lm qwen3_5 sanitize + quant_predicate), so the
    result is bit-identical to an MLX 4-bit export of the same weights.

Every tensor the architecture needs is checked (presence, shape from the config, dtype) with a
CheckpointError naming the tensor and what was expected. The MTP head (`mtp.*`, docs/model.md §7) is not read
here: lily.mtp_source reads it under the same rules (`load_with_mtp`), kept apart from the main model's tensors.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .config import ModelConfig, QuantSpec
from .errors import CheckpointError
from .quant import bf16_to_f32, f32_to_bf16, quantize, round_bf16
from .safetensors_mmap import SafetensorsFile

# files a checkpoint needs besides the weights
META_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.txt"]
# the conversion rule of mlx-lm for this model (qwen3_5.quant_predicate): 8-bit router and shared
# expert gate, 4-bit group 64 elsewhere; modules whose in-dim is not a multiple of 64 stay dense
CONVERT_GROUP = 64
CONVERT_BITS = 4
EIGHT_BIT_SUFFIXES = (".mlp.gate", ".shared_expert_gate")
# norms that HF stores zero-centred (x * (1 + w)); linear_attn.norm is NOT one of them
SHIFTED_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                         ".q_norm.weight", ".k_norm.weight")
# elements per quantization work item: ~16 MB of float32 per temporary, so 16 threads stay near 1 GB
_CHUNK_ELEMS = 4 * 1024 * 1024


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    tensors: dict[str, np.ndarray]
    quant: dict[str, tuple[int, int]]
    path: Path
    tokenizer_path: Path | None
    chat_template: str | None
    generation_config: dict[str, Any]
    nbytes: int
    source_format: str = "mlx"          # "mlx" (pre-quantized / dense MLX export) or "hf" (converted)
    raw_config: dict[str, Any] = field(default_factory=dict)
    mtp: Any = None                     # lily.mtp_source.MtpWeights (load_with_mtp sets it), or None: no MTP head


# ---- where the files are -----------------------------------------------------------------------------
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint(path_or_repo_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder, or a Hugging Face repo id fetched with snapshot_download (HF cache,
    HF_HUB_OFFLINE honoured). Only the config/tokenizer files and the shards holding text tensors
    are downloaded (the vision tower of an HF repo is skipped when its index allows it)."""
    p = Path(path_or_repo_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"[lily.load] {p} is a file; pass the checkpoint folder that holds config.json")
    s = str(path_or_repo_id)
    if not _REPO_ID.match(s):
        raise CheckpointError(f"[lily.load] {s}: no such folder, and not a Hugging Face repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        folder = Path(snapshot_download(s, revision=revision, allow_patterns=META_PATTERNS))
        index = folder / "model.safetensors.index.json"
        shards: list[str] = ["*.safetensors"]
        if index.is_file():
            try:
                wm = json.loads(index.read_text()).get("weight_map", {})
                shards = sorted({f for n, f in wm.items() if _contract_name(n) is not None}) or shards
            except (json.JSONDecodeError, AttributeError):
                pass  # load_checkpoint reports the bad index
        folder = Path(snapshot_download(s, revision=revision, allow_patterns=META_PATTERNS + shards))
    except CheckpointError:
        raise
    except Exception as e:  # network, auth, offline-and-not-cached, unknown repo
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise CheckpointError(f"[lily.load] could not get {s!r} from the Hugging Face Hub{hint}: "
                              f"{type(e).__name__}: {e}") from None
    return folder


# ---- names -------------------------------------------------------------------------------------------
# where exports put the MTP head: HF originals at the top level, MLX exports under language_model.
_MTP_PREFIXES = ("mtp.", "language_model.mtp.", "model.language_model.mtp.", "language_model.model.mtp.", "model.mtp.")


def _contract_name(name: str) -> str | None:
    """Checkpoint tensor name -> contract name (`model.*` / `lm_head.*`; `mtp.*` for the MTP head), None for
    tensors lily skips (vision tower), or the name unchanged when it is not recognised."""
    if name.startswith(("vision_tower.", "model.visual.", "visual.")):
        return None
    for pre in _MTP_PREFIXES:
        if name.startswith(pre):
            return "mtp." + name[len(pre):]
    for pre, rep in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model.")):
        if name.startswith(pre):
            return rep + name[len(pre):]
    return name


def expected_modules(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(linear modules -> logical weight shape (out, in) / (E, out, in),
        vector tensors -> shape) for every tensor the architecture needs."""
    lin: dict[str, tuple[int, ...]] = {"model.embed_tokens": (cfg.vocab_size, cfg.hidden_size)}
    vec: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        layer_lin, layer_vec = layer_modules(cfg, f"model.layers.{i}", cfg.is_attention(i))
        lin.update(layer_lin)
        vec.update(layer_vec)
    vec["model.norm.weight"] = (cfg.hidden_size,)
    lin["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return lin, vec


def layer_modules(cfg: ModelConfig, p: str, attention: bool
                  ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """expected_modules' tables for one decoder layer under prefix p ("model.layers.3", "mtp.layers.0"): its
    mixer (gated attention or Gated DeltaNet), its norms and its sparse MoE."""
    H, E = cfg.hidden_size, cfg.num_experts
    I, SI = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    lin: dict[str, tuple[int, ...]] = {}
    vec: dict[str, tuple[int, ...]] = {p + ".input_layernorm.weight": (H,),
                                       p + ".post_attention_layernorm.weight": (H,)}
    if attention:
        a, D = p + ".self_attn", cfg.head_dim
        lin[a + ".q_proj"] = (2 * cfg.num_attention_heads * D, H)
        lin[a + ".k_proj"] = (cfg.num_key_value_heads * D, H)
        lin[a + ".v_proj"] = (cfg.num_key_value_heads * D, H)
        lin[a + ".o_proj"] = (H, cfg.num_attention_heads * D)
        vec[a + ".q_norm.weight"] = (D,)
        vec[a + ".k_norm.weight"] = (D,)
    else:
        a, Hv = p + ".linear_attn", cfg.linear_num_value_heads
        lin[a + ".in_proj_qkv"] = (cfg.conv_dim, H)
        lin[a + ".in_proj_z"] = (cfg.linear_value_dim, H)
        lin[a + ".in_proj_b"] = (Hv, H)
        lin[a + ".in_proj_a"] = (Hv, H)
        lin[a + ".out_proj"] = (H, cfg.linear_value_dim)
        vec[a + ".conv1d.weight"] = (cfg.conv_dim, cfg.linear_conv_kernel_dim, 1)
        vec[a + ".dt_bias"] = (Hv,)
        vec[a + ".A_log"] = (Hv,)
        vec[a + ".norm.weight"] = (cfg.linear_value_head_dim,)
    f = p + ".mlp"
    lin[f + ".gate"] = (E, H)
    lin[f + ".switch_mlp.gate_proj"] = (E, I, H)
    lin[f + ".switch_mlp.up_proj"] = (E, I, H)
    lin[f + ".switch_mlp.down_proj"] = (E, H, I)
    lin[f + ".shared_expert.gate_proj"] = (SI, H)
    lin[f + ".shared_expert.up_proj"] = (SI, H)
    lin[f + ".shared_expert.down_proj"] = (H, SI)
    lin[f + ".shared_expert_gate"] = (1, H)
    return lin, vec


def convert_spec(module: str, in_dim: int) -> tuple[int, int] | None:
    """(bits, group) mlx-lm gives `module` when converting this model, None = stays dense."""
    if in_dim % CONVERT_GROUP:
        return None
    return (8 if module.endswith(EIGHT_BIT_SUFFIXES) else CONVERT_BITS), CONVERT_GROUP


# ---- lazily read source tensors ----------------------------------------------------------------------
@dataclass
class _Src:
    """A source tensor in its checkpoint dtype, possibly assembled from HF pieces; read(lo, hi)
    returns rows lo:hi of axis 0 (a memmap view when no assembly is needed)."""
    name: str                      # name in the file, for messages
    tag: str                       # safetensors dtype tag
    shape: tuple[int, ...]
    read_rows: Callable[[int, int], np.ndarray]

    def read(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self.read_rows(lo, self.shape[0] if hi is None else hi)


def _direct(f: SafetensorsFile, name: str) -> _Src:
    arr = f[name]
    return _Src(name, f.dtype(name), f.shape(name), lambda lo, hi: arr[lo:hi] if arr.ndim else arr)


class _Sources:
    """Every tensor of every shard by contract name, with the HF layouts mapped to MLX's; the MTP head's only with
    mtp=True (lily.mtp_source)."""

    def __init__(self, files: dict[str, SafetensorsFile], mtp: bool = False):
        self.src: dict[str, _Src] = {}
        self.skipped = 0
        for fname, f in files.items():
            for name in f:
                cn = _contract_name(name)
                if cn is None or (cn.startswith("mtp.") and not mtp):
                    self.skipped += 1
                    continue
                if cn in self.src:
                    raise CheckpointError(f"[lily.load] tensor {name} appears twice (in {fname} and "
                                          f"as {self.src[cn].name})")
                self.src[cn] = _direct(f, name)
        self._map_hf_experts()

    def _map_hf_experts(self) -> None:
        """HF expert layouts -> switch_mlp.{gate,up,down}_proj.weight [E, out, in]."""
        for cn in [n for n in self.src if n.endswith(".mlp.experts.gate_up_proj")]:
            pre = cn[: -len(".experts.gate_up_proj")]
            gu = self.src.pop(cn)
            if len(gu.shape) != 3 or gu.shape[1] % 2:
                raise CheckpointError(f"[lily.load] tensor {gu.name} has shape {gu.shape}, expected "
                                      f"[E, 2*moe_intermediate_size, hidden]")
            mid = gu.shape[1] // 2  # gate first, then up (mlx_lm qwen3_5_moe sanitize)
            for k, sl in (("gate_proj", slice(0, mid)), ("up_proj", slice(mid, None))):
                self.src[f"{pre}.switch_mlp.{k}.weight"] = _Src(
                    gu.name, gu.tag, (gu.shape[0], mid, gu.shape[2]),
                    lambda lo, hi, gu=gu, sl=sl: gu.read(lo, hi)[:, sl])
            if f"{pre}.experts.down_proj" in self.src:
                self.src[f"{pre}.switch_mlp.down_proj.weight"] = self.src.pop(f"{pre}.experts.down_proj")
        per_expert = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        groups: dict[tuple[str, str], dict[int, _Src]] = {}
        for cn in list(self.src):
            m = per_expert.match(cn)
            if m:
                groups.setdefault((m[1], m[3]), {})[int(m[2])] = self.src.pop(cn)
        for (pre, k), parts in groups.items():
            n = len(parts)
            if sorted(parts) != list(range(n)):
                missing = sorted(set(range(max(parts) + 1)) - set(parts))
                raise CheckpointError(f"[lily.load] missing tensor {pre}.experts.{missing[0]}.{k}.weight "
                                      f"(per-expert layout)")
            first = parts[0]
            if any(p.shape != first.shape or p.tag != first.tag for p in parts.values()):
                raise CheckpointError(f"[lily.load] the per-expert tensors {pre}.experts.*.{k}.weight "
                                      f"differ in shape or dtype")
            self.src[f"{pre}.switch_mlp.{k}.weight"] = _Src(
                f"{pre}.experts.*.{k}.weight", first.tag, (n, *first.shape),
                lambda lo, hi, parts=parts: np.stack([parts[e].read() for e in range(lo, hi)]))


# ---- loading -----------------------------------------------------------------------------------------
def _shard_files(folder: Path) -> dict[str, SafetensorsFile]:
    """The shards holding the main model's tensors (a shard of the MTP head alone is lily.mtp_source's to open)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"[lily.load] {index} is not a valid safetensors index: "
                                  f"{type(e).__name__}: {e}") from None
        names = sorted({f for n, f in wm.items()
                        if (cn := _contract_name(n)) is not None and not cn.startswith("mtp.")})
        for n in names:
            if not (folder / n).is_file():
                raise CheckpointError(f"[lily.load] {index} lists shard {n} but {folder / n} is missing "
                                      f"(incomplete download?)")
        files = {n: SafetensorsFile(folder / n) for n in names}
        for t, n in wm.items():
            if n in files and t not in files[n]:
                raise CheckpointError(f"[lily.load] {index} says tensor {t} is in {n}, but that shard "
                                      f"does not contain it (shards from different exports?)")
        return files
    if (folder / "model.safetensors").is_file():
        return {"model.safetensors": SafetensorsFile(folder / "model.safetensors")}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"[lily.load] {folder} has no model.safetensors or model.safetensors.index.json")
    return {n: SafetensorsFile(folder / n) for n in found}


def _progress_disabled(progress: bool | None) -> bool | None:
    """tqdm's `disable`: None (the default) shows the bar only on a terminal, so logs and pipes never get
    a leftover `Loading ...: 0%` line."""
    if progress is not None:
        return not progress
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() in ("1", "true", "yes", "on"):
        return True
    return None


def load_checkpoint(path_or_repo_id: str | os.PathLike, *, revision: str | None = None,
                    quantize_dense: bool = True, progress: bool | None = None,
                    threads: int = 0) -> LoadedCheckpoint:
    """Load a checkpoint folder or HF repo id into the engine-contract format.

    quantize_dense: an unquantized checkpoint (HF bf16 or a dense MLX export) is quantized at load
        like `mlx_lm.convert -q` (4-bit g64, router and shared-expert gate 8-bit); False keeps it
        dense bf16.
    progress: tqdm bar (None = on a terminal, unless HF_HUB_DISABLE_PROGRESS_BARS is set).
    threads: worker threads for quantizing at load (0 = all cores, up to 16).
    The MTP head's tensors are skipped (lily.mtp_source.load_with_mtp loads them too).
    """
    folder = resolve_checkpoint(path_or_repo_id, revision)
    cfg_path = folder / "config.json"
    raw = _read_json(cfg_path, required=True)
    cfg = ModelConfig.from_dict(raw, source=str(cfg_path))
    sources = _Sources(_shard_files(folder))
    lin, vec = expected_modules(cfg)

    quantized_src = any(n.endswith(".scales") for n in sources.src)
    convert = quantize_dense and not quantized_src
    hf_layout = _is_hf_layout(sources, cfg)
    what = ("bf16" if not quantized_src else
            f"{cfg.quant_default.bits}-bit" if cfg.quant_default else "quantized")
    ctx = _Ctx(cfg, sources, convert, what, threads or min(16, os.cpu_count() or 1))

    from tqdm.auto import tqdm
    tensors: dict[str, np.ndarray] = {}
    quant: dict[str, tuple[int, int]] = {}
    bar = tqdm(total=len(lin) + len(vec), unit="tensor", desc=f"Loading {folder.name}",
               disable=_progress_disabled(progress), leave=False, delay=0.5)  # no flash for a quick load
    nbytes = 0

    def advance(names: tuple[str, ...]) -> None:
        nonlocal nbytes
        nbytes += sum(tensors[n].nbytes for n in names if n in tensors)
        bar.set_postfix_str(f"{nbytes / 2**30:.2f} GiB", refresh=False)
        bar.update(1)
    try:
        for module, shape in lin.items():
            spec = ctx.linear(module, shape, tensors)
            if spec is not None:
                quant[module] = spec
            advance((module + ".weight", module + ".scales", module + ".biases"))
        for name, shape in vec.items():
            shift = hf_layout and (name.endswith(SHIFTED_NORM_SUFFIXES) or name == "model.norm.weight")
            tensors[name] = ctx.vector(name, shape, shift=shift)
            advance((name,))
    finally:
        bar.close()

    extra = sorted(set(sources.src) - ctx.used)
    _check_no_layers_beyond(extra, cfg.num_hidden_layers, cfg_path)
    if extra:
        warnings.warn(f"[lily.load] {len(extra)} tensor(s) in the checkpoint are not used by the "
                      f"Qwen3.5/3.6-MoE text model and were ignored: {', '.join(extra[:5])}"
                      f"{' ...' if len(extra) > 5 else ''}", stacklevel=2)
    cfg = _with_quant(cfg, lin, quant)
    tok = folder / "tokenizer.json"
    return LoadedCheckpoint(
        config=cfg, tensors=tensors, quant=quant, path=folder,
        tokenizer_path=tok if tok.is_file() else None,
        chat_template=_chat_template(folder),
        generation_config=_read_json(folder / "generation_config.json", required=False) or {},
        nbytes=nbytes,
        source_format="hf" if hf_layout else "mlx", raw_config=raw)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _check_no_layers_beyond(unused: list[str], n_layers: int, cfg_path: Path) -> None:
    """Tensors of layers past num_hidden_layers mean the config does not describe these weights (a model
    cut short would run, and answer, without them): refused rather than ignored."""
    beyond = sorted({int(m[1]) for n in unused if (m := _LAYER_INDEX.match(n)) and int(m[1]) >= n_layers})
    if beyond:
        raise CheckpointError(f"[lily.load] {cfg_path} says num_hidden_layers={n_layers}, but the checkpoint has "
                              f"tensors of layer{'s' if len(beyond) > 1 else ''} "
                              f"{', '.join(map(str, beyond[:8]))}{' ...' if len(beyond) > 8 else ''} as well: the "
                              f"config does not describe these weights (expected num_hidden_layers="
                              f"{beyond[-1] + 1}, or the config.json that came with them)")


# bf16 bytes read as f16 land almost all in one or two binades ([0.5, 2)); real weights span about 7
_F16_SAMPLE = 1 << 16
_F16_MIN_SPREAD = 2.0


def _check_f16_bytes(s: _Src) -> None:
    """CheckpointError for a tensor labelled F16 whose bytes are bfloat16 (a mislabelled export would load
    as garbage weights and generate noise). Judged on up to 64K values of a matrix or conv weight: the spread
    of log2|x| (1st to 99th percentile) as f16 is under 2 binades, and as bf16 a plausible one."""
    if s.tag != "F16" or int(np.prod(s.shape)) < 256:
        return
    rows = max(1, min(s.shape[0], _F16_SAMPLE // max(1, int(np.prod(s.shape[1:])))))
    bits = np.ascontiguousarray(s.read(0, rows)).reshape(-1)[:_F16_SAMPLE].view(np.uint16)

    def spread(x: np.ndarray) -> float:
        a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
        if a.size < 64:
            return float("inf")
        lo, hi = np.percentile(np.log2(a), [1, 99])
        return float(hi - lo)

    as_f16, as_bf16 = spread(bits.view(np.float16).astype(np.float32)), spread(bf16_to_f32(bits))
    if as_f16 < _F16_MIN_SPREAD and 3.0 <= as_bf16 <= 30.0:
        raise CheckpointError(f"[lily.load] tensor {s.name} is labelled F16, but its bytes are bfloat16: read as "
                              f"f16 its values span {as_f16:.1f} binades (weights span about 7), read as bf16 "
                              f"{as_bf16:.1f}; the file's header has the wrong dtype (expected BF16 for these "
                              f"bytes; re-export the checkpoint)")


def _is_hf_layout(sources: _Sources, cfg: ModelConfig) -> bool:
    """True for HF-original weights (zero-centred norms, conv1d [C,1,K]). mlx-lm decides the norm
    shift by the conv1d layout; we do too, so a converted MLX checkpoint is never shifted twice."""
    for n, s in sources.src.items():
        if n.endswith(".linear_attn.conv1d.weight") and len(s.shape) == 3:
            if s.shape[-1] != 1:
                return True
            if s.shape[1] != 1:
                return False
    # kernel size 1 is ambiguous: fall back to the HF names
    return any(s.name.startswith("model.language_model.") for s in sources.src.values())


def _with_quant(cfg: ModelConfig, lin: dict[str, tuple[int, ...]],
                quant: dict[str, tuple[int, int]]) -> ModelConfig:
    """cfg whose quant_for() describes exactly the loaded tensors."""
    if not quant:
        return dataclasses.replace(cfg, quant_default=None, quant_overrides={})
    (bits, group), _ = Counter(quant.values()).most_common(1)[0]
    default = QuantSpec(bits, group)
    over: dict[str, QuantSpec | None] = {}
    for m in lin:
        spec = quant.get(m)
        if spec is None:
            over[m] = None
        elif spec != (bits, group):
            over[m] = QuantSpec(*spec)
    return dataclasses.replace(cfg, quant_default=default, quant_overrides=over)


class _Ctx:
    def __init__(self, cfg: ModelConfig, sources: _Sources, convert: bool, what: str, threads: int):
        self.cfg, self.src, self.convert, self.threads = cfg, sources.src, convert, threads
        self.suffix = f": the checkpoint is not a Qwen3.5/3.6-MoE {what} export"
        self.used: set[str] = set()

    def get(self, name: str) -> _Src:
        s = self.src.get(name)
        if s is None:
            raise CheckpointError(f"[lily.load] missing tensor {name}{self.suffix}")
        self.used.add(name)
        return s

    def check(self, s: _Src, shape: tuple[int, ...], tags: tuple[str, ...]) -> None:
        if s.shape != tuple(shape):
            raise CheckpointError(f"[lily.load] tensor {s.name} has shape {s.shape}, expected "
                                  f"{tuple(shape)}{self.suffix}")
        if s.tag not in tags:
            raise CheckpointError(f"[lily.load] tensor {s.name} has dtype {s.tag}, expected "
                                  f"{' or '.join(tags)}{self.suffix}")

    # -- quantized or dense linear modules --
    def linear(self, module: str, shape: tuple[int, ...], out: dict[str, np.ndarray]) -> tuple[int, int] | None:
        *lead, o, i = shape
        if module + ".scales" in self.src:
            w, s, b = self.get(module + ".weight"), self.get(module + ".scales"), self.get(module + ".biases")
            spec = self._quant_spec(module, i, w, s)
            bits, group = spec
            self.check(w, (*lead, o, i * bits // 32), ("U32",))
            self.check(s, (*lead, o, i // group), ("BF16",))
            self.check(b, (*lead, o, i // group), ("BF16",))
            out[module + ".weight"], out[module + ".scales"], out[module + ".biases"] = w.read(), s.read(), b.read()
            return spec
        w = self.get(module + ".weight")
        if w.tag == "U32":
            raise CheckpointError(f"[lily.load] missing tensor {module}.scales: "
                                  f"{w.name} is packed (U32) but has no scales/biases{self.suffix}")
        self.check(w, shape, ("BF16", "F16", "F32"))
        _check_f16_bytes(w)
        spec = convert_spec(module, i) if self.convert else None
        if spec is None:
            if w.tag == "BF16" or (w.tag == "F32" and not self.convert):
                x = w.read()                                  # zero-copy memmap when contiguous
            elif self.convert:
                x = f32_to_bf16(_as_f32(w.read(), w.tag))     # mlx-lm casts to bf16 when converting
            else:
                x = _as_f32(w.read(), w.tag)                  # F16: the contract has no f16
            out[module + ".weight"] = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            return None
        out[module + ".weight"], out[module + ".scales"], out[module + ".biases"] = self._quantize(w, *spec)
        return spec

    def _quant_spec(self, module: str, in_dim: int, w: _Src, s: _Src) -> tuple[int, int]:
        """(bits, group) from the config, cross-checked with the shapes (mlx-lm infer_quant_config)."""
        if self.cfg.quant_default is not None or module in self.cfg.quant_overrides:
            want = self.cfg.quant_for(module)
            if want is None:
                raise CheckpointError(f"[lily.load] config.json says {module} is not quantized, but the "
                                      f"checkpoint has {s.name}{self.suffix}")
            return want.bits, want.group_size
        # no quantization block: infer from the shapes, accept only what the engines implement
        ok = (len(w.shape) >= 2 and len(s.shape) >= 2 and s.shape[-1] and in_dim % s.shape[-1] == 0
              and (32 * w.shape[-1]) % in_dim == 0)
        bits = 32 * w.shape[-1] // in_dim if ok else 0
        group = in_dim // s.shape[-1] if ok else 0
        if bits not in (4, 8) or group not in (32, 64, 128):
            raise CheckpointError(f"[lily.load] tensors {w.name} {w.shape} / {s.name} {s.shape} are not a 4- or "
                                  f"8-bit quantization of in-dim {in_dim} with group 32/64/128{self.suffix}")
        return bits, group

    def _quantize(self, w: _Src, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Quantize in row chunks on a thread pool (NumPy releases the GIL), exactly as mx.quantize
        does on the bf16 weight (mlx-lm casts to bf16 before quantizing)."""
        rows = w.shape[0]
        per = max(1, _CHUNK_ELEMS // max(1, int(np.prod(w.shape[1:]))))
        spans = [(lo, min(rows, lo + per)) for lo in range(0, rows, per)]

        def work(span: tuple[int, int]):
            x = _as_f32(w.read(*span), w.tag)
            if w.tag != "BF16":
                x = round_bf16(x)
            return quantize(x, bits, group)

        if len(spans) == 1 or self.threads <= 1:
            parts = [work(sp) for sp in spans]
        else:
            with cf.ThreadPoolExecutor(min(self.threads, len(spans))) as ex:
                parts = list(ex.map(work, spans))
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]

    # -- norms, conv1d, dt_bias, A_log: float32 --
    def vector(self, name: str, shape: tuple[int, ...], shift: bool) -> np.ndarray:
        s = self.get(name)
        if name.endswith(".conv1d.weight") and len(s.shape) == 3 and s.shape[1] == 1 and s.shape[2] != 1:
            x = np.moveaxis(_as_f32(s.read(), s.tag), 2, 1)   # HF [C, 1, K] -> MLX [C, K, 1]
            s = dataclasses.replace(s, shape=x.shape)
        else:
            x = None
        self.check(s, shape, ("BF16", "F16", "F32"))
        if name.endswith(".conv1d.weight") and x is None:  # norms sit near 1: only matrices and convs are judged
            _check_f16_bytes(s)
        if x is None:
            x = _as_f32(s.read(), s.tag)
        if shift:
            # HF stores zero-centred norm weights; MLX adds 1 in the checkpoint dtype (bf16)
            return round_bf16(x + np.float32(1.0))
        if self.convert and not name.endswith(".A_log"):
            # mlx-lm casts every float tensor but A_log to bf16 when converting
            x = round_bf16(x)
        return np.ascontiguousarray(x, dtype=np.float32)


def _as_f32(x: np.ndarray, tag: str) -> np.ndarray:
    if tag == "BF16":
        return bf16_to_f32(x)
    return np.asarray(x, dtype=np.float32)


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise CheckpointError(f"[lily.load] {path} not found: a checkpoint folder needs a config.json") from None
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"[lily.load] {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"[lily.load] {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template(folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (string or named list)."""
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    tc = _read_json(folder / "tokenizer_config.json", required=False) or {}
    t = tc.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) else None
