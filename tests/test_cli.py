"""`lily` command line on a synthetic checkpoint (reference backend; cpu too when the extension is built)."""
import importlib
import re

import pytest

from lily.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    writer = pytest.importorskip("lily.testing.checkpoint_writer")
    pytest.importorskip("lily.checkpoint")
    from lily.testing import random_weights, tiny_configs
    folder = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=0)
    writer.write_mlx_checkpoint(folder, cfg, tensors, quant)
    writer.write_tokenizer(folder, vocab_size=cfg.vocab_size)
    return str(folder)


def backends():
    out = ["reference"]
    try:
        importlib.import_module("lily._lily")
        out.append("cpu")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("mode", ["--chat", "--raw"])
def test_generate_streams_text_and_stats(ckpt, backend, mode, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    rc = main(["generate", "--model", ckpt, "--backend", backend, mode, "Hello", "-n", "6", "-t", "0"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.endswith("\n")
    assert re.search(r"prompt \d+ tok, prefill [\d.]+ tok/s, TTFT [\d.]+ s, decode [\d.]+ tok/s, \d+ tok", err)


def test_info(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    assert main(["info", "--model", ckpt, "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lily ") and "backend: reference" in out and "max_context:" in out


def test_chat_loop_keeps_session(ckpt, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("LILY_CHAT_HISTORY", str(tmp_path / "history"))
    lines = iter(["Hi", "/reset", "Again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", ckpt, "--backend", "reference", "-n", "4", "-t", "0", "--no-think"]) == 0
    err = capsys.readouterr().err
    assert err.count("decode") == 2


def test_bench_rejects_bad_lengths(capsys):
    """`lily bench` is available (tests/test_bench.py runs it); a malformed length list is a one-line error."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prefill", "12,x"])
    assert "--prefill" in str(e.value)


def test_errors_are_one_line_and_nonzero(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--backend", "reference", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err


def test_generate_sends_reasoning_to_stderr_and_the_answer_to_stdout(capsys, monkeypatch):
    """Thinking on (the default): a reply cut inside its think block (</think> banned) prints nothing on
    stdout; with </think> allowed, stdout has the answer only, never the tag."""
    import lily
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    think_end = lily.load().tokenizer.think_end_id
    assert main(["generate", "Hi", "-n", "8", "-t", "0", "--logit-bias", f"{think_end}=-100", "--quiet-stats"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and err.strip()
    assert main(["generate", "Hi", "-n", "12", "-t", "0", "--quiet-stats"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "</think>" not in out + err and not out.startswith("\n")


def test_logit_bias_and_frequency_penalty_reach_the_sampler(capsys, monkeypatch):
    import lily
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    model = lily.load()
    first = model.generate("The engine", max_tokens=1, temperature=0.0).token_ids[0]
    args = ["generate", "--raw", "The engine", "-n", "1", "-t", "0", "--quiet-stats"]
    assert main(args) == 0
    assert capsys.readouterr().out == model.detokenize([first]) + "\n"
    assert main(args + ["--logit-bias", f"{first}=-100", "--frequency-penalty", "0.5"]) == 0
    assert capsys.readouterr().out != model.detokenize([first]) + "\n"
    with pytest.raises(SystemExit):
        main(args + ["--logit-bias", "the=1"])
    assert "TOKEN_ID=BIAS" in capsys.readouterr().err


def test_convert_hf_checkpoint_to_mlx_export(tmp_path):
    """`lily convert` writes an MLX export whose tensors equal the HF checkpoint quantized at load."""
    import numpy as np

    from lily.checkpoint import load_checkpoint
    from lily.testing import random_dense_weights, tiny_config_dicts, tiny_configs, write_hf_checkpoint, write_tokenizer
    cfg = tiny_configs()["tiny"]
    src = tmp_path / "hf"
    write_hf_checkpoint(src, tiny_config_dicts()["tiny"], random_dense_weights(cfg, 3))
    write_tokenizer(src, cfg.vocab_size)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    a, b = load_checkpoint(str(src)), load_checkpoint(str(tmp_path / "out"))
    assert b.source_format == "mlx" and a.quant == b.quant
    for k in a.tensors:
        np.testing.assert_array_equal(a.tensors[k], b.tensors[k], err_msg=k)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 1  # not empty: a clear error
