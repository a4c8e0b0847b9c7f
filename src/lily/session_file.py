"""Session files: the snapshots on one token path of a session (or of a prefix cache) in one safetensors file.

The KV cache is append-only, so the longest snapshot's KV serves all shorter ones on that path; each snapshot
adds only its fixed-size recurrent state (DeltaNet + conv) and its logits row. The file carries the model
fingerprint (lily.identity.ModelIdentity) and is refused by another model.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import LilyError
from .identity import ModelIdentity
from .snapshot import SessionSnapshot

SESSION_FORMAT = "lily.session"
SESSION_VERSION = "1"
SESSION_SUFFIX = ".lily-session.safetensors"


class SessionFileError(LilyError, ValueError):
    """A session file is unreadable, of another format, or from another model."""


def save_session_file(path: str | os.PathLike, chain: Sequence[SessionSnapshot], owner: ModelIdentity,
                      pending: Sequence[int] = (), metadata: Mapping[str, Any] | None = None) -> Path:
    """Write snapshots that lie on one token path (each a prefix of the next) of the model `owner` to a
    safetensors file."""
    from safetensors.numpy import save_file

    if not chain:
        raise ValueError("[save_session_file] nothing to save: expected at least one snapshot")
    chain = sorted(chain, key=lambda s: len(s.tokens))
    head = chain[-1]
    tokens = np.asarray(head.tokens, np.int32)
    for s in chain[:-1]:
        if tuple(s.tokens) != tuple(head.tokens[:len(s.tokens)]):
            raise ValueError("[save_session_file] the snapshots do not lie on one path: each must be a prefix "
                             "of the longest")
    arrays: dict[str, np.ndarray] = {"tokens": tokens, "pending": np.asarray(list(pending), np.int32),
                                     "checkpoints": np.asarray([len(s.tokens) for s in chain], np.int64)}
    for j, s in enumerate(chain):
        exported = s.state.export_arrays()
        for name, a in exported.items():
            if name.startswith("kv."):
                if s is head:
                    arrays[name] = np.ascontiguousarray(a)
            elif name != "position":
                arrays[f"ckpt{j}.{name}"] = np.ascontiguousarray(a)
        if s.last_logits is not None:
            arrays[f"ckpt{j}.logits"] = np.ascontiguousarray(s.last_logits, np.float32)
    meta = {"format": SESSION_FORMAT, "version": SESSION_VERSION, "fingerprint": owner.fingerprint,
            "model": str(owner.path), "vocab_size": str(owner.vocab_size),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if metadata:
        meta["user"] = json.dumps(dict(metadata), ensure_ascii=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(arrays, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def read_session_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types
        raise SessionFileError(f"[load_session] {path} is not a readable safetensors file: {e}") from None


def read_session_user_metadata(path: str | os.PathLike) -> dict[str, Any]:
    raw = read_session_metadata(path).get("user")
    return json.loads(raw) if raw else {}


def load_session_file(path: str | os.PathLike, owner: ModelIdentity, engine: Any
                      ) -> tuple[list[SessionSnapshot], list[int]]:
    """Read a session file back into states of `engine` (new_state(), max_context), which runs the model `owner`:
    (snapshots on its path, shortest first; pending tokens of the last). SessionFileError for another model's
    file, or one that does not fit the engine."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise SessionFileError(f"[load_session] {path} does not exist")
    meta = read_session_metadata(path)
    if meta.get("format") != SESSION_FORMAT:
        raise SessionFileError(f"[load_session] {path} is not a lily session file (metadata format="
                               f"{meta.get('format')!r}, expected {SESSION_FORMAT!r})")
    if meta.get("version") != SESSION_VERSION:
        raise SessionFileError(f"[load_session] {path} has session format version {meta.get('version')!r}; this "
                               f"lily reads version {SESSION_VERSION}")
    if meta.get("fingerprint") != owner.fingerprint:
        raise SessionFileError(
            f"[load_session] {path} was saved from another model (fingerprint {meta.get('fingerprint')}, "
            f"model {meta.get('model')}), not from the loaded one (fingerprint {owner.fingerprint}, model "
            f"{owner.path}): a session state only makes sense with the exact weights that produced it")
    arrays = load_file(str(path))
    tokens = arrays["tokens"].astype(np.int64).tolist()
    max_context = int(engine.max_context)
    if len(tokens) > max_context:
        raise SessionFileError(f"[load_session] {path} holds {len(tokens)} tokens, more than this model's "
                               f"context size {max_context} (load it with a larger max_context)")
    kv = {k: v for k, v in arrays.items() if k.startswith("kv.")}
    snaps = []
    for j, p in enumerate(int(x) for x in arrays["checkpoints"]):
        d: dict[str, Any] = {"position": np.int64(p)}
        d.update({k: v[:p] for k, v in kv.items()})
        prefix = f"ckpt{j}."
        d.update({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix) and k != prefix + "logits"})
        state = engine.new_state()
        try:
            state.import_arrays(d)
        except (ValueError, KeyError, TypeError) as e:
            raise SessionFileError(f"[load_session] {path}: checkpoint {j} does not fit this engine: {e}") from None
        logits = arrays.get(prefix + "logits")
        snaps.append(SessionSnapshot(state, tuple(tokens[:p]), (), None if logits is None else logits.copy()))
    return snaps, arrays["pending"].astype(np.int64).tolist()
