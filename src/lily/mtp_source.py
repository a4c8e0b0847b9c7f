"""The MTP head's weights (docs/model.md §7): one gated-attention + MoE decoder layer and its norms and fc, that
drafts token t+2 from the main model's hidden state at t and the embedding of token t+1.

Where they come from: the checkpoint itself (Hugging Face originals ship `mtp.*`; lily's own exports keep it as
`language_model.mtp.*`), or, for a checkpoint without them (mlx-lm's conversion drops every `mtp.*` tensor, so the
mlx-community exports have none), another folder, `.safetensors` file or Hugging Face repo: `lily.load(path,
mtp=SOURCE)`. From a repo only the index and the shard(s) it lists for `mtp.*` are downloaded.

The head is read under the main layers' rules (lily.checkpoint): HF layouts mapped to MLX's (experts split, norms
+ 1), a dense head quantized as mlx-lm would (4-bit g64, the router and shared-expert gate 8-bit), every tensor's
shape checked against the model's config. A source that does not match, or is damaged, is a CheckpointError and
nothing loads. Shapes cannot prove that a head was trained with these main weights (Qwen3.5-35B-A3B and
Qwen3.6-35B-A3B share every shape): `MtpWeights.match` says what was checked; a wrong head only lowers the draft
acceptance, it never changes what speculative decoding outputs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import (SHIFTED_NORM_SUFFIXES, LoadedCheckpoint, _contract_name, _Ctx, _read_json, _Sources,
                         layer_modules, load_checkpoint)
from .config import ModelConfig
from .errors import CheckpointError
from .quant import bf16_to_f32
from .safetensors_mmap import SafetensorsFile

# Qwen3.5/3.6 ship one MTP layer (config mtp_num_hidden_layers = 1); the reference and loader implement that one
MTP_LAYERS = 1
MTP_LAYER_PREFIX = "mtp.layers.0"
# the head's own norms; HF stores them zero-centred (x * (1 + w)) like the decoder layer's (vLLM and SGLang build
# all three as GemmaRMSNorm)
MTP_OWN_NORMS = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
# config fields the head's math depends on: a source whose config.json differs in one belongs to another model
_MATCH_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                 "rms_norm_eps", "rope_theta", "partial_rotary_factor", "vocab_size")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
INDEX = "model.safetensors.index.json"
HF_ORIGINAL_HINT = "the Hugging Face original, e.g. Qwen/Qwen3.6-35B-A3B"
# elements per slice of the finiteness check (16 MB of float32)
_CHECK_ELEMS = 4 * 1024 * 1024


@dataclass
class MtpWeights:
    """The loaded head, kept apart from the main model's tensors (the engine and saved sessions do not see it).

    tensors: contract names (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.scales`, ...: docs/model.md §7),
    MLX layout and convention (norms already 1 + γ, experts as switch_mlp [E, out, in]); quant: module -> (bits,
    group) as lily.checkpoint's; source: where it came from; match: what was checked against the model."""
    tensors: dict[str, np.ndarray]
    quant: dict[str, tuple[int, int]]
    source: str
    match: str
    nbytes: int
    num_layers: int = MTP_LAYERS

    def describe(self) -> str:
        """One line for `lily info`."""
        bits = sorted({b for b, _ in self.quant.values()})
        fmt = "/".join(f"{b}-bit" for b in bits) if bits else "bf16"
        return (f"{self.num_layers} layer ({fmt}, {self.nbytes / 2**20:.1f} MiB) from {self.source}; "
                f"{self.match}")


@dataclass
class MtpSource:
    """An external head opened before the main weights load: its shards and config.json (None when it has none)."""
    files: dict[str, SafetensorsFile]
    raw_config: dict[str, Any] | None
    label: str


def is_mtp_name(name: str) -> bool:
    """True for a checkpoint tensor of the MTP head, under any export's prefix."""
    cn = _contract_name(name)
    return cn is not None and cn.startswith("mtp.")


def expected_mtp_modules(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(linear modules -> logical weight shape, vectors -> shape) of the head, as expected_modules gives them for
    the main model: fc [H, 2H], the three own norms [H], and one full-attention decoder layer with the MoE."""
    H = cfg.hidden_size
    lin, vec = layer_modules(cfg, MTP_LAYER_PREFIX, attention=True)
    return {"mtp.fc": (H, 2 * H), **lin}, {**{n: (H,) for n in MTP_OWN_NORMS}, **vec}


# ---- finding an external head --------------------------------------------------------------------------------------
def open_mtp_source(source: str | os.PathLike) -> MtpSource:
    """A folder, a `.safetensors` file or a Hugging Face repo id -> its MTP shards, opened (nothing is read yet)."""
    p = Path(source).expanduser()
    if p.is_dir():
        return MtpSource(_local_mtp_files(p, str(p)), _read_json(p / "config.json", required=False), str(p))
    if p.is_file():
        if p.suffix != ".safetensors":
            raise CheckpointError(f"[lily.load] MTP source {p} is a file but not a .safetensors file; pass a "
                                  f"folder, a .safetensors file or a Hugging Face repo id")
        files = {p.name: SafetensorsFile(p)}
        if not any(is_mtp_name(n) for n in files[p.name]):
            raise CheckpointError(f"[lily.load] MTP source {p} holds no mtp.* tensor (expected the MTP head of "
                                  f"{HF_ORIGINAL_HINT})")
        return MtpSource(files, _read_json(p.with_name("config.json"), required=False), str(p))
    s = str(source)
    if not _REPO_ID.match(s):
        raise CheckpointError(f"[lily.load] MTP source {s}: no such folder or file, and not a Hugging Face repo id "
                              f"(owner/name)")
    folder, raw = _download_mtp_shards(s)
    return MtpSource(_local_mtp_files(folder, s), raw, s)


def _local_mtp_files(folder: Path, label: str, required: bool = True) -> dict[str, SafetensorsFile]:
    """The shards of folder that hold mtp.* tensors: those its index lists for them, else every *.safetensors that
    has one. Only these are opened, so a source's other shards may be absent. None there: an error, or {} when not
    required (a checkpoint without a head)."""
    index = folder / INDEX
    if index.is_file():
        names = _mtp_shards_of_index(index, label, required)
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"[lily.load] MTP source {label}: its index lists the MTP head in "
                                  f"{', '.join(missing)}, missing from {folder} (incomplete download?)")
        return {n: SafetensorsFile(folder / n) for n in names}
    files = {f.name: SafetensorsFile(f) for f in sorted(folder.glob("*.safetensors"))}
    files = {n: f for n, f in files.items() if any(is_mtp_name(t) for t in f)}
    if not files and required:
        raise CheckpointError(f"[lily.load] MTP source {label} has no mtp.* tensor in any *.safetensors file "
                              f"(expected the MTP head of {HF_ORIGINAL_HINT})")
    return files


def _mtp_shards_of_index(index: Path, label: str, required: bool = True) -> list[str]:
    try:
        wm = json.loads(index.read_text())["weight_map"]
        if not isinstance(wm, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"[lily.load] MTP source {label}: {index} is not a valid safetensors index: "
                              f"{type(e).__name__}: {e}") from None
    names = sorted({f for n, f in wm.items() if is_mtp_name(n)})
    if not names and required:
        raise CheckpointError(f"[lily.load] MTP source {label}: its index lists no mtp.* tensor, so it has no MTP "
                              f"head (mlx-community exports drop it; use {HF_ORIGINAL_HINT})")
    return names


def _download_mtp_shards(repo: str) -> tuple[Path, dict[str, Any] | None]:
    """hf_hub_download of the index, config.json and the shard(s) the index lists for mtp.* (a repo without an
    index: its model.safetensors). Returns the snapshot folder they share, and the config (None if it has none)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    def get(fname: str, wanted: list[str], optional: bool = False) -> Path | None:
        try:
            return Path(hf_hub_download(repo, fname))
        except RemoteEntryNotFoundError:
            if optional:
                return None
            raise CheckpointError(f"[lily.load] MTP source {repo} has no file {fname} on the Hugging Face Hub "
                                  f"(expected the MTP head of {HF_ORIGINAL_HINT})") from None
        except LocalEntryNotFoundError as e:
            if optional and fname == "config.json":
                return None
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            why = "HF_HUB_OFFLINE is set" if offline else f"the Hub cannot be reached ({e})"
            raise CheckpointError(f"[lily.load] MTP source {repo}: {fname} is not in the local Hugging Face cache "
                                  f"and {why}. Get it while online with `hf download {repo} {' '.join(wanted)}`, "
                                  f"then load again") from None
        except Exception as e:  # unknown repo, gated repo, network errors
            raise CheckpointError(f"[lily.load] could not get {fname} of MTP source {repo!r} from the Hugging "
                                  f"Face Hub: {type(e).__name__}: {e}") from None

    index = get(INDEX, [INDEX, "config.json"], optional=True)
    config = get("config.json", ["config.json"], optional=True)
    shards = _mtp_shards_of_index(index, repo) if index is not None else ["model.safetensors"]
    wanted = ([INDEX, "config.json"] if index is not None else []) + shards
    paths = [get(shard, wanted) for shard in shards]
    return paths[0].parent, (_read_json(config, required=False) if config else None)


# ---- loading the head ----------------------------------------------------------------------------------------------
def load_with_mtp(path_or_repo_id: str | os.PathLike, *, mtp: bool | str | os.PathLike | None = None,
                  revision: str | None = None, quantize_dense: bool = True, progress: bool | None = None,
                  threads: int = 0) -> LoadedCheckpoint:
    """load_checkpoint, with its MTP head in `.mtp` (None: none, plain decoding).

    mtp: None = the checkpoint's own head when it has one; True = the checkpoint's own, an error without; False =
    none; a folder, a .safetensors file or a Hugging Face repo id = the head taken from there (opened before the main
    weights load, so a bad source fails fast). A head that does not match the model or is damaged raises
    CheckpointError and nothing loads. The other arguments are load_checkpoint's; a dense head is quantized by the
    main layers' rules unless quantize_dense=False.
    """
    external = open_mtp_source(mtp) if mtp not in (None, True, False) else None
    ck = load_checkpoint(path_or_repo_id, revision=revision, quantize_dense=quantize_dense, progress=progress,
                         threads=threads)
    threads = threads or min(16, os.cpu_count() or 1)
    if external is not None:
        match = _check_source_config(ck.config, external)
        sources = _Sources(external.files, mtp=True)
        ck.mtp = _read_head(ck.config, sources, external.raw_config, quantize_dense, external.label, threads,
                            _hf_layout_of(sources, external.label), match)
        warnings.warn(f"[lily.load] MTP head from {external.label}: {match}", UserWarning, stacklevel=3)
    elif mtp is not False:
        ck.mtp = _own_head(ck, quantize_dense, threads)
        if ck.mtp is None and mtp is True:
            raise CheckpointError(f"[lily.load] {ck.path} has no MTP head (no mtp.* tensor; mlx-lm's conversion "
                                  f"drops it): pass mtp=SOURCE with a folder or repo that has one, e.g. "
                                  f"{HF_ORIGINAL_HINT}")
    return ck


def _own_head(ck: LoadedCheckpoint, quantize_dense: bool, threads: int) -> MtpWeights | None:
    """The head in the checkpoint's own shards (load_checkpoint skipped it), in the model's layout."""
    main_hf = ck.source_format == "hf"
    try:
        sources = _Sources(_local_mtp_files(Path(ck.path), str(ck.path), required=False), mtp=True)
        if not any(n.startswith("mtp.") for n in sources.src):
            return None
        layout = _hf_layout_of(sources, str(ck.path), default=main_hf)
        if layout != main_hf:
            raise CheckpointError(f"[lily.load] {ck.path}: the MTP head is in the {'HF' if layout else 'MLX'} layout "
                                  f"but the model in the {'HF' if main_hf else 'MLX'} one (a head from another "
                                  f"export mixed in?)")
        head = _read_head(ck.config, sources, ck.raw_config, quantize_dense, str(ck.path), threads, layout,
                          "shipped with the model")
        head.source = "the checkpoint"
        return head
    except CheckpointError as e:
        raise CheckpointError(f"{e}; pass mtp=False to load the model without its MTP head") from None


def _hf_layout_of(sources: _Sources, label: str, default: bool | None = None) -> bool:
    """True when the head is in the HF layout (experts as experts.gate_up_proj / experts.{e}.*, zero-centred norms),
    False for MLX's (switch_mlp, norms 1 + γ). The experts decide (every head has them): _Sources gives HF experts
    switch_mlp names, their file names tell the layouts apart. No experts: default (the checkpoint's own head, whose
    missing tensors _read_head then names), else an error."""
    files = [sources.src[n].name for n in sources.src if n.startswith(MTP_LAYER_PREFIX + ".mlp.switch_mlp.")]
    hf, mlx = any(".experts." in f for f in files), any(".switch_mlp." in f for f in files)
    if not (hf or mlx) and default is not None:
        return default
    if hf == mlx:
        raise CheckpointError(f"[lily.load] MTP source {label}: its experts ({MTP_LAYER_PREFIX}.mlp.*) are missing"
                              f" or in two layouts at once (expected HF experts.gate_up_proj / experts.down_proj or"
                              f" MLX switch_mlp.*_proj)")
    return hf


def _read_head(cfg: ModelConfig, sources: _Sources, raw: dict[str, Any] | None, quantize_dense: bool, label: str,
               threads: int, hf_layout: bool, match: str) -> MtpWeights:
    """Every tensor of the head read, mapped and checked like the main model's (lily.checkpoint._Ctx)."""
    _check_layer_count(sources, raw, label)
    qd, qo = (None, {})
    if raw is not None:
        try:
            qcfg = ModelConfig.from_dict(raw, source=f"MTP source {label}")
            qd, qo = qcfg.quant_default, qcfg.quant_overrides
        except CheckpointError:
            pass  # _check_source_config reports a config that is not this architecture
    ctx = _Ctx(dataclasses.replace(cfg, quant_default=qd, quant_overrides=qo), sources, quantize_dense,
               "MTP head", threads)
    ctx.suffix = (f" (MTP head from {label}: expected the Qwen3.5/3.6-MoE MTP layer with this model's shapes, "
                  f"docs/model.md §7)")
    lin, vec = expected_mtp_modules(cfg)
    tensors: dict[str, np.ndarray] = {}
    quant: dict[str, tuple[int, int]] = {}
    for module, shape in lin.items():
        spec = ctx.linear(module, shape, tensors)
        if spec is not None:
            quant[module] = spec
    for name, shape in vec.items():
        shift = hf_layout and (name.endswith(SHIFTED_NORM_SUFFIXES) or name in MTP_OWN_NORMS)
        tensors[name] = ctx.vector(name, shape, shift=shift)
    unused = sorted(n for n in sources.src if n.startswith("mtp.") and n not in ctx.used)
    if unused:
        raise CheckpointError(f"[lily.load] MTP source {label} has tensor(s) the Qwen3.5/3.6-MoE MTP layer does not "
                              f"have: {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    _check_finite(tensors, label)
    nbytes = int(sum(a.nbytes for a in tensors.values()))
    return MtpWeights(tensors, quant, label, match, nbytes)


def _check_layer_count(sources: _Sources, raw: dict[str, Any] | None, label: str) -> None:
    layers = sorted({int(m[1]) for n in sources.src if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))})
    if layers and layers != [0]:
        raise CheckpointError(f"[lily.load] MTP source {label} has MTP layers {layers}: lily runs the one-layer head "
                              f"of Qwen3.5/3.6 (expected mtp.layers.0 only)")
    text = (raw or {}).get("text_config", raw or {})
    n = text.get("mtp_num_hidden_layers")
    if isinstance(n, int) and n > MTP_LAYERS:
        raise CheckpointError(f"[lily.load] MTP source {label}: its config.json says mtp_num_hidden_layers={n}: "
                              f"lily runs the one-layer head of Qwen3.5/3.6 (expected 1)")


def _check_finite(tensors: dict[str, np.ndarray], label: str) -> None:
    """A damaged head (NaN or infinite norms, scales, biases or dense weights; a NaN weight quantizes to a NaN scale)
    is refused: drafts from it would be noise, or NaN logits would stop generation. Read in slices of the first axis
    so a dense bf16 head never needs a float32 copy of a whole expert stack."""
    for name, a in tensors.items():
        if a.dtype == np.uint32:
            continue  # packed codes: every value is a valid code
        step = max(1, _CHECK_ELEMS // max(1, a.size // max(1, a.shape[0])))
        bad = 0
        for lo in range(0, a.shape[0], step):
            part = a[lo:lo + step]
            bad += int(np.count_nonzero(~np.isfinite(bf16_to_f32(part) if a.dtype == np.uint16 else part)))
        if bad:
            raise CheckpointError(f"[lily.load] MTP source {label}: tensor {name} has {bad} NaN or infinite "
                                  f"value(s) (expected finite weights; the file is damaged)")


def _check_source_config(cfg: ModelConfig, source: MtpSource) -> str:
    """CheckpointError when the source's config.json describes another model; else what was checked."""
    if source.raw_config is None:
        return ("its tensors have this model's shapes (it has no config.json to compare); that it was trained with "
                "these main weights cannot be proven from the files")
    other = ModelConfig.from_dict(source.raw_config, source=f"MTP source {source.label}'s config.json")
    diff = [f"{f}: {getattr(other, f)!r} there, {getattr(cfg, f)!r} here" for f in _MATCH_FIELDS
            if getattr(other, f) != getattr(cfg, f)]
    if diff:
        raise CheckpointError(f"[lily.load] MTP source {source.label} belongs to another model: its config.json "
                              f"differs from this model's in {'; '.join(diff)} (expected the same values)")
    return ("its config.json and tensor shapes match this model; that it was trained with these main weights cannot "
            "be proven from the files (Qwen3.5- and Qwen3.6-35B-A3B share every shape): a wrong head only lowers the "
            "draft acceptance")
