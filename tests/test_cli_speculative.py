"""`--speculative` and `--mtp` of `lily generate`, `lily chat` and `lily serve` (issue 39 part 6): the flag reaches
the generation as the speculative option (auto -> None, on -> True, off -> False, K -> K), a bad value is argparse's
clear error, drafting asked of a model without an MTP head is one error line naming `--mtp SOURCE`, and `--mtp` gives
a checkpoint without a head the one of another folder. The drafting model: lily.testing.drafting_weights written as
a checkpoint with its head (`language_model.mtp.*`), whose head drafts what its trunk says."""
from __future__ import annotations

import importlib
import re
import socket
from pathlib import Path

import pytest

from lily.cli import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lily._lily") is None,
                                reason="speculative decoding runs in the C++ extension")


def write_drafting_checkpoint(folder: Path, seed: int = 3, trunk_scale: float = 0.0) -> Path:
    """An MLX checkpoint of the tiny config whose MTP head drafts what its trunk says (the head is quantized at
    load, as any dense head is: partial acceptance)."""
    from lily.config import ModelConfig
    from lily.testing import drafting_weights, tiny_config_dicts
    from lily.testing.checkpoint_writer import write_mlx_checkpoint, write_tokenizer
    d = dict(tiny_config_dicts()["tiny"])
    tok = write_tokenizer(folder, vocab_size=d["vocab_size"])
    d["eos_token_id"] = tok["eos_token_id"]
    tensors, quant = drafting_weights(ModelConfig.from_dict(d), seed, trunk_scale)
    d["mtp_num_hidden_layers"] = 1
    write_mlx_checkpoint(folder, d, tensors, quant, generation_config={
        "eos_token_id": [tok["eos_token_id"], tok["special"]["<|endoftext|>"]]})
    return folder


@pytest.fixture(scope="module")
def drafting(tmp_path_factory) -> str:
    return str(write_drafting_checkpoint(tmp_path_factory.mktemp("drafting_ckpt")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    from lily.testing import write_synthetic_checkpoint
    return str(write_synthetic_checkpoint(tmp_path_factory.mktemp("plain_ckpt"), "tiny"))


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("LILY_CHAT_HISTORY", str(tmp_path / "history"))
    monkeypatch.setenv("LILY_SPECULATIVE_ADAPTIVE", "0")  # keep drafting (the tiny model's verify rarely pays)


def _generate(ckpt: str, *extra: str) -> list[str]:
    return ["generate", "--model", ckpt, "--backend", "cpu", "--threads", "2", "--raw", "Hello there",
            "-n", "24", "-t", "0", *extra]


@pytest.mark.parametrize("flag,value", [(None, None), ("auto", None), ("on", True), ("off", False), ("3", 3),
                                        ("8", 8)])
def test_the_flag_reaches_generate(drafting, flag, value, capsys, monkeypatch):
    from lily.model import Model
    seen = []
    real = Model.generate

    def spy(self, prompt, **kw):
        seen.append(kw.get("speculative", "missing"))
        return real(self, prompt, **kw)

    monkeypatch.setattr(Model, "generate", spy)
    assert main(_generate(drafting, *(["--speculative", flag] if flag else []))) == 0
    assert seen == [value]
    err = capsys.readouterr().err
    if value is False:
        assert "speculative" not in err and "draft" not in err
    else:  # the stats line says how it went
        assert re.search(r"speculative k=\d \(\d+% of \d+ drafts accepted, [\d.]+ tok/verify\)", err), err


def test_speculative_output_is_plain_decodings(drafting, capsys):
    outs = []
    for flag in ("off", "on", "1", "5"):
        assert main(_generate(drafting, "--speculative", flag, "-n", "48")) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0].strip() and all(o == outs[0] for o in outs)


@pytest.mark.parametrize("bad", ["9", "0", "-1", "maybe", "2.5", ""])
def test_a_bad_value_is_a_clear_error(drafting, bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(_generate(drafting, "--speculative", bad))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative" in err and "expected auto, on, off or 1..8" in err


@pytest.mark.parametrize("flag", ["on", "4"])
def test_on_without_a_head_names_the_fix(plain, flag, capsys):
    assert main(_generate(plain, "--speculative", flag)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --speculative {flag} needs the model's MTP head") and err.count("\n") == 1
    assert "no MTP head" in err and "--mtp SOURCE" in err and "Qwen/Qwen3.6-35B-A3B" in err


def test_auto_and_off_without_a_head_decode_plainly(plain, capsys):
    for flag in ("auto", "off"):
        assert main(_generate(plain, "--speculative", flag)) == 0
        err = capsys.readouterr().err
        assert "decode" in err and "draft" not in err


def test_mtp_takes_the_head_of_another_folder(plain, drafting, capsys):
    with pytest.warns(UserWarning, match="MTP head from"):
        assert main(_generate(plain, "--mtp", drafting, "--speculative", "on")) == 0
    assert re.search(r"speculative k=\d \(\d+% of \d+ drafts accepted", capsys.readouterr().err)


def test_mtp_none_leaves_the_head_out(drafting, capsys):
    assert main(_generate(drafting, "--mtp", "none", "--speculative", "on")) == 1
    assert "--mtp SOURCE" in capsys.readouterr().err
    assert main(["info", "--model", drafting, "--backend", "cpu", "--mtp", "none"]) == 0
    assert "mtp: none" in capsys.readouterr().out


def _chat(ckpt: str, lines: list[str], monkeypatch, *extra: str) -> int:
    from typed_input import feed_input
    feed_input(monkeypatch, lines)
    return main(["chat", "--model", ckpt, "--backend", "cpu", "--threads", "2", "-n", "24", "-t", "0", "--no-think",
                 *extra])


def test_chat_drafts_and_stats_show_it(drafting, capsys, monkeypatch):
    assert _chat(drafting, ["Hello", "Again", "/stats", "/exit"], monkeypatch, "--speculative", "2") == 0
    err = capsys.readouterr().err
    assert len(re.findall(r"speculative k=2 \(\d+% of \d+ drafts accepted", err)) == 2
    line = next(x for x in err.splitlines() if x.startswith("[speculative decoding:"))
    assert re.search(r"on, 2 drafted tokens per step, plain steps where drafting does not pay \(MTP head from the "
                     r"checkpoint\); this chat: \d+% of \d+ drafts "
                     r"accepted, [\d.]+ tok/verify over 2 turn\(s\)\]", line), line


def test_chat_without_a_head(plain, drafting, capsys, monkeypatch):
    assert _chat(plain, ["/stats", "/exit"], monkeypatch) == 0
    assert "[speculative decoding: off: the model has no MTP head" in capsys.readouterr().err
    assert _chat(plain, ["/exit"], monkeypatch, "--speculative", "on") == 1
    assert "--mtp SOURCE" in capsys.readouterr().err
    assert _chat(drafting, ["/stats", "/exit"], monkeypatch, "--speculative", "off") == 0
    assert "[speculative decoding: off by default" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_without_a_head_fails_before_serving(plain, capsys):
    pytest.importorskip("fastapi")
    rc = main(["serve", "--model", plain, "--backend", "cpu", "--threads", "2", "--port", str(_free_port()),
               "--speculative", "on"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "--speculative on needs the model's MTP head" in err and "--mtp SOURCE" in err
    with pytest.raises(SystemExit):
        main(["serve", "--speculative", "nine"])
    assert "expected auto, on, off or 1..8" in capsys.readouterr().err


def test_help_lists_the_flags():
    from lily.cli import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "chat", "serve", "bench", "info"):
        text = " ".join(sub[name].format_help().split())
        assert "--mtp SOURCE" in text, name
        if name != "info":
            assert "--speculative" in text, name
