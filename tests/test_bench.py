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
    assert table.splitlines()[0].split() == ["phase", "tokens", engine] and len(table.splitlines()) == 5


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
