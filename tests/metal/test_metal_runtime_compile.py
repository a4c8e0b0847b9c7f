"""Issue 16 parts 1-2 on Linux: the Metal backend compiles its kernels at first use from the sources EMBEDDED
in the extension (csrc/metal/kernel_sources.h), the same entry point Apple's newLibraryWithSource path takes
(device_mtl.mm), here through the emulator's toolchain (tools/msl/mslc.py build-embedded); and a kernel that
fails to compile is a clear message, not a crash: backend="metal" raises BackendUnavailableError naming the
kernel file with the compiler's diagnostics, backend="auto" falls back to the CPU backend with that warning,
`lily info` shows the Metal status. The failure is a syntax error planted into one embedded text
(option inject_compile_error / LILY_METAL_INJECT_COMPILE_ERROR); auto considers the emulated device only with
the test switch lily.model.AUTO_EMULATED_METAL_ENV (docs/metal.md). Every Metal run happens in a forked child
(test_metal_backend._in_child), as in the other whole-model tests."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import test_metal_backend as t_be
from metal_env import ROOT, metal_files, mslc

import lily
from lily.model import AUTO_EMULATED_METAL_ENV, _engine_factory, metal_status
from lily.testing import random_weights, tiny_configs, write_synthetic_checkpoint

_lily = t_be._lily


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One kernel cache for the module (the first compile builds every file, later ones hit the cache)."""
    return str(tmp_path_factory.mktemp("metal_cache"))


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=5)
    return cfg, tensors, quant


def _no_line_markers(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.split("\n") if ln.strip() and not ln.lstrip().startswith("#line")]


def test_runtime_compile_uses_the_embedded_sources(cache):
    st = metal_status({"cache_dir": cache})
    assert "error" not in st, st.get("error")
    assert st["library"].startswith("embedded sources, compiled at run time"), st
    assert st["device"] == "emulated" and re.fullmatch(r"[0-9a-f]{16}", st["source_hash"])
    # what was compiled: one text per kernel file, headers inlined, written from the extension's copy ...
    compiled = {}
    for d in os.listdir(os.path.join(cache, "emu-src")):
        folder = os.path.join(cache, "emu-src", d)
        for f in os.listdir(folder) if os.path.isdir(folder) else []:
            if f.endswith(".metal"):
                compiled[f] = open(os.path.join(folder, f)).read()
    # ... equals the repository's files as this build saw them (a stale extension would differ here)
    for path in metal_files():
        name = os.path.basename(path)
        assert name in compiled, f"{name} was not compiled from the embedded sources"
        assert not re.search(r'#\s*include\s+"', compiled[name]), "an include was left for the disk to resolve"
        assert _no_line_markers(compiled[name]) == _no_line_markers(mslc.inline_includes(path)[0]), name
    again = metal_status({"cache_dir": cache})
    assert again["cache_hit"] == "1" and again["source_hash"] == st["source_hash"]


def test_compile_reads_nothing_from_the_source_tree(tmp_path, cache):
    """The toolchain copied to a tree without metal/ and csrc/: the embedded texts still compile."""
    tools = tmp_path / "tree" / "tools" / "msl"
    shutil.copytree(os.path.join(ROOT, "tools", "msl"), tools, ignore=shutil.ignore_patterns("__pycache__"))
    st = metal_status({"cache_dir": str(tmp_path / "cache"), "emu_toolchain": str(tools / "mslc.py")})
    assert "error" not in st, st.get("error")
    assert st["source_hash"] == metal_status({"cache_dir": cache})["source_hash"]


def test_runtime_compiled_backend_equals_cpu(tiny, cache):
    cfg, tensors, quant = tiny
    ids = np.arange(3, 40, 3, dtype=np.int32)

    def run():
        eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=64, backend="metal",
                           options={"emu_runtime_compile": "1", "cache_dir": cache, "kv_bf16": "0"})
        return np.asarray(eng.forward(eng.new_state(), ids, logits="all"))

    metal = t_be._in_child(run)
    cpu_eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=64)
    cpu = np.asarray(cpu_eng.forward(cpu_eng.new_state(), ids, logits="all"))
    assert float(np.sqrt(np.mean((metal - cpu) ** 2) / np.mean(cpu ** 2))) < 1e-5


def _planted(cache, kernel="gemv"):
    return {"emu_runtime_compile": "1", "cache_dir": cache, "inject_compile_error": kernel}


def _assert_names_kernel(msg: str, kernel: str):
    assert f"kernel file {kernel}.metal failed to compile" in msg, msg
    # the compiler's own diagnostic, pointing at the embedded file's line
    assert re.search(rf"metal/{kernel}\.metal:\d+:\d+: error: expected primary-expression", msg), msg


@pytest.mark.parametrize("kernel", ["gemv", "attention"])
def test_planted_compile_error_backend_metal_raises(tiny, cache, kernel):
    cfg, tensors, quant = tiny

    def run():
        factory, _ = _engine_factory("metal", _planted(cache, kernel))
        try:
            factory(cfg.to_dict(), tensors, quant, threads=1, max_context=64)
        except lily.BackendUnavailableError as e:
            return str(e)
        return "no error"

    _assert_names_kernel(t_be._in_child(run), kernel)


def test_planted_compile_error_backend_auto_falls_back(tiny, cache, monkeypatch):
    cfg, tensors, quant = tiny
    monkeypatch.setenv(AUTO_EMULATED_METAL_ENV, "1")

    def run():
        import warnings
        factory, _ = _engine_factory("auto", _planted(cache))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            eng = factory(cfg.to_dict(), tensors, quant, threads=1, max_context=64)
        return eng.backend, [(c.category.__name__, str(c.message)) for c in w]

    backend, caught = t_be._in_child(run)
    assert backend == "cpu"
    assert len(caught) == 1 and caught[0][0] == "RuntimeWarning", caught
    assert "Metal is unavailable, running on the CPU backend instead" in caught[0][1]
    _assert_names_kernel(caught[0][1], "gemv")


def test_auto_takes_the_emulated_device_only_with_the_switch(tmp_path, cache, monkeypatch):
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", "tiny", seed=3)
    monkeypatch.delenv(AUTO_EMULATED_METAL_ENV, raising=False)
    assert lily.load(folder, backend="auto", max_context=64).backend == "cpu"
    monkeypatch.setenv(AUTO_EMULATED_METAL_ENV, "1")
    assert t_be._in_child(lambda: lily.load(folder, backend="auto", max_context=64,
                                            backend_options={"cache_dir": cache}).backend) == "metal"


def test_bad_planted_file_and_prebuilt_conflict(cache):
    st = metal_status({"cache_dir": cache, "inject_compile_error": "nope"})
    assert "inject_compile_error='nope' names no embedded kernel file" in st["error"] and "gemv.metal" in st["error"]
    st = metal_status({"emu_kernel_libs": "x.so", "inject_compile_error": "gemv"})
    assert "need the runtime compile" in st["error"]


def _lily_info(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    r = subprocess.run([sys.executable, "-m", "lily", "info"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_lily_info_shows_metal_status(cache):
    out = _lily_info({AUTO_EMULATED_METAL_ENV: "1", "LILY_CACHE_DIR": os.path.dirname(cache) + "/info"})
    assert re.search(r"metal: emulated \(CPU emulator.*\); tensor ops: off", out), out
    assert "kernels: embedded sources, compiled at run time" in out, out
    out = _lily_info({AUTO_EMULATED_METAL_ENV: "1", "LILY_CACHE_DIR": os.path.dirname(cache) + "/info",
                      "LILY_METAL_INJECT_COMPILE_ERROR": "norm"})
    assert "metal: unavailable (backend='auto' runs on the CPU)" in out, out
    _assert_names_kernel(out, "norm")
    assert "backend: cpu" in out and "RuntimeWarning" in out, out  # the model fell back, with the warning
