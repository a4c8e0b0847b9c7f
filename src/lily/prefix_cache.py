"""Prefix reuse for a hybrid model: a token trie of state snapshots, LRU-bounded in bytes, and session files.

The DeltaNet and conv state cannot be rewound, so a session can only continue from a state that holds
*exactly* a prefix of the new request's tokens. `PrefixCache` keeps snapshots (`SessionSnapshot`: engine
state deep copy + tokens + the logits after the last token) at chosen positions, keyed by their tokens in
a radix trie; `lookup(tokens)` finds the longest stored snapshot that is a prefix of `tokens`.

Which positions are worth a snapshot (`snapshot_points`): turn boundaries, i.e. just before an
`<|im_start|>` token (end of the system prompt, end of each reply as the template re-renders it, end of the
last user/tool turn before the generation prompt), and every `interval` tokens of a long prefill.

Session files (`save_session_file` / `load_session_file`): one safetensors file per trie path. The KV
cache is append-only, so the longest checkpoint's KV serves all shorter ones on that path; each checkpoint
adds only its fixed-size recurrent state (DeltaNet + conv) and its logits row. The file carries the model
fingerprint and is refused by another model.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .errors import LilyError

if TYPE_CHECKING:
    from .model import Model
    from .session import SessionSnapshot

SESSION_FORMAT = "lily.session"
SESSION_VERSION = "1"
SESSION_SUFFIX = ".lily-session.safetensors"
DEFAULT_CACHE_BYTES = 4 << 30
DEFAULT_SNAPSHOT_INTERVAL = 4096
# a snapshot fewer tokens after the state's starting point saves less recompute than the extra prefill piece
# (one more engine call) costs
DEFAULT_MIN_GAP = 64


class SessionFileError(LilyError, ValueError):
    """A session file is unreadable, of another format, or from another model."""


# ---- the trie ------------------------------------------------------------------------------------------
class _Node:
    __slots__ = ("edge", "children", "parent", "entry", "nbytes")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.entry: SessionSnapshot | None = None
        self.nbytes = 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0])


def snapshot_nbytes(snap: "SessionSnapshot") -> int:
    logits = 0 if snap.last_logits is None else int(snap.last_logits.nbytes)
    return int(getattr(snap.state, "nbytes", 0)) + logits + 8 * len(snap.tokens)


class PrefixCache:
    """Snapshots keyed by their tokens (radix trie), least recently used evicted past `max_bytes`.

    cache = PrefixCache(max_bytes=2 << 30)
    session = model.session(prefix_cache=cache)   # snapshots at turn boundaries, reuse across requests
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, interval: int = DEFAULT_SNAPSHOT_INTERVAL,
                 min_gap: int = DEFAULT_MIN_GAP):
        if max_bytes < 0:
            raise ValueError(f"[PrefixCache] max_bytes={max_bytes} is invalid: expected >= 0")
        if interval < 0:
            raise ValueError(f"[PrefixCache] interval={interval} is invalid: expected >= 0 (0 = no periodic "
                             f"snapshots)")
        self.max_bytes = int(max_bytes)
        self.interval = int(interval)
        self.min_gap = int(min_gap)
        self._root = _Node((), None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._files: set[Path] = set()  # session files this cache loaded or wrote (save_dir may replace them)

    # ---- queries ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self)} snapshots, {self.nbytes / 2**20:.1f} of {self.max_bytes / 2**20:.1f} MiB, "
                f"hits={self.hits}, misses={self.misses})")

    def _find(self, tokens: Sequence[int]) -> _Node | None:
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                return None
            node, i = child, i + len(child.edge)
        return node

    def contains(self, tokens: Sequence[int]) -> bool:
        node = self._find(tokens)
        return node is not None and node.entry is not None

    def lookup(self, tokens: Sequence[int], *, touch: bool = True) -> tuple[int, "SessionSnapshot | None"]:
        """The longest stored snapshot usable for `tokens`: its tokens are a prefix of them, and it is
        strictly shorter unless it carries its logits (a generation needs the next-token logits)."""
        node, i, n = self._root, 0, len(tokens)
        best: tuple[int, _Node | None] = (0, None)
        if node.entry is not None and (n > 0 or node.entry.last_logits is not None):
            best = (0, node)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                break
            node, i = child, i + len(child.edge)
            if node.entry is not None and (i < n or node.entry.last_logits is not None):
                best = (i, node)
        length, hit = best
        if hit is None:
            self.misses += 1
            return 0, None
        self.hits += 1
        if touch:
            self._lru.move_to_end(hit)
        return length, hit.entry

    def entries(self) -> list["SessionSnapshot"]:
        """Stored snapshots, least recently used first."""
        return [node.entry for node in self._lru]

    # ---- changes ------------------------------------------------------------------------------------
    def insert(self, snap: "SessionSnapshot") -> bool:
        """Store a snapshot (its pending tokens must be empty: the key is the tokens in its state).
        Returns False when it is larger than the whole budget (nothing stored)."""
        if snap.pending:
            raise ValueError("[PrefixCache.insert] the snapshot has pending tokens (sampled, not run through "
                             "the model); feed them first so the state holds exactly snap.tokens")
        size = snapshot_nbytes(snap)
        if size > self.max_bytes:
            return False
        tokens = tuple(int(t) for t in snap.tokens)
        node = self._insert_node(tokens)
        if node.entry is not None:
            self.nbytes -= node.nbytes
        node.entry, node.nbytes = snap, size
        self.nbytes += size
        self._lru[node] = None
        self._lru.move_to_end(node)
        self._evict(keep=node)
        return True

    def _insert_node(self, tokens: tuple[int, ...]) -> _Node:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                node.children[tokens[i]] = leaf
                return leaf
            k = _common_prefix(child.edge, tokens[i:])
            if k < len(child.edge):  # split the edge
                mid = _Node(child.edge[:k], node)
                node.children[tokens[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + k
        return node

    def remove(self, tokens: Sequence[int]) -> bool:
        node = self._find(tokens)
        if node is None or node.entry is None:
            return False
        self._drop(node)
        return True

    def clear(self) -> None:
        self._root = _Node((), None)
        self._lru.clear()
        self.nbytes = 0

    def _drop(self, node: _Node) -> None:
        self.nbytes -= node.nbytes
        node.entry, node.nbytes = None, 0
        self._lru.pop(node, None)
        # prune empty leaves, then merge a lone child into an entry-less parent (keeps the trie compressed)
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[0]] = child

    def _evict(self, keep: _Node | None = None) -> None:
        while self.nbytes > self.max_bytes and self._lru:
            victim = next(iter(self._lru))
            if victim is keep:
                if len(self._lru) == 1:
                    break
                self._lru.move_to_end(victim)
                continue
            self._drop(victim)
            self.evictions += 1

    # ---- what to snapshot ------------------------------------------------------------------------------
    def snapshot_points(self, tokens: Sequence[int], start: int, end: int, boundary_token: int | None) -> list[int]:
        """Positions p in [start, end] worth a snapshot of tokens[:p] that the cache does not hold yet:
        just before the first and the last two `boundary_token`s (<|im_start|>: end of the system prompt,
        end of the last reply, end of the last user turn before the generation prompt), and every
        `interval` tokens. `start` is what the state holds already: a point fewer than `min_gap` tokens
        after it would cost one more prefill piece (engine call) to save little, so the state at `start`
        is stored instead (a copy, no extra call)."""
        candidates: set[int] = set()
        if boundary_token is not None:
            at = np.flatnonzero(np.asarray(tokens[:end], np.int64) == boundary_token)
            at = at[at > 0]
            if at.size:
                candidates.update(int(p) for p in (at[0], *at[-2:]))
        if self.interval > 0:
            candidates.update(range((start // self.interval + 1) * self.interval, end + 1, self.interval))
        points: set[int] = set()
        for p in candidates:
            if not start < p <= end or self.contains(tokens[:p]):
                continue
            points.add(start if p - start < self.min_gap else p)
        points.discard(0)
        if start in points and self.contains(tokens[:start]):
            points.discard(start)
        return sorted(points)

    # ---- disk -------------------------------------------------------------------------------------------
    def paths(self) -> list[list["SessionSnapshot"]]:
        """Stored snapshots grouped into trie paths (shortest first), each snapshot in exactly one path:
        the longest unassigned snapshot heads a path and takes its unassigned ancestors."""
        nodes = sorted(self._lru, key=lambda nd: -len(nd.entry.tokens))
        taken: set[_Node] = set()
        out = []
        for head in nodes:
            if head in taken:
                continue
            chain, nd = [], head
            while nd is not None:
                if nd.entry is not None and nd not in taken:
                    chain.append(nd)
                    taken.add(nd)
                nd = nd.parent
            out.append([nd.entry for nd in reversed(chain)])
        return out

    def save_dir(self, folder: str | os.PathLike, model: "Model", extra: Sequence["SessionSnapshot"] = ()
                 ) -> list[Path]:
        """Write every stored snapshot (plus `extra`) under `folder`, one file per trie path; files this
        cache loaded or wrote earlier whose path no longer exists are removed (other files are left alone).
        Returns the files of the current paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for snap in extra:
            if not self.contains(snap.tokens):
                self.insert(snap)
        keep = []
        fingerprint = model_fingerprint(model)
        for chain in self.paths():
            name = _path_name(chain, fingerprint)
            path = folder / name
            if not path.exists():
                save_session_file(path, chain, model)
            keep.append(path)
        for old in self._files - set(keep):
            old.unlink(missing_ok=True)
        self._files = set(keep)
        return keep

    def load_dir(self, folder: str | os.PathLike, model: "Model") -> int:
        """Load session files from `folder` (newest first, while they fit the budget); returns the number
        of snapshots added. Files from another model are skipped with a warning."""
        import warnings
        folder = Path(folder)
        if not folder.is_dir():
            return 0
        files = sorted(folder.glob("*" + SESSION_SUFFIX), key=lambda p: p.stat().st_mtime, reverse=True)
        added = 0
        for path in files:
            try:
                snaps, _ = load_session_file(path, model)
            except SessionFileError as e:
                warnings.warn(str(e), stacklevel=2)
                continue
            if self.nbytes + sum(snapshot_nbytes(s) for s in snaps) > self.max_bytes:
                break
            for s in snaps:
                added += int(self.insert(s))
            self._files.add(path)
        return added


def _path_name(chain: Sequence["SessionSnapshot"], fingerprint: str) -> str:
    h = hashlib.sha1(fingerprint.encode())
    for s in chain:
        h.update(np.asarray(s.tokens, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:20] + SESSION_SUFFIX


# ---- exact tokens of replies sent back as text ------------------------------------------------------------
_REPLY_OPENERS = ("<|im_start|>assistant\n", "<think>\n", "</think>\n\n")
_REPLY_CLOSER = "<|im_end|>"


class ReplyTokens:
    """The token ids a model generated for its recent replies, so that a conversation sent back as text
    (chat messages) re-tokenizes to exactly the tokens the session state holds: BPE re-encoding of a reply
    often splits it differently from how it was sampled, and one differing token ends prefix reuse there.

    `encode(tokenizer, text)` tokenizes `text`, splicing in the remembered ids wherever a remembered reply
    appears as a whole assistant turn (after `<|im_start|>assistant\n`, `<think>\n` or `</think>\n\n`,
    and followed by `<|im_end|>`); the decoded text is identical, only the split differs."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = int(max_entries)
        self._replies: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._texts: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # raw prompt + completion (no template)
        self._lock = threading.Lock()  # a server remembers on one thread and encodes on others

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, text: str, ids: Sequence[int]) -> None:
        if not text or not ids:
            return
        with self._lock:
            self._replies[text] = tuple(int(t) for t in ids)
            self._replies.move_to_end(text)
            while len(self._replies) > self.max_entries:
                self._replies.popitem(last=False)

    def export(self) -> list[list]:
        """[[reply text, [ids]], ...] oldest first, JSON-ready (kept with a saved session)."""
        with self._lock:
            return [[t, list(ids)] for t, ids in self._replies.items()]

    def remember_all(self, entries: Sequence[Sequence]) -> None:
        """Inverse of export()."""
        for text, ids in entries:
            self.remember(str(text), [int(t) for t in ids])

    def remember_text(self, text: str, ids: Sequence[int]) -> None:
        """A raw-text context (a completions prompt plus its completion) and its exact tokens."""
        if text and ids:
            with self._lock:
                self._texts[text] = tuple(int(t) for t in ids)
                self._texts.move_to_end(text)
                while len(self._texts) > self.max_entries:
                    self._texts.popitem(last=False)

    def encode_text(self, tokenizer: Any, text: str) -> list[int]:
        """Raw text -> ids, continuing the exact tokens of the longest remembered context it starts with."""
        with self._lock:
            best = max((t for t in self._texts if text.startswith(t)), key=len, default=None)
            head = self._texts[best] if best is not None else None
        if best is None:
            return tokenizer.encode(text)
        rest = text[len(best):]
        return list(head) + (tokenizer.encode(rest) if rest else [])

    def save(self, path: str | os.PathLike) -> None:
        with self._lock:
            items = [[t, list(ids)] for t, ids in self._replies.items()]
        Path(path).write_text(json.dumps(items, ensure_ascii=False))

    def load(self, path: str | os.PathLike) -> None:
        try:
            for text, ids in json.loads(Path(path).read_text()):
                self.remember(text, ids)
        except (OSError, ValueError, TypeError):
            pass  # a missing or damaged file only costs some prefix reuse

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        with self._lock:
            replies = list(self._replies.items())
        for reply, ids in reversed(replies):
            i = text.find(reply)
            while i >= 0:
                j = i + len(reply)
                if text.startswith(_REPLY_CLOSER, j) and any(text.endswith(o, 0, i) for o in _REPLY_OPENERS) \
                        and not any(a < j and i < b for a, b, _ in spans):
                    spans.append((i, j, ids))
                i = text.find(reply, j)
        if not spans:
            return tokenizer.encode(text)
        out: list[int] = []
        at = 0
        for i, j, ids in sorted(spans):
            if i > at:
                out += tokenizer.encode(text[at:i])
            out += ids
            at = j
        if at < len(text):
            out += tokenizer.encode(text[at:])
        return out


# ---- model fingerprint -----------------------------------------------------------------------------------
def weights_digest(tensors: Mapping[str, np.ndarray], sample: int = 256) -> str:
    """A cheap digest of a checkpoint's weights: every tensor's name, dtype and shape, and its first, middle
    and last `sample` bytes (a few pages of a memory map, whatever the checkpoint size)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        n = flat.size
        mid = max(0, n // 2 - sample // 2)
        for part in (flat[:sample], flat[mid:mid + sample], flat[max(0, n - sample):]):
            h.update(part.tobytes())
    return h.hexdigest()


def model_fingerprint(model: "Model") -> str:
    """Identity of the model a session state belongs to: config, tokenizer, and the weights digest that
    `lily.load` records (models built by hand without one are identified by config + tokenizer only)."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    tok = model.tokenizer
    h.update(f"|vocab={tok.vocab_size}|".encode())
    try:
        h.update(hashlib.sha256(Path(tok.path).read_bytes()).digest())
    except OSError:
        pass
    h.update(str(getattr(model, "weights_digest", None)).encode())
    return h.hexdigest()[:32]


# ---- session files ---------------------------------------------------------------------------------------
def save_session_file(path: str | os.PathLike, chain: Sequence["SessionSnapshot"], model: "Model",
                      pending: Sequence[int] = (), metadata: Mapping[str, Any] | None = None) -> Path:
    """Write snapshots that lie on one token path (each a prefix of the next) to a safetensors file."""
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
    meta = {"format": SESSION_FORMAT, "version": SESSION_VERSION, "fingerprint": model_fingerprint(model),
            "model": str(model.path), "vocab_size": str(model.vocab_size),
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
        raise SessionFileError(f"[Session.load] {path} is not a readable safetensors file: {e}") from None


def read_session_user_metadata(path: str | os.PathLike) -> dict[str, Any]:
    raw = read_session_metadata(path).get("user")
    return json.loads(raw) if raw else {}


def load_session_file(path: str | os.PathLike, model: "Model") -> tuple[list["SessionSnapshot"], list[int]]:
    """Read a session file back: (snapshots on its path, shortest first; pending tokens of the last)."""
    from safetensors.numpy import load_file

    from .session import SessionSnapshot

    path = Path(path)
    if not path.is_file():
        raise SessionFileError(f"[Session.load] {path} does not exist")
    meta = read_session_metadata(path)
    if meta.get("format") != SESSION_FORMAT:
        raise SessionFileError(f"[Session.load] {path} is not a lily session file (metadata format="
                               f"{meta.get('format')!r}, expected {SESSION_FORMAT!r})")
    if meta.get("version") != SESSION_VERSION:
        raise SessionFileError(f"[Session.load] {path} has session format version {meta.get('version')!r}; this "
                               f"lily reads version {SESSION_VERSION}")
    mine = model_fingerprint(model)
    if meta.get("fingerprint") != mine:
        raise SessionFileError(
            f"[Session.load] {path} was saved from another model (fingerprint {meta.get('fingerprint')}, "
            f"model {meta.get('model')}), not from the loaded one (fingerprint {mine}, model {model.path}): "
            f"a session state only makes sense with the exact weights that produced it")
    arrays = load_file(str(path))
    tokens = arrays["tokens"].astype(np.int64).tolist()
    if len(tokens) > model.max_context:
        raise SessionFileError(f"[Session.load] {path} holds {len(tokens)} tokens, more than this model's "
                               f"context size {model.max_context} (load it with a larger max_context)")
    kv = {k: v for k, v in arrays.items() if k.startswith("kv.")}
    snaps = []
    for j, p in enumerate(int(x) for x in arrays["checkpoints"]):
        d: dict[str, Any] = {"position": np.int64(p)}
        d.update({k: v[:p] for k, v in kv.items()})
        prefix = f"ckpt{j}."
        d.update({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix) and k != prefix + "logits"})
        state = model.engine.new_state()
        try:
            state.import_arrays(d)
        except (ValueError, KeyError, TypeError) as e:
            raise SessionFileError(f"[Session.load] {path}: checkpoint {j} does not fit this engine: {e}") from None
        logits = arrays.get(prefix + "logits")
        snaps.append(SessionSnapshot(state, tuple(tokens[:p]), (), None if logits is None else logits.copy()))
    return snaps, arrays["pending"].astype(np.int64).tolist()
