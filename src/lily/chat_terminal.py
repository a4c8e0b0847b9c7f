"""`lily chat`: an interactive multi-turn chat in the terminal.

Line editing and history come from the standard library's readline (history in `history_path()`); a line
ending in a backslash continues on the next one, a `\"\"\"` line opens a block that ends at the next `\"\"\"`
line, and a paste of several lines arrives as one message (bracketed paste). The reply streams as it is
sampled: the answer on stdout, the reasoning (`<think>` block) hidden unless --show-reasoning shows it
dimmed, using the same parser as `lily serve` (lily.reasoning). Ctrl-C stops a reply; at the prompt it
saves --session and exits, as Ctrl-D and /exit do: every way out saves the session.

Each turn sends the whole conversation, and the session continues from the longest prefix it holds (the
live state, or a snapshot of its prefix cache), so only the new user turn is prefilled. The reply's
exact tokens are kept (ReplyTokens), so re-rendering the conversation as text does not change how it
tokenizes; the stored assistant message is the reply's raw text, as the chat template expects.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from .reasoning import ReasoningParser, prompt_opens_reasoning

HELP = ("Type a message (end a line with \\ to go on, or wrap lines in \"\"\"). /reset starts over, "
        "/save [FILE] saves the session, /stats shows the cache and speculative decoding, /help this text; /exit, "
        "Ctrl-D or Ctrl-C quits (saving --session). Ctrl-C during a reply stops it.")
HISTORY_ENV = "LILY_CHAT_HISTORY"
NEWLINE_IN_HISTORY = "\x1e"  # the history file holds one entry a line: a message's newlines as RS
DIM, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[0m", "\r\x1b[K"


def history_path() -> Path:
    """$LILY_CHAT_HISTORY, else $XDG_STATE_HOME/lily/chat_history (~/.local/state/lily/chat_history)."""
    if os.environ.get(HISTORY_ENV):
        return Path(os.environ[HISTORY_ENV]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "lily" / "chat_history"


class LineReader:
    """input() with readline's line editing and a persistent history; read() joins continuation lines.
    Without a terminal on stdin (piped input) or without readline, plain input() and no history file."""

    def __init__(self, history: Path | None, read_line: Callable[[str], str] | None = None):
        self.history = history
        self.read_line = read_line or (lambda prompt: input(prompt))
        self.readline = None
        if not sys.stdin.isatty():
            return
        try:
            import readline
        except ImportError:
            return
        self.readline = readline
        readline.set_history_length(2000)
        readline.set_auto_history(False)  # read() adds whole messages, continuation lines joined
        # a multi-line paste becomes one edit buffer (GNU readline >= 8.1 has it on by default)
        readline.parse_and_bind("set enable-bracketed-paste on")
        if history is not None and history.exists():
            try:
                readline.read_history_file(str(history))
            except OSError as e:
                print(f"[chat history {history} not read: {e}]", file=sys.stderr)
            self._map_history(NEWLINE_IN_HISTORY, "\n")

    def read(self) -> str:
        """One message. Raises EOFError (Ctrl-D) and KeyboardInterrupt (Ctrl-C)."""
        first = self.read_line(">>> ")
        if first.strip() == '"""':
            lines = []
            while (line := self.read_line("... ")).strip() != '"""':
                lines.append(line)
        else:
            lines = [first]
            while lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(self.read_line("... "))
        message = "\n".join(lines)
        if self.readline is not None and message.strip():
            self.readline.add_history(message)
        return message

    def _map_history(self, old: str, new: str) -> None:
        rl = self.readline
        for i in range(rl.get_current_history_length()):
            item = rl.get_history_item(i + 1)  # 1-based, while replace_history_item is 0-based
            if item and old in item:
                rl.replace_history_item(i, item.replace(old, new))

    def save_history(self) -> None:
        if self.readline is None or self.history is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self._map_history("\n", NEWLINE_IN_HISTORY)
            self.readline.write_history_file(str(self.history))
        except OSError as e:
            print(f"[chat history not saved to {self.history}: {e}]", file=sys.stderr)


class ReplyPrinter:
    """Writes one streamed reply: answer text on `out`; reasoning hidden (a dim `thinking...` note on a
    terminal, erased when the answer starts) or, with show_reasoning, dimmed before the answer."""

    def __init__(self, in_reasoning: bool, show_reasoning: bool, out: TextIO, err: TextIO):
        self.parser = ReasoningParser(in_reasoning)
        self.show = show_reasoning
        self.out, self.err = out, err
        self.tty_out, self.tty_err = out.isatty(), err.isatty()
        self.note = False           # the `thinking...` note is on screen
        self.reasoning_shown = False
        self.answer_started = False
        self.reasoning_chars = 0

    def feed(self, text: str) -> None:
        self._write(self.parser.feed(text))

    def finish(self) -> None:
        self._write(self.parser.finish())
        self._clear_note()
        if self.reasoning_shown and self.tty_out:
            self.out.write(RESET)
        if not self.answer_started and self.reasoning_chars and not self.show:
            self.err.write(f"[the reply was all reasoning ({self.reasoning_chars} characters, hidden): "
                           f"--show-reasoning shows it]\n")
        self.out.write("\n")
        self.out.flush()

    def _write(self, pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning_chars += len(text)
                if self.show:
                    if not self.reasoning_shown and self.tty_out:
                        self.out.write(DIM)
                    self.reasoning_shown = True
                    self.out.write(text)
                elif not self.note and self.tty_err and text.strip():
                    self.err.write(f"{DIM}thinking...{RESET}")
                    self.err.flush()
                    self.note = True
                continue
            if not self.answer_started:
                self._clear_note()
                if self.reasoning_shown:
                    self.out.write((RESET if self.tty_out else "") + "\n\n")
                self.answer_started = True
            self.out.write(text)
        self.out.flush()

    def _clear_note(self) -> None:
        if self.note:
            self.err.write(CLEAR_LINE)
            self.err.flush()
            self.note = False


class SpeculativeTally:
    """Speculative decoding over the chat's turns, for /stats: what the model does, and the drafts so far."""

    def __init__(self, model: Any, option: Any):
        from .speculative import head_summary
        self.summary = head_summary(model, option)
        self.drafted = self.accepted = self.verifies = self.turns = 0

    def add(self, stats: Any) -> None:
        if stats.verify_steps:
            self.turns += 1
        self.drafted += stats.drafted_tokens
        self.accepted += stats.accepted_tokens
        self.verifies += stats.verify_steps

    def line(self) -> str:
        text = f"speculative decoding: {self.summary}"
        if self.drafted:
            text += (f"; this chat: {self.accepted / self.drafted:.0%} of {self.drafted} drafts accepted, "
                     f"{(self.accepted + self.verifies) / self.verifies:.2f} tok/verify over {self.turns} turn(s)")
        return text


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_chat's `finally`, which saves the session


def run_chat(args: argparse.Namespace, model: Any, sampling: dict) -> int:
    """The chat loop of `lily chat` on a loaded model; sampling: the generate() keywords."""
    from .prefix_cache import PrefixCache
    from .reply_tokens import ReplyTokens

    cache = PrefixCache(max_bytes=2 << 30)
    replies = ReplyTokens()
    session = model.session(prefix_cache=cache)
    if args.session and os.path.exists(args.session):
        session.load_file(args.session)
        print(f"[loaded {args.session}: {session.position} tokens]", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = list(session.metadata.get("messages") or system)
    # the replies' exact sampled tokens travel with the session, or re-tokenizing them would end reuse there
    replies.remember_all(session.metadata.get("replies") or [])
    template_kwargs: dict[str, Any] = {"preserve_thinking": True}  # earlier think blocks stay: a prefix
    if args.no_think:
        template_kwargs["enable_thinking"] = False
    reader = LineReader(history_path())
    tally = SpeculativeTally(model, sampling.get("speculative"))
    print(f"{model!r}\n{HELP}", file=sys.stderr)

    def save(path: str) -> None:
        session.save(path, metadata={"messages": messages, "replies": replies.export()})
        print(f"[saved {session.position} tokens to {path}]", file=sys.stderr)

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        raw, sampled, last, printer, stream = [], [], None, None, None
        try:  # from the first step on: Ctrl-C may come during the prompt's tokenizing or prefill too
            prompt = model.chat_template.render(messages, add_generation_prompt=True, **template_kwargs)
            printer = ReplyPrinter(prompt_opens_reasoning(prompt), args.show_reasoning, sys.stdout, sys.stderr)
            stream = session.generate(replies.encode(model.tokenizer, prompt), whole=True, stream=True, **sampling)
            for c in stream:
                sampled.append(c.token_id)
                raw.append(c.text)
                printer.feed(c.text)
                last = c
        except KeyboardInterrupt:
            if printer is not None:
                printer.finish()
            print("[interrupted: the turn is dropped]", file=sys.stderr)
            messages.pop()
            return
        finally:
            getattr(stream, "close", lambda: None)()  # the session settles the tokens it ran
        printer.finish()
        if last is not None and isinstance(last.stop_reason, int) and sampled and sampled[-1] == last.stop_reason:
            sampled = sampled[:-1]
            session.flush()  # the end-of-turn token joins the state now, while the user types
        replies.remember(model.tokenizer.decode(sampled), sampled)
        if last is not None and last.stats is not None:
            print(f"[{last.stats.summary()}]", file=sys.stderr)
            tally.add(last.stats)
        messages.append({"role": "assistant", "content": "".join(raw)})

    previous = {s: signal.signal(s, _raise_system_exit) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
                if s is not None}
    # Ctrl-C stops a reply or leaves at the prompt through KeyboardInterrupt, which Python arranges only when the
    # process did not start with SIGINT ignored: a background job of a non-interactive shell or nohup inherits it
    # ignored, and the chat would not hear Ctrl-C at all.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                line = reader.read()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave (saving below)
                print(file=sys.stderr)
                break
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/help":
                print(HELP, file=sys.stderr)
            elif cmd == "/reset":
                session.reset()
                messages = list(system)
            elif cmd == "/stats":
                print(f"[session {session.position} tokens; {cache!r}]\n[{tally.line()}]", file=sys.stderr)
            elif cmd.startswith("/save"):
                path = cmd[len("/save"):].strip() or args.session
                if path:
                    save(path)
                else:
                    print("[/save needs a file name (or start with --session FILE)]", file=sys.stderr)
            else:
                turn(line)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        reader.save_history()
        if args.session:
            save(args.session)
    return 0
