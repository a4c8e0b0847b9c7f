"""The small model bundled with lily (src/lily/models/default, issue 3): it loads with no argument,
writes text in its corpus' style quickly on the CPU, routes tokens over its experts, and agrees with
mlx-lm teacher-forced on held-out text (never trained on), judged against the rounding envelope
(docs/numerics.md).

On this CPU-only CI machine the bf16 peer is mlx-lm's CPU backend, whose bf16 `quantized_matmul`
has ~2% relative error (about 12x the rounding of its bf16 output, measured on random data), so the
fp32-vs-bf16 envelope is wide here (top-1 ~0.86 over these positions) and ENVELOPE_MIN_TOP1 is not
asserted; the strict check is lily (fp32) against mlx-lm upcast to fp32 on the same bytes."""
import json
import time
from pathlib import Path

import numpy as np
import pytest

from lily.testing.metrics import perplexity, rel_rms, top1_agreement
from _mlx_peer import mlx_teacher_forced_logits
from lily.testing.tolerances import ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1, tol

import lily
from lily.model import BUNDLED_MODEL_DIR

POSITIONS = 320
HELDOUT = Path(__file__).parent / "data" / "default_model_heldout.txt"


@pytest.fixture(scope="module")
def model():
    return lily.load(backend="cpu", threads=2)


@pytest.fixture(scope="module")
def heldout_tokens(model):
    ids = np.asarray(model.tokenizer.encode(HELDOUT.read_text(encoding="utf-8")), dtype=np.int32)
    assert len(ids) >= POSITIONS
    return ids[:POSITIONS]


def test_bundled_files():
    files = {p.name: p.stat().st_size for p in BUNDLED_MODEL_DIR.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "MODEL_CARD.md"):
        assert name in files, f"{name} missing from {BUNDLED_MODEL_DIR}"
    total = sum(files.values())
    print(f"\nbundled model: {total / 1e6:.2f} MB in {len(files)} files")
    assert total <= 20e6
    cfg = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
    assert q["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    assert q["language_model.model.layers.0.mlp.shared_expert_gate"]["bits"] == 8
    t = cfg["text_config"]
    assert [i for i, lt in enumerate(t["layer_types"]) if lt == "full_attention"] == [3, 7]


def _word_share(text: str) -> float:
    words = text.split()
    return sum(w.strip(".,;:()'\"!?").isalpha() for w in words) / max(1, len(words))


def test_generates_fluent_text_fast(model):
    """`lily generate` with no --model: documentation-style English in well under a few seconds."""
    t0 = time.time()
    # generation_config sampling, three seeds: a sample may end early at <|im_end|> (speculative decoding draws other
    # samples of the same distribution than plain decoding for a seed), most run to max_tokens
    outs = [model.generate("The for statement", max_tokens=64, seed=seed) for seed in range(3)]
    dt = (time.time() - t0) / len(outs)
    for out in outs:
        print(f"\n{dt:.2f} s, {out.finish_reason}: The for statement{out.text}")
    assert dt < 20
    long = [out for out in outs if len(out.text.split()) >= 20]
    assert len(long) >= 2, [out.text for out in outs]
    for out in long:
        assert _word_share(out.text) > 0.6, out.text          # words, not byte noise
        assert len(set(out.text.split())) >= 12, out.text     # not one token repeated


def test_chat_closes_the_thinking_block(model):
    """Trained on the chat template: after the `<think>\\n` generation prompt it closes the empty
    thinking block and answers in prose."""
    out = model.generate([{"role": "user", "content": "What is a list comprehension?"}], max_tokens=48,
                         temperature=0.0)
    print(f"\n{out.text!r}")
    raw = model.detokenize(out.token_ids)  # out.text is the answer alone once chat replies are split
    assert raw.startswith("\n</think>\n\n"), raw
    assert _word_share(raw.split("</think>")[-1]) > 0.6


def test_heldout_teacher_forced_vs_mlx(model, heldout_tokens):
    tokens = heldout_tokens
    folder = str(BUNDLED_MODEL_DIR)
    ours = np.asarray(model.logits(tokens), np.float32)
    mlx32 = mlx_teacher_forced_logits(folder, tokens, "fp32")
    mlx16 = mlx_teacher_forced_logits(folder, tokens, "bf16")

    env_top1 = top1_agreement(mlx16, mlx32)
    env_ppl = perplexity(mlx16, tokens) / perplexity(mlx32, tokens)
    fp32_top1 = top1_agreement(ours, mlx32)
    fp32_rms = rel_rms(ours, mlx32)
    bf16_top1 = top1_agreement(ours, mlx16)
    bf16_ppl = perplexity(ours, tokens) / perplexity(mlx16, tokens)
    print(f"\n[default model] {POSITIONS} held-out positions, teacher-forced; perplexity lily "
          f"{perplexity(ours, tokens):.3f}, mlx-lm bf16 {perplexity(mlx16, tokens):.3f}, "
          f"mlx-lm fp32 {perplexity(mlx32, tokens):.3f}")
    print(f"  envelope  mlx fp32 vs mlx bf16: top1 {env_top1:.4f}  ppl ratio {env_ppl:.5f}  "
          f"rel_rms {rel_rms(mlx16, mlx32):.3e}")
    print(f"  lily cpu vs mlx fp32:           top1 {fp32_top1:.4f}  ppl ratio "
          f"{perplexity(ours, tokens) / perplexity(mlx32, tokens):.6f}  rel_rms {fp32_rms:.3e}")
    print(f"  lily cpu vs mlx bf16:           top1 {bf16_top1:.4f}  ppl ratio {bf16_ppl:.5f}  "
          f"rel_rms {rel_rms(ours, mlx16):.3e}")

    t = tol("model_vs_mlx")
    assert fp32_rms <= t["rel_rms"]
    assert fp32_top1 >= t["top1"]
    assert bf16_top1 >= env_top1 - ENVELOPE_SLACK_TOP1
    assert abs(bf16_ppl - 1) <= abs(env_ppl - 1) + ENVELOPE_SLACK_PPL
    # a trained model on text it has not seen: low perplexity, far below the uniform 4096
    assert perplexity(ours, tokens) < 60


def test_routing_not_degenerate(heldout_tokens):
    """mlx-lm's routers on held-out text: every layer spreads its top-k slots over most experts."""
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    m, _ = mlx_lm.load(str(BUNDLED_MODEL_DIR))
    blocks = [layer.mlp for layer in m.language_model.model.layers]
    k = blocks[0].top_k
    E = blocks[0].num_experts
    records = {id(b.gate): [] for b in blocks}
    cls = type(blocks[0].gate)
    orig = cls.__call__

    def tapped(self, x):
        y = orig(self, x)
        if id(self) in records:
            records[id(self)].append(mx.argpartition(-y.astype(mx.float32), kth=k - 1, axis=-1)[..., :k])
        return y

    cls.__call__ = tapped
    try:
        mx.eval(m(mx.array(heldout_tokens)[None]))
    finally:
        cls.__call__ = orig
    for i, b in enumerate(blocks):
        idx = np.concatenate([np.array(a).reshape(-1) for a in records[id(b.gate)]])
        share = np.bincount(idx, minlength=E) / idx.size
        nz = share[share > 0]
        entropy = float(-(nz * np.log(nz)).sum() / np.log(E))
        print(f"layer {i}: experts used {int((share > 0).sum())}/{E}  max share {share.max():.3f} "
              f"(uniform {1 / E:.3f})  normalized entropy {entropy:.3f}")
        assert (share > 0).sum() >= 0.75 * E
        assert share.max() <= 6.0 / E
        assert entropy >= 0.85
