"""Prefix reuse for a hybrid model: a token trie of state snapshots, LRU-bounded in bytes.

The DeltaNet and conv state cannot be rewound, so a session can only continue from a state that holds
*exactly* a prefix of the new request's tokens. `PrefixCache` keeps snapshots (`SessionSnapshot`: engine
state deep copy + tokens + the logits after the last token) at chosen positions, keyed by their tokens in
a radix trie; `lookup(tokens)` finds the longest stored snapshot that is a prefix of `tokens`.

Which positions are worth a snapshot (`snapshot_points`): turn boundaries, i.e. just before an
`<|im_start|>` token (end of the system prompt, end of each reply as the template re-renders it, end of the
last user/tool turn before the generation prompt), and every `interval` tokens of a long prefill.

`save_dir` / `load_dir` keep the cache on disk as session files (lily.session_file), one per trie path.
"""
from __future__ import annotations

import hashlib
import os
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .identity import ModelIdentity
from .session_file import SESSION_SUFFIX, SessionFileError, load_session_file, save_session_file
from .snapshot import SessionSnapshot, snapshot_nbytes

# SessionFileError and snapshot_nbytes were defined here before lily.session_file / lily.snapshot: still importable
__all__ = ["PrefixCache", "DEFAULT_CACHE_BYTES", "DEFAULT_SNAPSHOT_INTERVAL", "DEFAULT_MIN_GAP",
           "SESSION_SUFFIX", "SessionFileError", "snapshot_nbytes"]

DEFAULT_CACHE_BYTES = 4 << 30
DEFAULT_SNAPSHOT_INTERVAL = 4096
# a snapshot fewer tokens after the state's starting point saves less recompute than the extra prefill piece
# (one more engine call) costs
DEFAULT_MIN_GAP = 64


# ---- the trie ------------------------------------------------------------------------------------------
class _Node:
    # The parent link is weak: with strong links both ways every node would be in a reference cycle, so a dropped
    # cache's snapshots (engine states, device memory on a GPU) would wait for the garbage collector, not go at once.
    __slots__ = ("edge", "children", "_parent", "entry", "nbytes", "__weakref__")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.entry: SessionSnapshot | None = None
        self.nbytes = 0

    @property
    def parent(self) -> "_Node | None":
        return None if self._parent is None else self._parent()

    @parent.setter
    def parent(self, node: "_Node | None") -> None:
        self._parent = None if node is None else weakref.ref(node)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0])


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

    def lookup(self, tokens: Sequence[int], *, touch: bool = True) -> tuple[int, SessionSnapshot | None]:
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

    def entries(self) -> list[SessionSnapshot]:
        """Stored snapshots, least recently used first."""
        return [node.entry for node in self._lru]

    # ---- changes ------------------------------------------------------------------------------------
    def insert(self, snap: SessionSnapshot) -> bool:
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
    def paths(self) -> list[list[SessionSnapshot]]:
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

    def save_dir(self, folder: str | os.PathLike, owner: ModelIdentity, extra: Sequence[SessionSnapshot] = ()
                 ) -> list[Path]:
        """Write every stored snapshot (plus `extra`) of the model `owner` (`Model.identity`) under `folder`, one
        file per trie path; files this cache loaded or wrote earlier whose path no longer exists are removed
        (other files are left alone). Returns the files of the current paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for snap in extra:
            if not self.contains(snap.tokens):
                self.insert(snap)
        keep = []
        for chain in self.paths():
            path = folder / _path_name(chain, owner.fingerprint)
            if not path.exists():
                save_session_file(path, chain, owner)
            keep.append(path)
        for old in self._files - set(keep):
            old.unlink(missing_ok=True)
        self._files = set(keep)
        return keep

    def load_dir(self, folder: str | os.PathLike, owner: ModelIdentity, engine: Any) -> int:
        """Load session files from `folder` into states of `engine`, which runs the model `owner`
        (`Model.identity`, `Model.engine`): newest first, while they fit the budget; returns the number of
        snapshots added. Files from another model are skipped with a warning."""
        import warnings
        folder = Path(folder)
        if not folder.is_dir():
            return 0
        files = sorted(folder.glob("*" + SESSION_SUFFIX), key=lambda p: p.stat().st_mtime, reverse=True)
        added = 0
        for path in files:
            try:
                snaps, _ = load_session_file(path, owner, engine)
            except SessionFileError as e:
                warnings.warn(str(e), stacklevel=2)
                continue
            if self.nbytes + sum(snapshot_nbytes(s) for s in snaps) > self.max_bytes:
                break
            for s in snaps:
                added += int(self.insert(s))
            self._files.add(path)
        return added


def _path_name(chain: Sequence[SessionSnapshot], fingerprint: str) -> str:
    h = hashlib.sha1(fingerprint.encode())
    for s in chain:
        h.update(np.asarray(s.tokens, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:20] + SESSION_SUFFIX
