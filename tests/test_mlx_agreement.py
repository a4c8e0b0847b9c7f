"""Independent check against mlx-lm (issue 2): the same synthetic checkpoint bytes loaded by both,
teacher-forced over 256 positions, judged against the rounding envelope (docs/numerics.md)."""
import numpy as np
import pytest

from lily.testing.metrics import perplexity, rel_rms, top1_agreement
from _mlx_peer import mlx_teacher_forced_logits
from lily.testing.tolerances import ENVELOPE_MIN_TOP1, ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1, tol

import lily
import lily.testing

POSITIONS = 256


@pytest.fixture(scope="module", params=["tiny", "tiny_dk_ne_dv"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, str(lily.testing.write_synthetic_checkpoint(folder, request.param, seed=7))


def test_cpu_backend_agrees_with_mlx_lm(checkpoint):
    name, folder = checkpoint
    model = lily.load(folder, backend="cpu")
    tokens = np.random.default_rng(11).integers(0, model.config.vocab_size, POSITIONS).astype(np.int32)
    ours = model.logits(tokens)
    mlx32 = mlx_teacher_forced_logits(folder, tokens, "fp32")
    mlx16 = mlx_teacher_forced_logits(folder, tokens, "bf16")

    env_top1 = top1_agreement(mlx16, mlx32)
    env_ppl = perplexity(mlx16, tokens) / perplexity(mlx32, tokens)
    env_rms = rel_rms(mlx16, mlx32)
    fp32_top1 = top1_agreement(ours, mlx32)
    fp32_rms = rel_rms(ours, mlx32)
    bf16_top1 = top1_agreement(ours, mlx16)
    bf16_ppl = perplexity(ours, tokens) / perplexity(mlx16, tokens)
    print(f"\n[{name}] {POSITIONS} positions, teacher-forced")
    print(f"  envelope  mlx fp32 vs mlx bf16: top1 {env_top1:.4f}  ppl ratio {env_ppl:.5f}  rel_rms {env_rms:.3e}")
    print(f"  lily cpu vs mlx fp32:           top1 {fp32_top1:.4f}  ppl ratio "
          f"{perplexity(ours, tokens) / perplexity(mlx32, tokens):.6f}  rel_rms {fp32_rms:.3e}")
    print(f"  lily cpu vs mlx bf16:           top1 {bf16_top1:.4f}  ppl ratio {bf16_ppl:.5f}  "
          f"rel_rms {rel_rms(ours, mlx16):.3e}")

    assert env_top1 >= ENVELOPE_MIN_TOP1, "synthetic checkpoint too chaotic for the envelope to mean anything"
    t = tol("model_vs_mlx")
    assert fp32_rms <= t["rel_rms"]
    assert fp32_top1 >= t["top1"]
    assert bf16_top1 >= env_top1 - ENVELOPE_SLACK_TOP1
    assert abs(bf16_ppl - 1) <= abs(env_ppl - 1) + ENVELOPE_SLACK_PPL
