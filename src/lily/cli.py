"""`lily` command line: generate, chat, serve, bench, info, convert.

    lily generate "Explain RoPE in one paragraph." --max-tokens 200
    lily chat --model mlx-community/Qwen3.6-35B-A3B-4bit
    lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit --port 8000 --session-dir ~/.cache/lily/sessions
    lily bench --prefill 256,512,1024 --decode 256,1024 --repeats 3 --peer mlx-lm --out benchmarks/results/NAME
    lily info
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

NOT_YET: tuple[str, ...] = ()  # commands listed but not yet available


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint folder or Hugging Face repo id (default: the small model bundled with lily)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "metal", "reference"])
    p.add_argument("--max-context", type=int, default=None, help="context window in tokens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all cores)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int | None) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    p.add_argument("--temperature", "-t", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-think", action="store_true", help="chat mode: thinking off (enable_thinking=false)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lily", description="Fast local inference of Qwen3.6-35B-A3B")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("prompt", help="the prompt ('-' reads stdin)")
    _add_model_args(g)
    _add_sampling_args(g, max_tokens=1024)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt as a user message with the chat template (default)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="use the prompt as raw text")
    g.add_argument("--system", default=None, help="chat mode: system message")
    g.add_argument("--quiet-stats", action="store_true", help="do not print the stats line on stderr")

    c = sub.add_parser("chat", help="interactive multi-turn chat (reuses the session between turns)")
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=None)
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--session", default=None, metavar="FILE",
                   help="session file: loaded at start when it exists, saved on /save and at exit")

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, models)")
    _add_model_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY)")
    v.add_argument("--model-name", default=None, help="model id clients send (default: the checkpoint folder name)")
    v.add_argument("--session-dir", default=None, metavar="DIR",
                   help="keep the prefix cache on disk: loaded at start, saved at shutdown and on "
                        "POST /v1/sessions/save")
    v.add_argument("--cache-gib", type=float, default=4.0, help="prefix-cache budget in GiB (default 4)")
    v.add_argument("--snapshot-interval", type=int, default=4096,
                   help="also snapshot every N tokens of a long prefill (0 = turn boundaries only)")
    v.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="server default for enable_thinking (default: the chat template's)")
    v.add_argument("--reasoning-field", choices=["both", "reasoning_content", "reasoning"], default="both",
                   help="where reasoning goes in responses (default: both names)")
    v.add_argument("--keepalive", type=float, default=10.0, help="SSE keep-alive comment interval in seconds")
    v.add_argument("--progress-tokens", type=int, default=4096,
                   help="SSE prefill progress comment every N prompt tokens")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = v.add_argument_group("limits (fair serving; all shown in GET /health)")
    g.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                   help="default and ceiling of a request's max_tokens (default 4096)")
    g.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="requests decoding at once, their steps interleaved round-robin, each with its own "
                        "session (default 4)")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond, 503 with Retry-After (default 64)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="stop a request this many seconds after it arrived, queue included (0 = never; "
                        "default 600)")
    g.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB",
                   help="request body limit in MiB; larger bodies get 413 (default 4)")
    g.add_argument("--prefill-slice", type=int, default=512, metavar="N",
                   help="prefill tokens between decode rounds of the other running requests (default 512)")
    g.add_argument("--cors-origins", default="", metavar="LIST",
                   help="comma-separated browser origins allowed by CORS, or '*' (default: none, so no web page "
                        "can call this server from a browser)")

    b = sub.add_parser("bench", help="prefill/decode throughput sweeps (batch 1), optional peer; JSON + PNG")
    _add_model_args(b)
    b.add_argument("--prefill", default="256,512,1024", help="prompt lengths, comma-separated")
    b.add_argument("--decode", default="256,1024", help="decode context lengths, comma-separated")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    b.add_argument("--decode-steps", type=int, default=16, help="timed single-token steps per decode repeat")
    b.add_argument("--peer", default=None, choices=["mlx-lm"], help="also run a peer engine on the same checkpoint")
    b.add_argument("--peer-max", type=int, default=None, metavar="TOKENS",
                   help="run the peer only at lengths up to this (a slow peer)")
    b.add_argument("--note", default="", help="free text stored in the JSON settings")
    b.add_argument("--out", default=None, metavar="PATH",
                   help="write PATH.json and PATH.png (default: lily-bench-BACKEND in the current folder)")

    i = sub.add_parser("info", help="lily install, backends and checkpoint facts")
    _add_model_args(i)

    c = sub.add_parser("convert", help="HF bf16 checkpoint -> MLX 4-bit export (8-bit router), as mlx_lm.convert")
    c.add_argument("source", help="HF checkpoint folder or repo id")
    c.add_argument("output", help="folder to write (must not exist or be empty)")

    for name in NOT_YET:
        sub.add_parser(name, help=f"({name}: not yet available in this version)", add_help=False)
    return parser


def _load(args: argparse.Namespace):
    from .model import load
    return load(args.model, backend=args.backend, max_context=args.max_context, threads=args.threads)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop)


def _stream(chunks, out=None):
    """Write chunk texts as they come; returns (text, final chunk)."""
    out = out or sys.stdout
    parts, last = [], None
    for c in chunks:
        if c.text:
            out.write(c.text)
            out.flush()
            parts.append(c.text)
        last = c
    return "".join(parts), last


class _ReasoningSplitter:
    """Chat output with thinking on is `reasoning</think>\n\ncontent` (the prompt opened `<think>`): the
    reasoning goes to stderr (dim on a terminal) and only the answer to stdout, so piping keeps the answer."""

    TAG = "</think>"

    def __init__(self, out, err):
        self.out, self.err, self.pending, self.in_reasoning, self.lead = out, err, "", True, True
        self.dim = err.isatty()

    def write(self, text: str) -> None:
        if not self.in_reasoning:
            if self.lead:  # drop the blank lines the template puts after </think>
                text = text.lstrip("\n")
                self.lead = not text
            self.out.write(text)
            return
        self.pending += text
        cut = self.pending.find(self.TAG)
        if cut < 0:  # keep a possible partial tag
            keep = max((k for k in range(1, len(self.TAG)) if self.pending.endswith(self.TAG[:k])), default=0)
            self._reason(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return
        self._reason(self.pending[:cut])
        rest, self.pending, self.in_reasoning = self.pending[cut + len(self.TAG):], "", False
        self.write(rest)

    def _reason(self, text: str) -> None:
        if text.strip() or (text and self.err_started):
            self.err_started = True
            self.err.write(f"\x1b[2m{text}\x1b[0m" if self.dim else text)
            self.err.flush()

    err_started = False

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        """End of output: text still held back was reasoning (no </think> came)."""
        self._reason(self.pending)
        self.pending = ""


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = _load(args)
    kwargs = _sampling_kwargs(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        if args.no_think:
            kwargs["enable_thinking"] = False
        stream = model.generate(messages, stream=True, **kwargs)
        thinking = not args.no_think and model.apply_chat_template(messages).rstrip().endswith("<think>")
    else:
        stream = model.generate(prompt, stream=True, **kwargs)
        thinking = False
    splitter = _ReasoningSplitter(sys.stdout, sys.stderr) if thinking else None
    _, last = _stream(stream, splitter)
    if splitter is not None:
        splitter.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.stats is not None and not args.quiet_stats:
        print(last.stats.summary(), file=sys.stderr)
    return 0


CHAT_HELP = ("Type a message. /reset starts over, /save [FILE] saves the session, /stats shows the cache, "
             "/exit (or Ctrl-D) quits.")


def cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat on one session: each turn sends the whole conversation, and the session continues
    from the longest prefix it holds (the live state, or a snapshot of its prefix cache), so only the new
    user turn is prefilled. The reply's exact tokens are kept, so re-rendering the conversation as text
    does not change how it tokenizes."""
    import os

    from .prefix_cache import PrefixCache, ReplyTokens
    from .session import Session

    model = _load(args)
    cache = PrefixCache(max_bytes=2 << 30)
    replies = ReplyTokens()
    session = model.session(prefix_cache=cache)
    if args.session and os.path.exists(args.session):
        session = Session.load(args.session, model, cache)
        print(f"[loaded {args.session}: {session.position} tokens]", file=sys.stderr)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    if session.metadata.get("messages"):
        messages = list(session.metadata["messages"])
    # the replies' exact sampled tokens travel with the session, or re-tokenizing them would end reuse there
    replies.remember_all(session.metadata.get("replies") or [])
    kwargs = _sampling_kwargs(args)
    template_kwargs = {"preserve_thinking": True}  # earlier think blocks stay, so the history is a prefix
    if args.no_think:
        template_kwargs["enable_thinking"] = False
    print(f"{model!r}\n{CHAT_HELP}", file=sys.stderr)

    def save(path: str) -> None:
        session.save(path, metadata={"messages": messages, "replies": replies.export()})
        print(f"[saved {session.position} tokens to {path}]", file=sys.stderr)

    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            break
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            session.reset()
            messages = messages[:1] if args.system else []
            continue
        if cmd == "/stats":
            print(f"[session {session.position} tokens; {cache!r}]", file=sys.stderr)
            continue
        if cmd.startswith("/save"):
            path = cmd[len("/save"):].strip() or args.session
            if not path:
                print("[/save needs a file name (or start with --session FILE)]", file=sys.stderr)
            else:
                save(path)
            continue
        messages.append({"role": "user", "content": line})
        text = model.chat_template.render(messages, add_generation_prompt=True, **template_kwargs)
        ids = replies.encode(model.tokenizer, text)
        try:
            parts, last, sampled = [], None, []
            for c in session.generate(ids, whole=True, stream=True, **kwargs):
                sampled.append(c.token_id)
                if c.text:
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
                    parts.append(c.text)
                last = c
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        print()
        reply = "".join(parts)
        if last is not None and isinstance(last.stop_reason, int) and sampled and sampled[-1] == last.stop_reason:
            sampled = sampled[:-1]
            session.flush()  # the end-of-turn token joins the state now, while the user types
        replies.remember(model.tokenizer.decode(sampled), sampled)
        if last is not None and last.stats is not None:
            print(f"[{last.stats.summary()}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
    if args.session:
        save(args.session)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    try:
        from .server.app import ServerConfig, serve
    except ImportError as e:
        print(f"error: lily serve needs the server extra ({e}): pip install 'lily[server]'", file=sys.stderr)
        return 1
    for name in ("max_tokens", "parallel"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)} is invalid: expected at least 1",
                  file=sys.stderr)
            return 2
    if args.max_queue < 0 or args.request_timeout < 0 or args.max_body_mb <= 0 or args.prefill_slice < 1:
        print("error: --max-queue and --request-timeout must be >= 0, --max-body-mb > 0, --prefill-slice >= 1",
              file=sys.stderr)
        return 2
    import socket
    try:  # before loading the model (which can take minutes): is the port free?
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port} ({e.strerror or e}): pick another --port or stop "
              f"what uses it", file=sys.stderr)
        return 1
    model = _load(args)
    config = ServerConfig(model_name=args.model_name, api_key=args.api_key or os.environ.get("LILY_API_KEY"),
                          session_dir=args.session_dir, cache_bytes=int(args.cache_gib * (1 << 30)),
                          snapshot_interval=args.snapshot_interval, keepalive_s=args.keepalive,
                          progress_tokens=args.progress_tokens,
                          default_thinking=None if args.thinking is None else args.thinking == "on",
                          reasoning_field=args.reasoning_field, max_tokens=args.max_tokens,
                          parallel=args.parallel, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)), prefill_slice=args.prefill_slice,
                          cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()))
    print(f"[lily serve] {model!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve(model, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SystemExit(f"error: {flag} wants positive integers separated by commas, got {text!r}")
    return vals


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_table, run_bench
    prefill, decode = _int_list(args.prefill, "--prefill"), _int_list(args.decode, "--decode")
    need = max(prefill + [c + 2 + args.decode_steps for c in decode])
    if args.max_context is None and need > 32768:  # beyond the default window: room for the longest point
        args.max_context = need
    model = _load(args)
    print(f"[lily bench] {model!r}", file=sys.stderr, flush=True)
    try:
        result = run_bench(model, prefill, decode, args.repeats, peer=args.peer, decode_steps=args.decode_steps,
                           peer_max_tokens=args.peer_max, note=args.note,
                           out=args.out or f"lily-bench-{model.backend}")
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from . import __version__
    print(f"lily {__version__}")
    try:
        from . import _lily
        from .model import _built_backends
        print(f"backends: {', '.join(_built_backends(_lily))}, reference")
    except ImportError as e:
        print(f"backends: reference (the C++ extension is not built: {e})")
    model = _load(args)
    print(repr(model))
    for k, v in model.info().items():
        print(f"  {k}: {v}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .checkpoint import load_checkpoint
    from .errors import CheckpointError
    from .testing.checkpoint_writer import export_checkpoint
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"[lily convert] output folder {out} is not empty; pass a new folder")
    ck = load_checkpoint(args.source)
    export_checkpoint(ck, out)
    print(f"wrote {out} ({ck.source_format} -> mlx 4-bit, {ck.nbytes / 2**20:.1f} MiB of weights)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import LilyError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command in NOT_YET:
        print(f"lily {args.command}: not yet available in this version of lily", file=sys.stderr)
        return 2
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "serve": cmd_serve,
                "convert": cmd_convert, "bench": cmd_bench}[args.command](args)
    except LilyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
