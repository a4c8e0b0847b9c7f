"""`lily chat`: one session across turns (the second turn reuses the first), timings shown, /save and
--session to continue a conversation later."""
from __future__ import annotations

import re

from lily.cli import main


# long enough that its turn boundaries are worth snapshots (PrefixCache.min_gap)
SYSTEM = "You are a helpful assistant. Answer briefly and politely, and say when you do not know. " * 4


def _run_chat(monkeypatch, capsys, ckpt, lines, *extra):
    from typed_input import feed_input
    feed_input(monkeypatch, lines)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from _live import backend
    rc = main(["chat", "--model", str(ckpt), "--backend", backend(), "-n", "8", "-t", "0", "--no-think", *extra])
    return rc, capsys.readouterr()


def test_chat_keeps_the_session_and_shows_timings(tiny_ckpt, tmp_path, monkeypatch, capsys):
    path = tmp_path / "chat.lily-session.safetensors"
    rc, out = _run_chat(monkeypatch, capsys, tiny_ckpt, ["Hello there", "How are you?", "/stats", "/exit"],
                        "--system", SYSTEM, "--session", str(path))
    assert rc == 0
    stats = re.findall(r"\[prompt (\d+) tok(?: \((\d+) cached\))?, prefill [\d.]+ tok/s, TTFT [\d.]+ s", out.err)
    assert len(stats) == 2
    (p1, c1), (p2, c2) = [(int(p), int(c or 0)) for p, c in stats]
    # turn 2 continues at least from the end of turn 1's user message (all of turn 1 when the template's
    # re-rendering of the reply, which trims whitespace, gives back the tokens the noise model sampled)
    from lily.tokenizer import Tokenizer
    gen_prompt = len(Tokenizer(tiny_ckpt / "tokenizer.json").encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert c1 == 0 and c2 >= p1 - gen_prompt and p2 > p1
    assert "[session " in out.err and "PrefixCache(" in out.err
    assert path.is_file() and "saved" in out.err
    # a new process continues the saved conversation: its first turn is mostly cached
    rc, out = _run_chat(monkeypatch, capsys, tiny_ckpt, ["And then?"], "--session", str(path))
    assert rc == 0 and "[loaded " in out.err
    (p3, c3), = [(int(p), int(c or 0)) for p, c in re.findall(r"\[prompt (\d+) tok(?: \((\d+) cached\))?", out.err)]
    assert p3 > p2 and c3 >= c2  # at least as much as turn 2 reused: the snapshots came back from the file
