"""Prefix reuse for the hybrid model: the snapshot trie (longest prefix, edge splits, LRU in bytes), sessions
that continue from snapshots exactly as a fresh run would, session files (round trip, another model refused),
and ReplyTokens (a reply sent back as text re-tokenizes to the tokens that were sampled)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import lily
from lily.prefix_cache import PrefixCache
from lily.reply_tokens import ReplyTokens
from lily.session_file import SessionFileError
from lily.snapshot import SessionSnapshot, snapshot_nbytes


def _backend() -> str:
    try:
        importlib.import_module("lily._lily")
        return "cpu"
    except ImportError:
        return "reference"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lily.testing import write_synthetic_checkpoint
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("pc"), "tiny")


@pytest.fixture(scope="module")
def model(ckpt):
    return lily.load(ckpt, backend=_backend(), max_context=1024)


class FakeState:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def snap(tokens, nbytes=100, logits=True):
    return SessionSnapshot(FakeState(nbytes), tuple(tokens), (), np.zeros(4, np.float32) if logits else None)


# ---- the trie ---------------------------------------------------------------------------------------------
def test_longest_prefix_and_edge_splits():
    c = PrefixCache(max_bytes=10**6, interval=0)
    for toks in ([1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 9, 9], [7]):
        assert c.insert(snap(toks))
    assert len(c) == 4
    assert c.lookup([1, 2, 3, 4, 5, 6])[0] == 5
    assert c.lookup([1, 2, 3, 4])[0] == 3
    assert c.lookup([1, 2, 9, 9, 1])[0] == 4
    assert c.lookup([1, 2])[0] == 0 and c.lookup([8])[1] is None
    assert c.lookup([1, 2, 3, 4, 5])[0] == 5  # exact length: usable because it carries its logits
    c.insert(snap([4, 4], logits=False))
    assert c.lookup([4, 4])[0] == 0 and c.lookup([4, 4, 1])[0] == 2  # no logits: needs one more token
    assert c.contains([1, 2, 3]) and not c.contains([1, 2])
    assert c.remove([1, 2, 3]) and not c.contains([1, 2, 3]) and c.lookup([1, 2, 3, 4, 5])[0] == 5
    assert c.remove([1, 2, 3, 4, 5]) and c.lookup([1, 2, 3, 4, 5])[0] == 0 and c.lookup([1, 2, 9, 9])[0] == 4
    with pytest.raises(ValueError, match="pending"):
        c.insert(SessionSnapshot(FakeState(1), (1,), (2,), None))


def test_lru_bound_in_bytes():
    one = snapshot_nbytes(snap([0] * 3, nbytes=1000))
    c = PrefixCache(max_bytes=3 * one, interval=0)
    for i in range(3):
        c.insert(snap([i] * 3, nbytes=1000))
    c.lookup([0, 0, 0, 1])  # touch the oldest
    c.insert(snap([5] * 3, nbytes=1000))
    assert c.nbytes <= c.max_bytes and len(c) == 3 and c.evictions == 1
    assert c.contains([0] * 3) and not c.contains([1] * 3)  # the least recently used went
    assert not c.insert(snap([9], nbytes=10 * one))  # larger than the whole budget: not stored
    assert len(c) == 3


def test_snapshot_points():
    c = PrefixCache(max_bytes=10**6, interval=10, min_gap=0)
    S = 99  # <|im_start|>
    toks = [S, 1, 1, S, 2, 2, 2, S, 3, 3, 3, 3, 3, S, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    # first boundary (3), the last two (7, 13), every 10 tokens (10, 20)
    assert c.snapshot_points(toks, 0, len(toks), S) == [3, 7, 10, 13, 20]
    assert c.snapshot_points(toks[:9], 0, 9, S) == [3, 7]
    c.insert(snap(toks[:3]))
    assert c.snapshot_points(toks, 5, len(toks), S) == [7, 10, 13, 20]  # only after the start, only new ones
    c.min_gap = 6  # points too close to the state's start: the state at the start is stored instead
    assert c.snapshot_points(toks, 5, len(toks), S) == [5, 13, 20]
    c.insert(snap(toks[:5]))
    assert c.snapshot_points(toks, 5, len(toks), S) == [13, 20]
    assert c.snapshot_points(toks, 0, 4, S) == []  # never the empty state


# ---- sessions over a real engine ----------------------------------------------------------------------------
def conversation(n_turns: int):
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"Question number {i}: how are you today?"})
        msgs.append({"role": "assistant", "content": f"Answer {i}: fine, thank you."})
    return msgs


def test_reuse_gives_the_same_tokens_as_a_fresh_run(model):
    cache = PrefixCache(max_bytes=1 << 30, interval=16)
    s = model.session(prefix_cache=cache)
    kw = dict(max_tokens=6, temperature=0, enable_thinking=False)
    a = conversation(2)[:-1]
    r1 = s.generate(a, **kw)
    assert r1.stats.cached_tokens == 0 and len(cache) >= 3
    s.generate([{"role": "user", "content": "something else entirely"}], **kw)  # the live state moves away
    r2 = s.generate(a, **kw)  # back: restored from the snapshot before the generation prompt
    ids = model.apply_chat_template(a, tokenize=True, enable_thinking=False)
    last_turn_end = max(i for i, t in enumerate(ids) if t == model.tokenizer.im_start_id)
    assert last_turn_end <= r2.stats.cached_tokens < len(ids)  # (a periodic snapshot may lie beyond it)
    assert r2.token_ids == r1.token_ids == model.generate(a, **kw).token_ids
    # a longer conversation on the same prefix: continues from the longest stored prefix
    b = conversation(3)[:-1]
    r3 = s.generate(b, **kw)
    assert r3.stats.cached_tokens >= last_turn_end
    assert r3.token_ids == model.generate(b, **kw).token_ids


def test_whole_text_prompts_and_flush(model):
    s = model.session(prefix_cache=PrefixCache(interval=8))
    text = "The quick brown fox jumps over the lazy dog."
    r = s.generate(text, whole=True, max_tokens=4, temperature=0)
    full = model.tokenize(text) + r.token_ids
    s.flush()
    assert s._state.position == len(full) and s.tokens == full
    r2 = s.generate(full + model.tokenize(" Again"), whole=True, max_tokens=2, temperature=0)
    assert r2.stats.cached_tokens == len(full)


def test_session_save_load_round_trip(model, tmp_path):
    cache = PrefixCache(interval=0)
    s = model.session(prefix_cache=cache)
    msgs = conversation(1)
    s.generate(msgs + [{"role": "user", "content": "More?"}], max_tokens=5, temperature=0, enable_thinking=False)
    path = s.save(tmp_path / "s.lily-session.safetensors", metadata={"messages": msgs})
    cache2 = PrefixCache(interval=0)
    s2 = model.load_session(path, cache2)
    assert s2.tokens == s.tokens and s2.position == s.position and s2.metadata == {"messages": msgs}
    assert len(cache2) >= 1  # the earlier turn boundaries came back too
    a = s.generate(" and then", max_tokens=5, temperature=0)
    b = s2.generate(" and then", max_tokens=5, temperature=0)
    assert a.token_ids == b.token_ids and b.stats.cached_tokens == a.stats.cached_tokens
    # an earlier boundary of the loaded file still serves a different continuation
    other = msgs + [{"role": "user", "content": "Different question"}]
    r = model.session(cache2).generate(other, max_tokens=2, temperature=0, enable_thinking=False)
    assert r.stats.cached_tokens > 0


def test_a_file_from_another_model_is_refused(model, tmp_path):
    from lily.testing import write_synthetic_checkpoint
    other = lily.load(write_synthetic_checkpoint(tmp_path / "other", "tiny", seed=1), backend=_backend())
    s = other.session()
    s.prefill("Hello there")
    path = s.save(tmp_path / "o.lily-session.safetensors")
    with pytest.raises(SessionFileError, match="saved from another model"):
        model.load_session(path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(SessionFileError, match="not a readable safetensors"):
        model.load_session(tmp_path / "junk.safetensors")
    with pytest.raises(SessionFileError, match="does not exist"):
        model.load_session(tmp_path / "missing")


def test_cache_dir_round_trip(model, tmp_path):
    cache = PrefixCache(interval=0)
    s = model.session(prefix_cache=cache)
    for n in (1, 2):
        s.generate(conversation(n) + [{"role": "user", "content": "ok?"}], max_tokens=3, temperature=0)
    files = cache.save_dir(tmp_path, model.identity)
    assert files and len(files) == len(cache.paths())
    back = PrefixCache(interval=0)
    assert back.load_dir(tmp_path, model.identity, model.engine) == len(cache)
    assert sorted(len(e.tokens) for e in back.entries()) == sorted(len(e.tokens) for e in cache.entries())


# ---- ReplyTokens -----------------------------------------------------------------------------------------------
def test_reply_tokens_splice_exact_ids(model):
    tok = model.tokenizer
    reply = "Hello world! How are you?"
    odd = [t for ch in reply for t in tok.encode(ch)]  # a valid but non-canonical split of the same text
    assert tok.decode(odd) == reply and odd != tok.encode(reply)
    rt = ReplyTokens()
    rt.remember(reply, odd)
    text = f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>user\nX"
    ids = rt.encode(tok, text)
    assert tok.decode(ids) == text
    head = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:len(head)] == head and ids[len(head):len(head) + len(odd)] == odd
    # only whole assistant turns are replaced, not the same words inside a user message
    text2 = f"<|im_start|>user\n{reply}<|im_end|>\n"
    assert rt.encode(tok, text2) == tok.encode(text2)
    rt.remember_text("The quick", [1, 2, 3])
    assert rt.encode_text(tok, "The quick brown")[:3] == [1, 2, 3]
