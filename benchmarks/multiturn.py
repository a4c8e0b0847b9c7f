"""Multi-turn agentic benchmark: time to first token per turn with prefix reuse on and off.

A 10-turn agent loop (system prompt with tool definitions, one user task, then per turn: the model's tool
call, sent back as an assistant message, and a tool result that grows the context) is run twice on the same
model: with prefix reuse (one session + PrefixCache + ReplyTokens: what `lily serve` does) and without (every
turn prefills the whole conversation from an empty state, as engines without hybrid-state reuse do).
The tool calls are forced by the tool-call grammar so that a random synthetic model produces real calls.

    python benchmarks/multiturn.py --config small --backend cpu --target-tokens 16384
    python benchmarks/multiturn.py --model /path/to/Qwen3.6-35B-A3B-4bit --backend cuda --target-tokens 16384

Writes benchmarks/results/multiturn_<tag>.json (hardware, git sha, settings, per-turn figures) and a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lily.bench import git_sha, hardware

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the user's project and return its contents.",
        "parameters": {"type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "maxLength": 24, "description": "Path relative to the project root"},
            "max_lines": {"type": "integer", "minimum": 1, "maximum": 999}}}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the project for a regular expression.",
        "parameters": {"type": "object", "required": ["pattern"], "properties": {
            "pattern": {"type": "string", "maxLength": 24}}}}},
]
SYSTEM = ("You are a careful coding agent working in the user's repository. Use the tools to read files and "
          "search before you answer. Keep answers short and cite the files you used.")
WORDS = ("the engine loads weights tokenizes prompts and generates tokens while the session keeps its state "
         "between turns so that nothing already seen is computed twice def main return value print open file "
         "read write path config model layer attention expert router cache snapshot restore").split()


def small_config() -> dict:
    """A mid-size config for CPU runs: the real layer pattern and ratios, small dimensions."""
    from lily.testing import config_dict
    d = dict(config_dict("tiny"))
    d.update(hidden_size=512, num_hidden_layers=8, vocab_size=2048, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
             linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
             shared_expert_intermediate_size=256, max_position_embeddings=65536)
    d["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]
    return d


def make_checkpoint(name: str, folder: Path) -> Path:
    from lily.config import ModelConfig
    from lily.testing import config_dict, random_weights, write_mlx_checkpoint, write_tokenizer
    d = small_config() if name == "small" else dict(config_dict(name))
    d["max_position_embeddings"] = max(d["max_position_embeddings"], 65536)
    tok = write_tokenizer(folder, vocab_size=min(d["vocab_size"], 4096))
    d["eos_token_id"] = tok["eos_token_id"]
    tensors, quant = random_weights(ModelConfig.from_dict(d), 0)
    write_mlx_checkpoint(folder, d, tensors, quant, generation_config={"eos_token_id": [tok["eos_token_id"]]})
    return folder


def synthetic_model(name: str, folder: Path, backend: str, threads: int, max_context: int):
    """A synthetic model built in memory (no checkpoint written): the full config's 4-bit weights are views
    of one random pool (benchmarks/bench_cuda.py), smaller configs use lily.testing.random_weights. The
    tokenizer is lily.testing's small one; the model only ever samples tokens the grammar allows."""
    from lily.chat import ChatTemplate
    from lily.config import ModelConfig
    from lily.model import Model, _engine_factory
    from lily.testing import CHAT_TEMPLATE, config_dict, random_weights, write_tokenizer
    from lily.tokenizer import Tokenizer
    d = small_config() if name == "small" else dict(config_dict(name))
    d["max_position_embeddings"] = max(d["max_position_embeddings"], max_context)
    write_tokenizer(folder, vocab_size=min(d["vocab_size"], 4096))
    cfg = ModelConfig.from_dict(d)
    if name == "full":
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_cuda import synthetic_weights
        tensors, quant = synthetic_weights(cfg)
    else:
        tensors, quant = random_weights(cfg, 0)
    factory, _ = _engine_factory(backend)
    engine = factory(cfg.to_dict(), tensors, quant, threads=threads, max_context=max_context)
    return Model(engine, Tokenizer(folder / "tokenizer.json"), cfg, chat_template=ChatTemplate(CHAT_TEMPLATE),
                 path=f"synthetic-{name}", nbytes=sum(a.nbytes for a in tensors.values()))


def tool_result(tokenizer, n_tokens: int, rng: np.random.Generator) -> str:
    """Synthetic file contents of about n_tokens tokens."""
    lines, count = [], 0
    while count < n_tokens:
        line = " ".join(rng.choice(WORDS, size=12))
        lines.append(line)
        count += len(tokenizer.encode(line + "\n"))
    return "\n".join(lines)


class Conversation:
    """One agent loop on `model`, with prefix reuse (one session + PrefixCache + ReplyTokens, as `lily serve`)
    or without (every turn prefills the whole conversation from an empty state). `step()` runs one turn."""

    def __init__(self, model, *, reuse: bool, turns: int, target: int, seed: int, max_tokens: int):
        from lily.sampling import resolve_sampling
        from lily.prefix_cache import PrefixCache, ReplyTokens
        self.model, self.reuse, self.turns, self.target = model, reuse, turns, target
        self.rng = np.random.default_rng(seed)
        self.cache = PrefixCache(max_bytes=8 << 30) if reuse else None
        self.replies = ReplyTokens()
        self.session = model.session(prefix_cache=self.cache)
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Find where the session state is restored and explain it."}]
        self.sampling = resolve_sampling(model.generation_config, max_tokens=max_tokens, temperature=0.0)
        self.turn = 0
        self.rows: list[dict] = []

    def step(self) -> dict:
        from lily.server.grammar import GrammarConstraint, tool_call_grammar
        from lily.server.tool_calls import parse_tool_calls
        from lily.session import Session
        model, self.turn = self.model, self.turn + 1
        text = model.chat_template.render(self.messages, add_generation_prompt=True, tools=TOOLS, enable_thinking=False)
        ids = self.replies.encode(model.tokenizer, text) if self.reuse else model.tokenizer.encode(text)
        if not self.reuse:
            self.session.reset()
        constraint = GrammarConstraint(model, tool_call_grammar(TOOLS, "read_file"))
        real_snapshot, spent = Session.snapshot, [0.0]

        def timed_snapshot(s):  # what the prefix cache costs: state copies while prefilling
            t = time.perf_counter()
            try:
                return real_snapshot(s)
            finally:
                spent[0] += time.perf_counter() - t
        Session.snapshot = timed_snapshot
        try:
            t0 = time.perf_counter()
            stream = self.session.generate(ids, whole=True, stream=True, sampling=self.sampling, constraint=constraint)
            first = next(stream)
            ttft = time.perf_counter() - t0
        finally:
            Session.snapshot = real_snapshot
        chunks = [first, *stream]
        out = [c.token_id for c in chunks]
        stats = chunks[-1].stats  # the last chunk carries the stats
        cache = self.cache
        row = {"turn": self.turn, "prompt_tokens": len(ids), "cached_tokens": stats.cached_tokens,
               "prefilled_tokens": len(ids) - stats.cached_tokens, "ttft_s": ttft, "prefill_s": stats.prefill_s,
               "snapshot_s": spent[0], "generated_tokens": len(out),
               "snapshots_held": len(cache) if cache is not None else 0,
               "cache_bytes": cache.nbytes if cache is not None else 0}
        self.rows.append(row)
        stop = out[-1] if out and out[-1] in model.stop_token_ids else None
        reply_ids = out[:-1] if stop is not None else out
        if self.reuse and stop is not None:
            self.session.flush()  # the server does this between requests
        reply = model.tokenizer.decode(reply_ids)
        self.replies.remember(reply, reply_ids)
        content, calls = parse_tool_calls(reply, TOOLS)
        tool_calls = [{"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")}} for c in calls]
        self.messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
        # the tool result grows the context evenly towards the target over the remaining turns
        grow = (self.target - len(ids) - len(out)) // max(1, self.turns - self.turn)
        self.messages.append({"role": "tool", "content": tool_result(model.tokenizer, max(16, grow - len(out)),
                                                                     self.rng)})
        return row


def warm_up(model) -> None:
    """One prefill and a few decode steps on a throwaway state (allocations, kernel loading), untimed."""
    s = model.session()
    s.prefill([i % min(model.vocab_size, 256) for i in range(512)])
    s.generate(max_tokens=4, temperature=0)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("reuse_off", "prefix reuse off (full prefill)", "o-"),
                              ("reuse_on", "prefix reuse on (lily)", "s-")):
        rows = result["runs"][key]
        a.plot([r["turn"] for r in rows], [r["ttft_s"] * 1e3 for r in rows], style, label=label)
        b.plot([r["turn"] for r in rows], [r["prefilled_tokens"] for r in rows], style, label=label)
    s = result["settings"]
    a.set(xlabel="turn", ylabel="time to first token (ms)", yscale="log",
          title=f"TTFT per turn ({s['backend']}, {s['config']})")
    b.set(xlabel="turn", ylabel="tokens prefilled", yscale="log", title="prompt tokens actually computed")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"lily multi-turn agentic session, {s['turns']} turns growing to ~{s['target_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: a synthetic one of --config)")
    p.add_argument("--config", default="small", help="synthetic config: tiny, small, full")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--target-tokens", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=200, help="token limit per reply (a forced tool call)")
    p.add_argument("--tag", default=None, help="result file name tag (default: backend_config)")
    p.add_argument("--note", default="", help="free text stored in the JSON")
    p.add_argument("--in-memory", action="store_true",
                   help="build the synthetic model in memory instead of writing a checkpoint (always for full)")
    args = p.parse_args(argv)

    import lily
    with tempfile.TemporaryDirectory() as tmp:
        max_context = args.target_tokens + args.target_tokens // 4 + 1024
        t0 = time.perf_counter()
        if not args.model and (args.in_memory or args.config == "full"):
            model = synthetic_model(args.config, Path(tmp), args.backend, args.threads, max_context)
        else:
            path = Path(args.model) if args.model else make_checkpoint(args.config, Path(tmp))
            model = lily.load(path, backend=args.backend, threads=args.threads, max_context=max_context)
        load_s = time.perf_counter() - t0
        config = args.config if not args.model else Path(args.model).name
        print(f"{model!r} (loaded in {load_s:.1f} s)")
        warm_up(model)
        # the two conversations advance in alternating order, turn by turn (benchmarks/results/README.md), so that a change
        # in machine load hits both alike
        convs = {key: Conversation(model, reuse=reuse, turns=args.turns, target=args.target_tokens, seed=0,
                                   max_tokens=args.max_tokens) for key, reuse in (("reuse_on", True), ("reuse_off", False))}
        for turn in range(args.turns):
            order = ("reuse_on", "reuse_off") if turn % 2 == 0 else ("reuse_off", "reuse_on")
            for key in order:
                r = convs[key].step()
                print(f"  {key:9s} turn {r['turn']:2d}: prompt {r['prompt_tokens']:6d} tok, cached "
                      f"{r['cached_tokens']:6d}, TTFT {r['ttft_s'] * 1e3:8.1f} ms (snapshots "
                      f"{r['snapshot_s'] * 1e3:.1f} ms)", flush=True)
        runs = {key: c.rows for key, c in convs.items()}
    on, off = runs["reuse_on"], runs["reuse_off"]
    summary = {
        "final_prompt_tokens": on[-1]["prompt_tokens"],
        "total_ttft_s": {"reuse_on": sum(r["ttft_s"] for r in on), "reuse_off": sum(r["ttft_s"] for r in off)},
        "total_prefilled_tokens": {"reuse_on": sum(r["prefilled_tokens"] for r in on),
                                   "reuse_off": sum(r["prefilled_tokens"] for r in off)},
        "last_turn_ttft_s": {"reuse_on": on[-1]["ttft_s"], "reuse_off": off[-1]["ttft_s"]},
        "last_turn_speedup": off[-1]["ttft_s"] / on[-1]["ttft_s"],
        "mean_speedup_turns_2_on": float(np.mean([b["ttft_s"] / a["ttft_s"] for a, b in zip(on[1:], off[1:])])),
    }
    note = args.note or (f"{args.backend} backend, synthetic '{args.config}' config (random weights, not the "
                         f"full model)" if not args.model else f"{args.backend} backend, {config}")
    result = {"benchmark": "multiturn", "git_sha": git_sha(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "hardware": hardware(model),
              "settings": {"backend": model.backend, "config": config, "threads": model.threads,
                           "turns": args.turns, "target_tokens": args.target_tokens, "max_tokens": args.max_tokens,
                           "params": model.params, "weights_bytes": model.nbytes, "max_context": model.max_context,
                           "sampling": "greedy, forced read_file tool call (grammar)", "enable_thinking": False,
                           "order": "reuse on/off conversations alternate turn by turn; one warm-up first",
                           "note": note},
              "summary": summary, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.backend}_{config}"
    out = RESULTS / f"multiturn_{tag}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
