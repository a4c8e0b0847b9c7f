"""`lily` command line: generate, chat, info (serve, bench and convert come in later versions).

    lily generate "Explain RoPE in one paragraph." --max-tokens 200
    lily chat --model mlx-community/Qwen3.6-35B-A3B-4bit
    lily info
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

NOT_YET = ("serve", "bench", "convert")


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

    i = sub.add_parser("info", help="lily install, backends and checkpoint facts")
    _add_model_args(i)

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
    else:
        stream = model.generate(prompt, stream=True, **kwargs)
    _, last = _stream(stream)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.stats is not None and not args.quiet_stats:
        print(last.stats.summary(), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    model = _load(args)
    session = model.session()
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    kwargs = _sampling_kwargs(args)
    if args.no_think:
        kwargs["enable_thinking"] = False
    print(f"{model!r}\nType a message; /reset starts over, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            session.reset()
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            # preserve_thinking keeps earlier think blocks, so the session's tokens stay a prefix
            text, last = _stream(session.generate(messages, stream=True, preserve_thinking=True, **kwargs))
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            session.reset()
            continue
        print()
        if last is not None and last.stats is not None:
            print(last.stats.summary(), file=sys.stderr)
        messages.append({"role": "assistant", "content": text})


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
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info}[args.command](args)
    except LilyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
