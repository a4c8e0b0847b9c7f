#!/usr/bin/env python3
"""Export the trained HF bf16 weights (train.py's output) to the published MLX 4-bit format.

The conversion is lily's own: `lily.checkpoint.load_checkpoint` quantizes an HF bf16 original at
load exactly as `mlx_lm.convert -q` would (group 64 affine, 4-bit; router and shared-expert gate
8-bit; norms shifted to 1+w; conv1d to [C,K,1]; experts unfused), bit-identical to mx.quantize
(lily.quant), and `lily.testing.checkpoint_writer.write_mlx_checkpoint` writes the mlx-community
layout (nested text_config, quantization + quantization_config blocks, language_model.* names).

Written to --dst (default src/lily/models/default): config.json, model.safetensors (+ index),
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja.

Then, unless --no-eval: mlx-lm loads the result, measures the validation perplexity on val.bin
(non-overlapping windows of --seq tokens, every position scored) and the routing histogram, and
generates samples; results go to --src/eval_mlx.json and the model card MODEL_CARD.md is written from the training log, the corpus manifest and these results.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
import model_config as mc  # noqa: E402

SAMPLE_PROMPTS = ["The list type", "To open a file", "The json module"]
CHAT_QUESTIONS = ["What is a dictionary?", "How do I read a file line by line?"]


def tokenizer_config(tok_path: str) -> dict:
    """tokenizer_config.json in the form lily.testing.checkpoint_writer.write_tokenizer writes."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tok_path)
    added = tok.get_added_tokens_decoder()
    return {
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "model_max_length": 32768,
        "added_tokens_decoder": {str(i): {"content": t.content, "special": bool(t.special), "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
                                 for i, t in sorted(added.items())},
    }


def export(src: str, dst: str, data: str) -> None:
    from lily.checkpoint import load_checkpoint
    from lily.testing.chat_template import CHAT_TEMPLATE
    from lily.testing.checkpoint_writer import write_mlx_checkpoint

    ck = load_checkpoint(src, progress=False)
    assert ck.source_format == "hf", ck.source_format
    bits = {}
    for m, (b, g) in ck.quant.items():
        bits[b] = bits.get(b, 0) + 1
    print(f"quantized {len(ck.quant)} modules: {bits}; dense tensors: "
          f"{sorted(n for n in ck.tensors if not any(n.startswith(m + '.') for m in ck.quant))[:6]} ...")
    if os.path.isdir(dst):
        for fn in os.listdir(dst):
            if fn.endswith((".safetensors", ".json", ".jinja")):
                os.remove(os.path.join(dst, fn))
    with open(os.path.join(src, "config.json")) as f:
        text_cfg = json.load(f)["text_config"]
    write_mlx_checkpoint(dst, text_cfg, ck.tensors, ck.quant, generation_config=mc.GENERATION_CONFIG)
    shutil.copy(os.path.join(data, "tokenizer.json"), os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(os.path.join(dst, "tokenizer.json")), f, indent=2, ensure_ascii=False)
    with open(os.path.join(dst, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    for fn in sorted(os.listdir(dst)):
        print(f"  {fn:36s} {os.path.getsize(os.path.join(dst, fn)):>10,d} B")


def _windows(data: str, seq: int) -> list[np.ndarray]:
    """The validation windows: val.bin cut into non-overlapping pieces of seq+1 ids (shared edge)."""
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16).astype(np.int32)
    return [val[w * seq: (w + 1) * seq + 1] for w in range((len(val) - 1) // seq)]


def _summary(losses: list[float], seq: int, seconds: float, **kw) -> dict:
    return {"loss": float(np.mean(losses)) / seq, "ppl": math.exp(float(np.sum(losses)) / (len(losses) * seq)),
            "windows": len(losses), "tokens": len(losses) * seq, "seconds": round(seconds, 1),
            "window_losses": [float(x) for x in losses], **kw}


def mlx_ppl(dst: str, data: str, seq: int, dtype: str, n_windows: int | None = None) -> dict:
    """mlx-lm summed next-token loss per window, model as loaded ("bf16") or upcast ("fp32")."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load
    model, _ = load(dst)
    if dtype == "fp32":
        model.set_dtype(mx.float32)
    losses, t0 = [], time.time()
    for ids in _windows(data, seq)[:n_windows]:
        x = mx.array(ids)[None]
        logits = model(x[:, :-1])
        losses.append(nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:], reduction="sum").item())
    return _summary(losses, seq, time.time() - t0, dtype=dtype)


def lily_ppl(dst: str, data: str, seq: int) -> dict:
    """lily (`Model.logits`, CPU backend) summed next-token loss per window."""
    import lily
    model = lily.load(dst, backend="cpu")
    losses, t0 = [], time.time()
    for ids in _windows(data, seq):
        lg = np.asarray(model.logits(ids[:-1]), np.float64)
        m = lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
        losses.append(float((lse - lg[np.arange(seq), ids[1:]]).sum()))
    return _summary(losses, seq, time.time() - t0, backend="cpu")


def mlx_samples(dst: str) -> tuple[dict, dict]:
    """Greedy samples from mlx-lm with the model as loaded."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler
    model, tok = load(dst)
    sampler = make_sampler(temp=0.0)
    outs = {p: generate(model, tok, p, max_tokens=64, sampler=sampler, verbose=False) for p in SAMPLE_PROMPTS}
    chats = {}
    for q in CHAT_QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False)
        chats[q] = generate(model, tok, prompt, max_tokens=96, sampler=sampler, verbose=False)
    return outs, chats


def routing_mlx(dst: str, data: str, seq: int, n_windows: int) -> list[list[float]]:
    """Share of the top-k slots per expert and layer (mlx-lm's routers, fp32) over the first windows."""
    import mlx.core as mx
    from mlx_lm import load
    model, _ = load(dst)
    model.set_dtype(mx.float32)
    moe_blocks = [layer.mlp for layer in model.language_model.model.layers]
    k, E = moe_blocks[0].top_k, moe_blocks[0].num_experts
    records: list[list] = [[] for _ in moe_blocks]
    idmap = {id(b.gate): i for i, b in enumerate(moe_blocks)}
    cls = type(moe_blocks[0].gate)
    orig = cls.__call__

    def tapped(self, x):
        y = orig(self, x)
        i = idmap.get(id(self))
        if i is not None:
            records[i].append(mx.argpartition(-y.astype(mx.float32), kth=k - 1, axis=-1)[..., :k])
        return y

    cls.__call__ = tapped
    try:
        for ids in _windows(data, seq)[:n_windows]:
            mx.eval(model(mx.array(ids[:-1])[None]), *[r[-1] for r in records if r])
    finally:
        cls.__call__ = orig
    out = []
    for r in records:
        idx = np.concatenate([np.array(a).reshape(-1) for a in r])
        c = np.bincount(idx, minlength=E).astype(np.float64)
        out.append((c / c.sum()).tolist())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=os.path.join(HERE, "out"), help="train.py's output folder")
    ap.add_argument("--dst", default=os.path.join(ROOT, "src", "lily", "models", "default"))
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--bf16-windows", type=int, default=8,
                    help="windows for the mlx-lm bf16 run (mlx's CPU bf16 is ~8x slower than fp32)")
    ap.add_argument("--routing-windows", type=int, default=8)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="only evaluate (resuming) and write the card")
    ap.add_argument("--card-only", action="store_true", help="only write MODEL_CARD.md from saved results")
    ap.add_argument("--history", nargs="*", default=[], help="train_log.json of earlier runs, for the card")
    args = ap.parse_args()
    if args.card_only:
        write_card(args)
        return
    if not args.no_export:
        export(args.src, args.dst, args.data)
    if args.no_eval:
        return
    path = os.path.join(args.src, "eval_mlx.json")
    res = {}
    if args.no_export and os.path.exists(path):
        with open(path) as f:
            res = json.load(f)

    def step(key, fn):
        if key not in res:
            t0 = time.time()
            res[key] = fn()
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
            print(f"{key}: {time.time() - t0:.0f} s", {k: v for k, v in res[key].items() if k != "window_losses"}
                  if isinstance(res[key], dict) else "", flush=True)
    step("lily", lambda: lily_ppl(args.dst, args.data, args.seq))
    step("mlx_fp32", lambda: mlx_ppl(args.dst, args.data, args.seq, "fp32"))
    step("mlx_bf16", lambda: mlx_ppl(args.dst, args.data, args.seq, "bf16", args.bf16_windows))
    step("routing", lambda: {"windows": args.routing_windows,
                             "share": routing_mlx(args.dst, args.data, args.seq, args.routing_windows)})
    if "samples" not in res:
        res["samples"], res["chat_samples"] = mlx_samples(args.dst)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    write_card(args)


def lily_samples(dst: str) -> tuple[dict, str]:
    import lily
    model = lily.load(dst, backend="cpu", threads=2)
    out, n, t = {}, 0, 0.0
    for p in SAMPLE_PROMPTS:
        r = model.generate(p, max_tokens=64, seed=0)
        out[p] = r.text
    q = CHAT_QUESTIONS[0]
    out[f"chat: {q}"] = model.generate([{"role": "user", "content": q}], max_tokens=96, seed=0).text
    t0 = time.time()
    r = model.generate("The for statement", max_tokens=128, seed=1)
    dt = time.time() - t0
    st = r.stats
    speed = (f"`generate` of {st.generated_tokens} tokens took {dt:.2f} s "
             f"({st.generated_tokens / max(st.decode_s, 1e-9):.0f} tokens/s decode, 2 threads, CPU backend)")
    return out, speed


def _routing_summary(hist) -> list[str]:
    rows = ["| layer | min share | max share | experts never chosen | normalized entropy |",
            "|---|---|---|---|---|"]
    for i, h in enumerate(hist):
        h = np.asarray(h, dtype=np.float64)
        nz = h[h > 0]
        ent = float(-(nz * np.log(nz)).sum() / math.log(len(h)))
        rows.append(f"| {i} | {h.min():.4f} | {h.max():.4f} | {int((h == 0).sum())} | {ent:.3f} |")
    return rows


def write_card(args):
    """MODEL_CARD.md from train_log.json, eval_mlx.json, the corpus manifest and tokens.json."""
    def rj(path):
        with open(path) as f:
            return json.load(f)
    tl = rj(os.path.join(args.src, "train_log.json"))
    ev = rj(os.path.join(args.src, "eval_mlx.json"))
    man = rj(os.path.join(args.data, "manifest.json"))
    tk = rj(os.path.join(args.data, "tokens.json"))
    cfg = rj(os.path.join(args.dst, "config.json"))["text_config"]
    lil, m32, m16 = ev["lily"], ev["mlx_fp32"], ev["mlx_bf16"]
    nb = m16["windows"]

    def sub(r):
        return math.exp(sum(r["window_losses"][:nb]) / (nb * args.seq))
    files = {fn: os.path.getsize(os.path.join(args.dst, fn)) for fn in sorted(os.listdir(args.dst))
             if fn != "MODEL_CARD.md"}
    weights_b = sum(v for k, v in files.items() if k.endswith(".safetensors"))
    sha = {}
    for fn in files:
        if fn.endswith((".safetensors", "tokenizer.json")):
            with open(os.path.join(args.dst, fn), "rb") as f:
                sha[fn] = hashlib.sha256(f.read()).hexdigest()
    h = tl["history"]
    curve = [f"| {s} | {l:.3f} |" for s, l in zip(h["step"], h["loss"])
             if s in (10, 50, 100) or s % max(1, tl["steps"] // 10 // 10 * 10 or 10) == 0][:14]
    evals = "\n".join(f"| {e['step']} | {e['val_loss']:.4f} | {e['val_ppl']:.2f} |" for e in tl["evals"])
    a = tl["args"]
    lines = [
        "# lily default model: `lily-pydoc-25m` (Qwen3.6-35B-A3B architecture, 25M parameters)",
        "",
        "A small language model that ships inside lily so that `lily generate`, `lily chat` and `lily.load()` "
        "work offline with no download. It has **the architecture of Qwen3.6-35B-A3B** (model type "
        "`qwen3_5_moe`): Gated DeltaNet and gated full-attention layers in the same 3:1 pattern, a sparse "
        "MoE with a shared expert in every layer, stored in the published MLX 4-bit format (affine, "
        "group 64; router and shared-expert gate 8-bit). It was trained from scratch by the lily project on "
        "the Python documentation and standard library source, so it writes text in that style. It "
        "is a demonstration and test model, not an assistant: its statements are often wrong.",
        "",
        "## Architecture",
        "",
        "| | this model | Qwen3.6-35B-A3B |",
        "|---|---|---|",
        f"| hidden size | {cfg['hidden_size']} | 2048 |",
        f"| layers (DeltaNet / attention) | {cfg['num_hidden_layers']} (layers "
        f"{', '.join(str(i) for i, t in enumerate(cfg['layer_types']) if t == 'full_attention')} attention) | 40 (30 / 10) |",
        f"| attention heads / KV heads / head dim | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / "
        f"{cfg['head_dim']} (output gate, rotary on {int(cfg['head_dim'] * 0.25)} dims) | 16 / 2 / 256 |",
        f"| DeltaNet key heads / value heads / Dk / Dv | {cfg['linear_num_key_heads']} / "
        f"{cfg['linear_num_value_heads']} / {cfg['linear_key_head_dim']} / {cfg['linear_value_head_dim']} | 16 / 32 / 128 / 128 |",
        f"| experts / active / expert width / shared expert width | {cfg['num_experts']} / "
        f"{cfg['num_experts_per_tok']} / {cfg['moe_intermediate_size']} / {cfg['shared_expert_intermediate_size']} "
        f"| 256 / 8 / 512 / 512 |",
        f"| vocabulary | {cfg['vocab_size']} | 248320 |",
        f"| parameters | {tl['params']:,} | 35 B |",
        f"| weights on disk (4-bit) | {weights_b / 1e6:.1f} MB | 19.5 GB |",
        "",
        "## Training data",
        "",
        f"* **Python 3.11 documentation**, Debian package `{man['package']}` (from `python3-doc`): the HTML "
        f"under `{man['source']}` converted to plain text by `tools/train_small/prepare_corpus.py` "
        f"({man['train_docs']} pages, {man['train_chars'] / 1e6:.1f} M characters for training).",
        f"* **Python standard library source**, Debian package `{man.get('code_package', 'libpython3.11-stdlib')}` "
        f"({man.get('code_files', 0)} modules under `{man.get('code_source', '')}`, tests and generated "
        f"files excluded; {man.get('code_chars', 0) / 1e6:.1f} M characters).",
        f"* **Chat pairs** ({man['chat_pairs']:,}) built from the training pages only: FAQ questions, glossary "
        "terms, API entries and section headings as the user turn, the text that follows them as the "
        "answer, rendered with the checkpoint's chat template (empty thinking block), so `lily chat` "
        "answers in the documentation's words and stops with `<|im_end|>`.",
        f"* **Held-out validation**: {man['val_docs']} documentation pages ({man['val_percent']}% of pages, "
        f"chosen by a hash of the path; {man['val_chars']:,} characters, {tk['val_tokens']:,} tokens), "
        "never trained on, including `library/stdtypes.html`.",
        f"* Training tokens: {tk['train_tokens']:,} ({', '.join(f'{k} {v:,}' for k, v in tk['train_tokens_by_kind'].items())}).",
        "",
        "**License of the data.** The Python documentation and the standard library are Copyright © 2001-2023 "
        "Python Software Foundation; All Rights Reserved, and licensed under the PSF License Agreement "
        "(Version 2); code examples in the documentation are also available under the Zero-Clause BSD "
        "license. See `license.html` in the documentation and `/usr/share/doc/python3.11-doc/copyright`. "
        "The PSF License permits derivative works provided this notice is retained. The model "
        "weights are distributed with lily under its Apache-2.0 license.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (GPT-2 byte map, the Qwen3.5 pre-tokenizer regex, NFC, no BOS) trained with "
        f"`tokenizers` on the training text: {tk['vocab_size']} ids, the chat tokens last: "
        + ", ".join(f"`{t}` = {i}" for t, i in tk["special_ids"].items())
        + f". {tk['val_chars_per_token']:.2f} characters per token on the validation text. The chat "
        "template is lily's Qwen3.6-style template (`<think>` generation prompt, XML tool calls).",
        "",
        "## Training",
        "",
        f"transformers `Qwen3_5MoeForCausalLM` ({tl['transformers']}), PyTorch {tl['torch']}, one "
        f"{tl['device']}: bf16 autocast with fp32 master weights, AdamW (β 0.9/0.95, weight decay "
        f"{a['wd']}), peak learning rate {a['lr']}, {a['warmup']} warmup steps then cosine to "
        f"{a['min_lr_frac']}×, gradient clipping 1.0, batches of {a['batch']} × {a['seq']} tokens, "
        f"Switch load-balancing loss per layer (coefficient {a['aux']}). Experts ran as grouped GEMMs "
        f"({tl['experts_impl']}); Gated DeltaNet used transformers' PyTorch chunked kernel. "
        f"{tl['steps']} steps ({tl['steps'] * tl['tokens_per_step'] / 1e6:.0f} M tokens, "
        f"{tl['steps'] * tl['tokens_per_step'] / tl['train_tokens']:.1f} epochs) in "
        f"**{tl['train_time_s'] / 60:.1f} minutes**; the weights with the best validation loss "
        f"(step {tl['best_step']}) were kept. Reproduce with `tools/train_small/README.md`.",
        *[f"\nAn earlier run ({e['steps']} steps, {e['steps'] * e['tokens_per_step'] / e['train_tokens']:.1f} "
          f"epochs, {e['train_time_s'] / 60:.1f} minutes) reached its best validation perplexity "
          f"{e['best_val_ppl']:.2f} at step {e['best_step']} and then overfit (final {e['evals'][-1]['val_ppl']:.2f}, "
          f"training loss {e['history']['loss'][-1]:.2f}); the shipped run's length was set from it, and its "
          "chat samples were re-tokenized so the model sees the generation prompt's own final token."
          for e in (rj(h) for h in args.history)],
        "",
        "| step | validation loss | perplexity |",
        "|---|---|---|",
        evals,
        "",
        "## Evaluation",
        "",
        f"Validation perplexity over the held-out pages: windows of {args.seq} tokens with no overlap, every "
        f"position scored ({lil['tokens']:,} tokens; `tools/train_small/heldout/val.bin` holds the ids).",
        "",
        "| engine | weights | perplexity |",
        "|---|---|---|",
        f"| PyTorch (transformers, bf16 autocast), during training | bf16, before export | {tl['best_val_ppl']:.3f} |",
        f"| mlx-lm {_mlx_lm_version()}, CPU, `model.set_dtype(mx.float32)` | this checkpoint | "
        f"**{m32['ppl']:.4f}** |",
        f"| lily {_lily_version()}, `Model.logits`, CPU backend | this checkpoint | **{lil['ppl']:.4f}** |",
        "",
        f"lily and mlx-lm agree within {100 * abs(lil['ppl'] / m32['ppl'] - 1):.4f}%. Export to 4-bit costs "
        f"{100 * (lil['ppl'] / tl['best_val_ppl'] - 1):.1f}% perplexity.",
        "",
        f"mlx-lm with the model as loaded (bf16 activations) is ~8x slower on the CPU, so it was run on the "
        f"first {nb} windows ({nb * args.seq:,} tokens):",
        "",
        "| engine | perplexity, first windows |",
        "|---|---|",
        f"| mlx-lm, as loaded (bf16) | {m16['ppl']:.4f} |",
        f"| mlx-lm, fp32 | {sub(m32):.4f} |",
        f"| lily | {sub(lil):.4f} |",
        "",
        f"mlx-lm's bf16 run is {100 * (m16['ppl'] / sub(m32) - 1):+.2f}% off its own fp32 run: MLX's CPU "
        "`quantized_matmul` in bf16 has about 2% relative error on random data (12 times the rounding of "
        "its bf16 output), so on the CPU the bf16 peer is the noisier one; lily computes in fp32.",
        "",
        f"Routing on the held-out text (mlx-lm's routers, first {ev['routing']['windows']} windows; share of "
        f"the top-{cfg['num_experts_per_tok']} slots per expert, uniform = {1 / cfg['num_experts']:.4f}):",
        "",
        *_routing_summary(ev["routing"]["share"]),
        "",
        "## Samples",
        "",
        "`lily generate` (the generation_config's sampling: temperature 0.7, top-k 20, top-p 0.95; seed 0, "
        "64 tokens):",
        "",
    ]
    samples, speed = lily_samples(args.dst)
    lines[-2:-2] = [f"Speed on a 2-core x86-64 CPU (the machine the model was exported on): {speed}.", ""]
    for p, o in samples.items():
        lines += [f"**{p}**", "", "```", (o if p.startswith("chat: ") else p + o).strip(), "```", ""]
    lines += ["mlx-lm, greedy:", ""]
    for p, o in ev["samples"].items():
        # mlx-lm's streaming BPE detokenizer trims the first token's leading space
        lines += [f"**{p}**", "", "```", (p + (" " if o[:1].isalnum() else "") + o).strip(), "```", ""]
    for q, o in ev["chat_samples"].items():
        lines += [f"**chat: {q}**", "", "```", o.strip(), "```", ""]
    lines += ["## Files", "", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {fn} | {b:,} | {sha.get(fn, '')[:16]} |" for fn, b in files.items()]
    with open(os.path.join(args.dst, "MODEL_CARD.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", os.path.join(args.dst, "MODEL_CARD.md"))


def _lily_version():
    try:
        import lily
        return getattr(lily, "__version__", "")
    except Exception:  # noqa: BLE001
        return ""


def _mlx_lm_version():
    try:
        import mlx_lm
        return mlx_lm.__version__
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    main()
