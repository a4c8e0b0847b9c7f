"""`lily` command line: generate, chat, serve, bench, info, convert.

    lily generate "Explain RoPE in one paragraph." --max-tokens 200 --speculative auto
    lily chat --model mlx-community/Qwen3.6-35B-A3B-4bit
    lily serve --model mlx-community/Qwen3.6-35B-A3B-4bit --port 8000 --session-dir ~/.cache/lily/sessions
    lily bench --prefill 256,512,1024 --decode 256,1024 --repeats 3 --peer mlx-lm --out benchmarks/results/NAME
    lily info
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .generation import split_reasoning
from .sampling import SAMPLING_OPTIONS



def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint folder or Hugging Face repo id (default: the small model bundled with lily)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "metal", "reference"])
    p.add_argument("--max-context", type=int, default=None, help="context window in tokens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = all cores)")
    p.add_argument("--mtp", default=None, metavar="SOURCE",
                   help="the MTP head that speculative decoding drafts with: a folder, .safetensors file or Hugging "
                        "Face repo holding mtp.* tensors (e.g. Qwen/Qwen3.6-35B-A3B: only the head's shards "
                        "download); default: the checkpoint's own, if it has one; 'none': no head")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int | None) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    p.add_argument("--temperature", "-t", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--logit-bias", type=_logit_bias_entry, action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable; -100 bans the token), e.g. 151668=-100")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-think", action="store_true", help="chat mode: thinking off (enable_thinking=false)")
    p.add_argument("--speculative", type=_speculative_arg, default=None, metavar="{auto,on,off,1..8}",
                   help="speculative decoding with the model's MTP head (the same output, greedy token for token): "
                        "auto (default: on when the model has a head, plain steps where drafting does not pay), "
                        "on, off, or K drafted tokens per step")


def _speculative_arg(text: str) -> bool | int | None:
    from .speculative import parse_flag
    try:
        return parse_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _logit_bias_entry(text: str) -> tuple[int, float]:
    """`ID=BIAS` (also `ID:BIAS`) -> (token id, bias)."""
    key, sep, value = text.replace(":", "=", 1).partition("=")
    try:
        if not sep:
            raise ValueError
        return int(key), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 151668=-100), got {text!r}") from None


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
                   help="session file: loaded at start when it exists, saved on /save and on every exit "
                        "(/exit, Ctrl-D, Ctrl-C at the prompt)")
    c.add_argument("--show-reasoning", action="store_true",
                   help="show the model's reasoning (its <think> block), dimmed, before the answer "
                        "(default: hidden)")

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, models)")
    _add_model_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY)")
    v.add_argument("--model-name", default=None, help="model id clients send (default: the checkpoint folder name)")
    v.add_argument("--session-dir", default=None, metavar="DIR",
                   help="keep the prefix cache on disk: loaded at start, saved at shutdown and on "
                        "POST /v1/sessions/save")
    v.add_argument("--save-interval", type=float, default=300.0, metavar="SECONDS",
                   help="with --session-dir: also save every SECONDS when a request finished since the last "
                        "save, so a kill loses at most that much (default 300; 0 = only at shutdown)")
    v.add_argument("--cache-gib", type=float, default=None,
                   help="prefix-cache budget in GiB (default: from the model and the free memory: min(1/4 of the "
                        f"free memory, 4 states at the full context); {_free_memory()}; /health shows the value)")
    v.add_argument("--snapshot-interval", type=int, default=4096,
                   help="also snapshot every N tokens of a long prefill (0 = turn boundaries only)")
    v.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="server default for enable_thinking (default: the chat template's)")
    v.add_argument("--reasoning-field", choices=["both", "reasoning_content", "reasoning"], default="both",
                   help="where reasoning goes in responses (default: both names)")
    v.add_argument("--speculative", type=_speculative_arg, default=None, metavar="{auto,on,off,K}",
                   help="speculative decoding with the model's MTP head for requests that do not set "
                        "\"speculative\" themselves: auto (default: on when the model has a head, plain steps "
                        "where drafting does not pay), on, off, or K drafted tokens per step (1..8); the output is "
                        "the same either way")
    v.add_argument("--keepalive", type=float, default=10.0, help="SSE keep-alive comment interval in seconds")
    v.add_argument("--progress-tokens", type=int, default=4096,
                   help="SSE prefill progress comment every N prompt tokens")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = v.add_argument_group("limits (fair serving; all shown in GET /health)")
    g.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                   help="default and ceiling of a request's max_tokens (default 4096)")
    g.add_argument("--parallel", type=int, default=4, metavar="N",
                   help="requests decoding at once, each with its own session, their tokens decoded together in "
                        "one forward per step where the backend batches streams (default 4)")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond, 503 with Retry-After (default 64)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="stop a request this many seconds after it arrived, queue included (0 = never; "
                        "default 600)")
    g.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB",
                   help="request body limit in MiB; larger bodies get 413 (default 4)")
    g.add_argument("--prefill-slice", type=int, default=512, metavar="N",
                   help="prefill tokens between decode rounds of the other running requests (default 512)")
    g.add_argument("--park-gib", type=float, default=None, metavar="GIB",
                   help="all slots busy: a new request parks the longest-running one (state kept, resumed in "
                        "turn) while parked states fit in this many GiB (default: min(1/8 of the free memory, "
                        "--parallel states at the full context); 0 = no parking, new requests wait)")
    g.add_argument("--cors-origins", default="", metavar="LIST",
                   help="comma-separated browser origins allowed by CORS besides this machine's own (localhost, "
                        "127.0.0.1, [::1], any port: allowed by default), or '*'; requests from other web pages "
                        "get 403 and are logged once with this flag")
    g.add_argument("--allowed-hosts", default=None, metavar="LIST",
                   help="comma-separated Host header names answered besides this machine's own (localhost, "
                        "127.0.0.1, [::1]), or '*' for any; default: this machine's names when bound to it (guards "
                        "against DNS rebinding), any name when bound to other interfaces")
    g.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="SIGTERM / Ctrl-C: running requests end with their text so far, queued ones get 503, "
                        "sessions are saved and the server exits within S seconds (default 5)")

    b = sub.add_parser("bench", help="prefill/decode throughput sweeps (batch 1), optional peer; JSON, and a "
                                     "PNG plot when matplotlib is installed")
    _add_model_args(b)
    b.add_argument("--prefill", default="256,512,1024", help="prompt lengths, comma-separated")
    b.add_argument("--decode", default="256,1024", help="decode context lengths, comma-separated")
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    b.add_argument("--decode-steps", type=int, default=16, help="timed single-token steps per decode repeat")
    b.add_argument("--peer", default=None, choices=["mlx-lm"], help="also run a peer engine on the same checkpoint")
    b.add_argument("--peer-max", type=int, default=None, metavar="TOKENS",
                   help="run the peer only at lengths up to this (a slow peer)")
    b.add_argument("--cooldown", type=float, default=0.0, metavar="SECONDS",
                   help="idle seconds before every timed run (laptops throttle: 10-30 on an M-series Mac)")
    b.add_argument("--speculative", default="auto", metavar="{auto,off,K[,K...]}",
                   help="with an MTP head: also decode one chat prompt greedily, plain and speculative with K drafted "
                        "tokens per step (comma-separated: one row each), side by side (default auto: the default "
                        "K; off: skip)")
    b.add_argument("--speculative-tokens", type=int, default=256, metavar="N",
                   help="tokens generated per speculative-vs-plain run (default 256)")
    b.add_argument("--note", default="", help="free text stored in the JSON settings")
    b.add_argument("--out", default=None, metavar="PATH",
                   help="write PATH.json and, with matplotlib installed, PATH.png (default: lily-bench-BACKEND "
                        "in the current folder)")

    i = sub.add_parser("info", help="lily install, backends and checkpoint facts")
    _add_model_args(i)

    c = sub.add_parser("convert", help="HF bf16 checkpoint -> MLX 4-bit export (8-bit router), as mlx_lm.convert")
    c.add_argument("source", help="HF checkpoint folder or repo id")
    c.add_argument("output", help="folder to write (must not exist or be empty)")

    return parser


def _free_memory() -> str:
    """`lily serve --help`: the free memory now (the server's default budgets scale with it)."""
    try:
        from .server.budget import describe_free_memory
    except ImportError:  # the server's dependencies are not installed
        return "free memory unknown"
    return describe_free_memory()


def _mtp_arg(text: str | None) -> bool | str | None:
    """--mtp: None (the checkpoint's own head, if any), 'none' / 'off' (no head), else a source."""
    if text is None:
        return None
    return False if text.strip().lower() in ("none", "off") else text


def _load(args: argparse.Namespace):
    from .model import load
    return load(args.model, backend=args.backend, max_context=args.max_context, threads=args.threads,
                mtp=_mtp_arg(args.mtp))


def _check_speculative(model, value: bool | int | None, flag: str = "--speculative") -> None:
    """--speculative on / K on a model that cannot draft: an error naming why and how to get a head (before any
    prompt runs)."""
    from .errors import LilyError
    from .speculative import describe, drafts, no_head_message
    if value is None or value is False or drafts(model):
        return
    raise LilyError(no_head_message(f"{flag} {describe(value)}", model, "pass --mtp SOURCE",
                                    f"leave {flag} at auto (or off): plain decoding, the same output"))


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling options among the parsed flags (each flag is its option's name, dashed)."""
    kwargs = {k: getattr(args, k) for k in SAMPLING_OPTIONS if hasattr(args, k)}
    kwargs["logit_bias"] = dict(args.logit_bias) if args.logit_bias else None  # the flag repeats ID=BIAS
    return kwargs


def _stream_split(chunks, dim: bool) -> object:
    """Write a split stream (lily.generation.split_reasoning): the answer to stdout, the reasoning to
    stderr (dim on a terminal), so piping keeps only the answer. Returns the final chunk."""
    last, reasoning_open = None, False
    for c in chunks:
        if c.reasoning:
            if dim and not reasoning_open:
                sys.stderr.write("\x1b[2m")
            reasoning_open = True
            sys.stderr.write(c.reasoning)
            sys.stderr.flush()
        if c.text:
            sys.stdout.write(c.text)
            sys.stdout.flush()
        last = c
    if reasoning_open:
        sys.stderr.write("\x1b[0m\n" if dim else "\n")
    return last


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = _load(args)
    _check_speculative(model, args.speculative)
    kwargs = _sampling_kwargs(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        if args.no_think:
            kwargs["enable_thinking"] = False
        prompt_text = model.apply_chat_template(messages, **({"enable_thinking": False} if args.no_think else {}))
        stream = model.generate(messages, stream=True, **kwargs)
    else:
        prompt_text = None
        stream = model.generate(prompt, stream=True, **kwargs)
    if prompt_text is not None:
        stream = split_reasoning(stream, prompt_text)
    last = _stream_split(stream, sys.stderr.isatty())
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.stats is not None and not args.quiet_stats:
        print(last.stats.summary(), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat_terminal import run_chat
    model = _load(args)
    _check_speculative(model, args.speculative)
    return run_chat(args, model, _sampling_kwargs(args))


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    try:
        from .server.app import ServerConfig, serve
    except ImportError as e:
        print(f"error: lily serve needs fastapi, uvicorn and llguidance, lily's own dependencies, and one is "
              f"missing from this environment ({e}): pip install fastapi uvicorn llguidance", file=sys.stderr)
        return 1
    for name in ("max_tokens", "parallel"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)} is invalid: expected at least 1",
                  file=sys.stderr)
            return 2
    if args.max_queue < 0 or args.request_timeout < 0 or args.max_body_mb <= 0 or args.prefill_slice < 1 or \
            (args.cache_gib is not None and args.cache_gib < 0) or (args.park_gib is not None and args.park_gib < 0) \
            or args.shutdown_grace <= 0:
        print("error: --max-queue, --request-timeout, --cache-gib and --park-gib must be >= 0, --max-body-mb and "
              "--shutdown-grace > 0, --prefill-slice >= 1", file=sys.stderr)
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
    _check_speculative(model, args.speculative)
    config = ServerConfig(model_name=args.model_name, api_key=args.api_key or os.environ.get("LILY_API_KEY"),
                          session_dir=args.session_dir,
                          cache_bytes=None if args.cache_gib is None else int(args.cache_gib * (1 << 30)),
                          park_bytes=None if args.park_gib is None else int(args.park_gib * (1 << 30)),
                          shutdown_grace_s=args.shutdown_grace,
                          snapshot_interval=args.snapshot_interval, keepalive_s=args.keepalive,
                          progress_tokens=args.progress_tokens,
                          default_thinking=None if args.thinking is None else args.thinking == "on",
                          reasoning_field=args.reasoning_field, max_tokens=args.max_tokens,
                          parallel=args.parallel, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)), prefill_slice=args.prefill_slice,
                          cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
                          allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host),
                          save_interval_s=args.save_interval, speculative=args.speculative)
    from .speculative import head_summary
    print(f"[lily serve] {model!r} on http://{args.host}:{args.port}/v1\n[lily serve] speculative decoding: "
          f"{head_summary(model, args.speculative)}", file=sys.stderr, flush=True)
    serve(model, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def _allowed_hosts(flag: str | None, bind: str) -> tuple[str, ...] | None:
    """--allowed-hosts as ServerConfig.allowed_hosts: the listed names; unset, none beyond this machine's when bound to
    it, else any (None)."""
    from .server.cors import is_loopback_bind
    if flag is not None:
        return tuple(h.strip() for h in flag.split(",") if h.strip())
    return () if is_loopback_bind(bind) else None


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SystemExit(f"error: {flag} wants positive integers separated by commas, got {text!r}")
    return vals


def _drafts_list(text: str) -> list[int] | None:
    """bench --speculative: auto -> None (the default K), off -> [], K[,K...] -> the Ks (1..8)."""
    from .sampling import MAX_DRAFTS
    t = text.strip().lower()
    if t in ("auto", "on"):
        return None
    if t in ("off", "none"):
        return []
    try:
        vals = [int(x) for x in t.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(1 <= v <= MAX_DRAFTS for v in vals):
        raise SystemExit(f"error: --speculative wants auto, off or drafted tokens per step 1..{MAX_DRAFTS} separated "
                         f"by commas, got {text!r}")
    return vals


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_table, run_bench
    prefill, decode = _int_list(args.prefill, "--prefill"), _int_list(args.decode, "--decode")
    drafts = _drafts_list(args.speculative)
    if args.speculative_tokens < 2:
        raise SystemExit(f"error: --speculative-tokens wants at least 2, got {args.speculative_tokens}")
    need = max(prefill + [c + 2 + args.decode_steps for c in decode])
    if args.max_context is None and need > 32768:  # beyond the default window: room for the longest point
        args.max_context = need
    model = _load(args)
    print(f"[lily bench] {model!r}", file=sys.stderr, flush=True)
    try:
        result = run_bench(model, prefill, decode, args.repeats, peer=args.peer, decode_steps=args.decode_steps,
                           peer_max_tokens=args.peer_max, note=args.note, cooldown_s=args.cooldown,
                           out=args.out or f"lily-bench-{model.backend}", speculative=drafts,
                           speculative_tokens=args.speculative_tokens)
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
        _print_metal_status(_built_backends(_lily))
    except ImportError as e:
        print(f"backends: reference (the C++ extension is not built: {e})")
    model = _load(args)
    print(repr(model))
    for k, v in model.info().items():
        print(f"  {k}: {v}")
    return 0


def _print_metal_status(built: list[str]) -> None:
    """Metal: device, GPU family, tensor ops, and how the kernels compiled (or why Metal is unavailable). The
    emulated device (Linux, tests only) is probed only when the test switch asks auto to consider it."""
    from .model import AUTO_EMULATED_METAL_ENV, metal_status
    if "metal" not in built and not ("metal (emulated)" in built and os.environ.get(AUTO_EMULATED_METAL_ENV) == "1"):
        if "metal (emulated)" in built:
            print(f"metal: emulated device only (tests; {AUTO_EMULATED_METAL_ENV}=1 probes it)")
        return
    status = metal_status()
    if status is None:
        return
    if "error" in status:
        print(f"metal: unavailable (backend='auto' runs on the CPU): {status['error'].strip()}")
        return
    print(f"metal: {status.get('device', '?')} ({status.get('family', '?')}); tensor ops: "
          f"{status.get('tensor_ops', '?')}")
    print(f"  kernels: {status.get('library', '?')}, source hash {status.get('source_hash') or '-'}, "
          f"{'cached' if status.get('cache_hit') == '1' else 'compiled now'} ({status.get('cache', '-')})")


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .errors import CheckpointError
    from .mtp_source import load_with_mtp
    from .testing.checkpoint_writer import export_checkpoint
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"[lily convert] output folder {out} is not empty; pass a new folder")
    ck = load_with_mtp(args.source)  # the MTP head too, when the source has one, quantized by the same rules
    export_checkpoint(ck, out)
    head = "MTP head kept" if ck.mtp is not None else "no MTP head"
    print(f"wrote {out} ({ck.source_format} -> mlx 4-bit, {ck.nbytes / 2**20:.1f} MiB of weights, {head})",
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import LilyError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
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
