"""`lily bench` / lily.bench.run_bench on a tiny synthetic checkpoint: the JSON schema and positive figures
(a smoke test of the harness, not a timed test)."""
import importlib
import json
import sys

import pytest

from lily.bench import format_table, plot, run_bench
from lily.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lily.testing import write_synthetic_checkpoint
    return str(write_synthetic_checkpoint(tmp_path_factory.mktemp("bench_ckpt"), "tiny"))


def _backend():
    try:
        importlib.import_module("lily._lily")
        return "cpu"
    except ImportError:
        return "reference"


def _check_schema(res, engines, prefill, decode):
    assert res["benchmark"] == "bench"
    assert isinstance(res["git_sha"], str) and res["git_sha"]
    hw = res["hardware"]
    assert hw["cpu_count"] >= 1 and "machine" in hw
    s = res["settings"]
    assert s["prefill_lengths"] == prefill and s["decode_contexts"] == decode and s["engines"] == engines
    keys = {(r["engine"], r["phase"], r["tokens"]) for r in res["rows"]}
    want = {(e, "prefill", n) for e in engines for n in prefill} | {(e, "decode", n) for e in engines for n in decode}
    assert keys == want
    for r in res["rows"]:
        assert set(r) >= {"engine", "phase", "tokens", "tok_s"}
        assert r["phase"] in ("prefill", "decode")
        assert r["tok_s"] > 0 and len(r["repeats_tok_s"]) == s["repeats"]


def test_run_bench_writes_json(ckpt, tmp_path):
    import lily
    model = lily.load(ckpt, backend=_backend(), max_context=256)
    res = run_bench(model, [8, 16], [8], repeats=2, decode_steps=2, note="test", out=tmp_path / "b",
                    log=lambda s: None)
    engine = f"lily-{model.backend}"
    _check_schema(res, [engine], [8, 16], [8])
    on_disk = json.loads((tmp_path / "b.json").read_text())
    _check_schema(on_disk, [engine], [8, 16], [8])
    assert on_disk["settings"]["note"] == "test" and on_disk["ratios"] == []
    table = format_table(res)
    assert table.splitlines()[0].split() == ["phase", "tokens", engine] and len(table.splitlines()) == 7
    # the synthetic checkpoint has no MTP head: said once, in the table and the JSON
    assert table.count("speculative") == 1 and table.splitlines()[-1] == "speculative: no MTP head"
    assert on_disk["speculative"] == {"available": False, "reason": "no MTP head"}


def test_plot_without_matplotlib_is_a_note(ckpt, tmp_path, monkeypatch, capsys):
    res = {"rows": [{"engine": "a", "phase": "prefill", "tokens": 8, "tok_s": 1.0}],
           "settings": {"engines": ["a"], "backend": "cpu", "repeats": 1, "model": None}, "hardware": {}}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plot(res, tmp_path / "x.png") is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_bench(ckpt, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["bench", "--model", ckpt, "--backend", _backend(), "--max-context", "128", "--prefill", "8",
                 "--decode", "8", "--repeats", "1", "--decode-steps", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["phase", "tokens"]
    _check_schema(json.loads(out.with_suffix(".json").read_text()), [f"lily-{_backend()}"], [8], [8])


@pytest.fixture(scope="module")
def drafting_ckpt(tmp_path_factory):
    pytest.importorskip("lily._lily")
    from test_cli_speculative import write_drafting_checkpoint
    return str(write_drafting_checkpoint(tmp_path_factory.mktemp("bench_drafting")))


def test_speculative_rows_beside_plain(drafting_ckpt, tmp_path, capsys):
    """With an MTP head: plain, speculative k=K and auto decode the same prompt greedily to the same tokens, side by
    side in the table and the JSON, with tok/verify and acceptance."""
    out = tmp_path / "spec"
    assert main(["bench", "--model", drafting_ckpt, "--backend", "cpu", "--threads", "2", "--max-context", "512",
                 "--prefill", "8", "--decode", "8", "--repeats", "1", "--decode-steps", "2", "--speculative", "1,4",
                 "--speculative-tokens", "32", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    spec = json.loads(out.with_suffix(".json").read_text())["speculative"]
    assert spec["available"] and spec["max_tokens"] == 32 and spec["prompt_tokens"] > 0
    assert [r["mode"] for r in spec["rows"]] == ["plain", "speculative k=1", "speculative k=4", "auto (k=1)"]
    plain, *drafted = spec["rows"]
    assert plain["speculative"] is False and plain["drafted_tokens"] == 0 and plain["speedup"] == 1.0
    for r in spec["rows"]:
        assert r["same_tokens"] and r["generated_tokens"] == plain["generated_tokens"] and r["decode_tok_s"] > 0
    for r in drafted[:2]:
        assert r["accepted_tokens"] > 0 and 1 < r["tokens_per_verify"] <= r["speculative"] + 1
        assert r["status"] == f"speculative k={r['speculative']}" and 0 < r["acceptance"] <= 1
    lines = table[table.index("decode mode"):].splitlines()
    assert lines[0].split() == ["decode", "mode", "tok/s", "speedup", "tok/verify", "accepted", "same"]
    assert lines[1].split()[0] == "plain" and lines[2].startswith("speculative k=1")
    assert "no MTP head" not in table


def test_speculative_flag(ckpt, drafting_ckpt, tmp_path, capsys):
    base = ["bench", "--backend", _backend(), "--max-context", "128", "--prefill", "8", "--decode", "8",
            "--repeats", "1", "--decode-steps", "2", "--out", str(tmp_path / "x")]
    with pytest.raises(SystemExit, match="--speculative wants auto, off or drafted tokens per step 1..8"):
        main(base + ["--model", ckpt, "--speculative", "9"])
    assert main(base + ["--model", drafting_ckpt, "--speculative", "off"]) == 0
    assert "speculative" not in json.loads((tmp_path / "x.json").read_text())
    assert "speculative" not in capsys.readouterr().out
    # the speculative runs need room for their prompt and reply
    assert main(base + ["--model", drafting_ckpt, "--speculative-tokens", "512"]) == 1
    assert "max_context" in capsys.readouterr().err


def test_context_too_small_is_an_error(ckpt, capsys):
    assert main(["bench", "--model", ckpt, "--backend", _backend(), "--max-context", "32", "--prefill", "8",
                 "--decode", "64", "--repeats", "1", "--out", "/nonexistent/never-written"]) == 1
    assert "max_context" in capsys.readouterr().err


def test_mlx_lm_peer_rows_and_ratio(ckpt, tmp_path):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import lily
    model = lily.load(ckpt, backend=_backend(), max_context=128)
    res = run_bench(model, [8], [8], repeats=2, peer="mlx-lm", decode_steps=2, log=lambda s: None)
    _check_schema(res, [f"lily-{model.backend}", "mlx-lm"], [8], [8])
    assert {(r["phase"], r["tokens"]) for r in res["ratios"]} == {("prefill", 8), ("decode", 8)}
    assert all(r["ratio"] > 0 for r in res["ratios"])
    assert "ratio" in format_table(res).splitlines()[0]
