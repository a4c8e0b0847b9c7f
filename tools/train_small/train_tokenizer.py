#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of lily's default model and encode the corpus.

Same scheme as Qwen3.6 (docs/model.md §8): GPT-2 byte map, the Qwen3.5 pre-tokenizer regex, NFC,
no BOS. Vocabulary: VOCAB_SIZE ids in all, regular tokens first, then the Qwen chat tokens
(<|endoftext|>, <|im_start|>, <|im_end|> as special tokens; <think>, </think>, <tool_call>,
</tool_call>, <tool_response>, </tool_response> as added non-special tokens, as in Qwen's tokenizer).

Then the corpus (prepare_corpus.py's output) is tokenized:
  train.bin  uint16 token ids: documents, code files and chat samples, shuffled at document level,
             each followed by <|endoftext|>
  val.bin    uint16 ids of the held-out documents, each followed by <|endoftext|>
Chat samples are rendered exactly as the checkpoint's chat template renders a single-turn conversation
with an empty thinking block (what `lily chat` feeds the model, thinking on or off).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are an expert on Python.",
                  "Answer questions about Python and its standard library."]


def render_chat(q: str, a: str, key: str) -> str:
    """One user turn and one assistant answer, as the Qwen3.5 template renders them (thinking block empty)."""
    h = int(hashlib.md5(key.encode()).hexdigest(), 16)
    sys_part = ""
    if h % 4 == 0:
        sys_part = f"<|im_start|>system\n{SYSTEM_PROMPTS[(h >> 4) % len(SYSTEM_PROMPTS)]}<|im_end|>\n"
    return (f"{sys_part}<|im_start|>user\n{q.strip()}<|im_end|>\n"
            f"<|im_start|>assistant\n<think>\n\n</think>\n\n{a.strip()}<|im_end|>\n")


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from tokenizers import AddedToken, processors, trainers

    docs = read_jsonl(os.path.join(args.data, "train_docs.jsonl"))
    code = read_jsonl(os.path.join(args.data, "train_code.jsonl"))
    chat = read_jsonl(os.path.join(args.data, "train_chat.jsonl"))
    val = read_jsonl(os.path.join(args.data, "val_docs.jsonl"))

    tok = build_tokenizer()
    n_added = len(SPECIAL) + len(ADDED)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab - n_added, min_frequency=2, show_progress=False,
                                  initial_alphabet=__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])

    def texts():
        for d in docs:
            yield d["text"]
        for d in code:
            yield d["text"]
        for p in chat:
            yield p["q"] + "\n" + p["a"]
    tok.train_from_iterator(texts(), trainer=trainer)
    base = tok.get_vocab_size()
    assert base == args.vocab - n_added, (base, args.vocab - n_added)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == args.vocab
    out = os.path.join(args.data, "tokenizer.json")
    tok.save(out)
    ids = {t: tok.token_to_id(t) for t in SPECIAL + ADDED}
    print("tokenizer:", out, "vocab", tok.get_vocab_size(), ids)

    eot = tok.token_to_id("<|endoftext|>")
    samples = [d["text"] for d in docs] + [d["text"] for d in code] + \
              [render_chat(p["q"], p["a"], p["q"]) for p in chat]
    kinds = ["docs"] * len(docs) + ["code"] * len(code) + ["chat"] * len(chat)
    order = list(range(len(samples)))
    random.Random(args.seed).shuffle(order)
    # A chat sample is tokenized the way it meets the model at inference: the prompt (up to and with
    # the generation prompt `<|im_start|>assistant\n<think>\n`) on its own, then the completion on its
    # own, so the model learns to continue the prompt's final '\n' token with '\n</think>\n\n' rather
    # than only ever seeing the merged '\n\n' token. Every other sample keeps the thinking-off
    # prompt (`<think>\n\n</think>\n\n` inside the prompt), also split off from the answer.
    parts: list[str] = []
    owner: list[int] = []
    for j, i in enumerate(order):
        s = samples[i]
        if kinds[i] == "chat":
            cut = s.index("<think>\n") + len("<think>\n")
            if j % 2 == 1:
                cut = s.index("</think>\n\n") + len("</think>\n\n")
            parts += [s[:cut], s[cut:]]
            owner += [i, i]
        else:
            parts.append(s)
            owner.append(i)
    enc = tok.encode_batch(parts, add_special_tokens=False)
    counts = {"docs": 0, "code": 0, "chat": 0}
    chunks = []
    for n, (i, e) in enumerate(zip(owner, enc)):
        last = n + 1 == len(owner) or owner[n + 1] != i
        chunks.append(np.asarray(e.ids + ([eot] if last else []), dtype=np.uint16))
        counts[kinds[i]] += len(e.ids) + int(last)
    train = np.concatenate(chunks)
    venc = tok.encode_batch([d["text"] for d in val], add_special_tokens=False)
    vids = np.concatenate([np.asarray(e.ids + [eot], dtype=np.uint16) for e in venc])
    train.tofile(os.path.join(args.data, "train.bin"))
    vids.tofile(os.path.join(args.data, "val.bin"))
    val_chars = sum(len(d["text"]) for d in val)
    stats = {"vocab_size": tok.get_vocab_size(), "special_ids": ids, "train_tokens": int(train.size),
             "train_tokens_by_kind": counts, "val_tokens": int(vids.size), "val_chars": val_chars,
             "val_chars_per_token": val_chars / vids.size,
             "tokenizer_sha256": hashlib.sha256(open(out, "rb").read()).hexdigest()}
    with open(os.path.join(args.data, "tokens.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats, indent=1))
    # round trip on a chat sample and the start of a document
    s = render_chat("What is a list?", "A mutable sequence.", "x")
    assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    print(tok.encode(s).tokens)


if __name__ == "__main__":
    main()
