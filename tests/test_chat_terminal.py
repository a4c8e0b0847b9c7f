"""`lily chat` as a person uses it: a real pseudo-terminal (pexpect), the bundled model, keystrokes.

What the screen shows is checked against the same greedy generation run in this process, and what the
chat understood (line edits, history, multi-line input) against the messages of the saved session."""
from __future__ import annotations

import os
import re
import sys

import pytest

pexpect = pytest.importorskip("pexpect")
import lily  # noqa: E402
from lily.generation import collect  # noqa: E402

LEFT, UP = "\x1b[D", "\x1b[A"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
STATS = re.compile(r"\[prompt \d+ tok.*?\d+ tok(, [^\]]*)?\]")  # (the speculative summary after the count)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def model():
    return lily.load()


@pytest.fixture
def env(tmp_path):
    """No user files touched: history and state under tmp_path."""
    return {**os.environ, "LILY_CHAT_HISTORY": str(tmp_path / "history"), "XDG_STATE_HOME": str(tmp_path),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TERM": "xterm"}


def spawn(env, *args: str):
    child = pexpect.spawn(sys.executable, ["-m", "lily", "chat", "-t", "0", *args], env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 250))
    child.expect_exact(">>> ")
    return child


def reply(child, keys: str) -> str:
    """Type keys + Enter; the screen text up to the stats line, escape codes removed, CRLF -> LF."""
    child.send(keys + "\r")
    child.expect(STATS)
    screen = child.before
    child.expect_exact(">>> ")
    return ANSI.sub("", screen).replace("\r\n", "\n")


def quit_with_ctrl_c(child) -> None:
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def expected(model, text: str, **sampling):
    messages = [{"role": "user", "content": text}]
    prompt = model.chat_template.render(messages, add_generation_prompt=True, preserve_thinking=True)
    stream = model.session().generate(model.tokenizer.encode(prompt), whole=True, stream=True, temperature=0.0,
                                      **sampling)
    return collect(stream, prompt)


def no_stop(model, *extra: int) -> str:
    eos = model.generation_config.get("eos_token_id") or []
    ids = [*([eos] if isinstance(eos, int) else eos), *extra]
    return " ".join(f"--logit-bias={t}=-100" for t in ids)


def test_answer_is_shown_clean_and_reasoning_hidden(model, env):
    want = expected(model, "Hi!", max_tokens=16)
    assert want.text.strip()
    child = spawn(env, "-n", "16")
    screen = reply(child, "Hi!")
    assert want.text.strip() in screen
    assert "</think>" not in screen and "<think>" not in screen
    quit_with_ctrl_c(child)


def test_reasoning_is_hidden_by_default_and_dimmed_with_show_reasoning(model, env):
    """</think> banned, so the whole reply is reasoning: hidden, a note says so; --show-reasoning dims it."""
    bias = {t: -100.0 for t in (model.tokenizer.think_end_id, *model.generation_config["eos_token_id"])}
    want = expected(model, "Hi!", max_tokens=12, logit_bias=bias)
    assert want.text == "" and len(want.reasoning.strip()) > 5
    flags = no_stop(model, model.tokenizer.think_end_id).split()
    child = spawn(env, "-n", "12", *flags)
    screen = reply(child, "Hi!")
    assert want.reasoning.strip() not in screen and "all reasoning" in screen
    quit_with_ctrl_c(child)

    child = spawn(env, "-n", "12", "--show-reasoning", *flags)
    child.send("Hi!\r")
    child.expect(STATS)
    raw = child.before
    child.expect_exact(">>> ")
    assert "\x1b[2m" in raw  # dim
    assert want.reasoning.strip() in ANSI.sub("", raw).replace("\r\n", "\n")
    quit_with_ctrl_c(child)


def test_arrow_keys_edit_the_line_and_ctrl_c_at_the_prompt_saves(model, env, tmp_path):
    path = str(tmp_path / "chat.lily")
    child = spawn(env, "-n", "4", "--session", path)
    reply(child, "Hllo" + LEFT * 3 + "e")          # cursor back to after "H", insert "e"
    child.send("two \\\r")                          # a trailing backslash continues the message
    child.expect_exact("... ")
    reply(child, "lines")
    reply(child, PASTE_START + "pasted\nblock" + PASTE_END)
    quit_with_ctrl_c(child)
    assert os.path.exists(path)
    users = [m["content"] for m in model.load_session(path).metadata["messages"] if m["role"] == "user"]
    assert users == ["Hello", "two \nlines", "pasted\nblock"]

    # the session and the history come back: Up recalls the last message typed, as one message
    child = spawn(env, "-n", "4", "--session", path)
    reply(child, UP)
    child.sendeof()  # Ctrl-D saves too
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    users = [m["content"] for m in model.load_session(path).metadata["messages"] if m["role"] == "user"]
    assert users == ["Hello", "two \nlines", "pasted\nblock", "pasted\nblock"]


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(model, env, tmp_path):
    path = str(tmp_path / "chat.lily")
    child = spawn(env, "-n", "20000", "--no-think", "--session", path, *no_stop(model).split())
    child.send("Hi!\r")
    child.expect_exact("Hi!")
    child.expect(r"[A-Za-z]{3}")  # the reply is streaming (escape codes have no three letters in a row)
    child.sendintr()
    child.expect_exact("[interrupted")
    child.expect_exact(">>> ")
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert model.load_session(path).metadata["messages"] == []  # the stopped turn was dropped


def test_ctrl_c_works_when_started_with_sigint_ignored(env):
    """A background job of a non-interactive shell (or nohup) starts with SIGINT ignored; Ctrl-C must still leave."""
    cmd = f"trap '' INT; exec {sys.executable} -m lily chat -t 0 -n 4"
    child = pexpect.spawn("bash", ["-c", cmd], env=env, encoding="utf-8", timeout=60, dimensions=(40, 250))
    child.expect_exact(">>> ")
    quit_with_ctrl_c(child)
