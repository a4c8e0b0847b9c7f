"""csrc/metal/metal.cmake configured on Linux with a fake `xcrun` (issue 16): without a Metal toolchain (the
Command Line Tools) the configure step succeeds, builds no metallib and embeds an empty one (the runtime
compile takes over); with a toolchain it builds lily.metallib; a diagnostic from the compiler is a warning, not
a failed install. enable_language / add_library / target_* are stubbed: only the toolchain logic runs here."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from metal_env import ROOT

if shutil.which("cmake") is None:
    pytest.skip("cmake not found", allow_module_level=True)

STUBS = """cmake_minimum_required(VERSION 3.18)
project(metal_cmake_check NONE)
foreach(cmd enable_language add_library target_include_directories target_compile_definitions
            target_compile_options target_link_libraries)
  cmake_language(EVAL CODE "function(${cmd})\\nendfunction()")
endforeach()
include(csrc/metal/metal_sources.cmake)
include(csrc/metal/metal.cmake)
"""

# mode none: no toolchain; ok: every compile writes its -o file; diag: gemv.metal fails with a diagnostic
XCRUN = """#!/bin/sh
[ "$LILY_FAKE_XCRUN" = none ] && { echo "xcrun: error: unable to find utility metal" >&2; exit 1; }
out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
case "$*" in *gemv.metal*) [ "$LILY_FAKE_XCRUN" = diag ] && { echo "gemv.metal:3:1: error: boom" >&2; exit 1; };; esac
echo air > "$out"
"""


def _configure(tmp_path, mode):
    src = tmp_path / "src"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(STUBS)
    for d in ("metal", "csrc"):
        os.symlink(os.path.join(ROOT, d), src / d)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "xcrun").write_text(XCRUN)
    (bin_dir / "xcrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LILY_FAKE_XCRUN": mode}
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "b")], capture_output=True, text=True, env=env)
    asm = tmp_path / "b" / "lily_metallib.s"
    return r.returncode, r.stdout + r.stderr, asm.read_text() if asm.exists() else ""


def test_no_toolchain_configures_and_embeds_nothing(tmp_path):
    rc, out, asm = _configure(tmp_path, "none")
    assert rc == 0, out
    assert "no Metal toolchain" in out and ".incbin" not in asm and ".quad 0" in asm, out + asm


def test_toolchain_builds_the_metallib(tmp_path):
    rc, out, asm = _configure(tmp_path, "ok")
    assert rc == 0, out
    assert "lily.metallib built" in out and ".incbin" in asm and "lily.metallib" in asm, out + asm


def test_compiler_diagnostic_is_a_warning_not_a_failure(tmp_path):
    rc, out, asm = _configure(tmp_path, "diag")
    assert rc == 0, out
    assert "could not compile gemv.metal" in out and "boom" in out and ".incbin" not in asm, out + asm
