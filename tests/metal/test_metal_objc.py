"""The Objective-C++ device layer (csrc/metal/device_mtl.mm) type-checks on Linux: clang in Objective-C++
mode with ARC against the project's stub headers of Foundation / Metal / libdispatch (tools/msl/hoststubs),
warnings as errors. A misspelt selector or a wrong argument type must fail the same check."""
from __future__ import annotations

import os
import subprocess

import pytest
from metal_env import ROOT, mslc

MM = os.path.join(ROOT, "csrc", "metal", "device_mtl.mm")
FLAGS = ["-x", "objective-c++", "-std=c++20", "-fobjc-arc", "-fobjc-runtime=macosx-13.0", "-fblocks",
         "-fsyntax-only", "-Werror", "-Wall", "-I", os.path.join(ROOT, "tools", "msl", "hoststubs"),
         "-I", os.path.join(ROOT, "csrc")]


def _check(path):
    r = subprocess.run([*mslc.CLANG, *FLAGS, path], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def test_device_mtl_type_checks(have_clang):
    rc, out = _check(MM)
    assert rc == 0, out


@pytest.mark.parametrize("old,new,msg", [
    ("setBuffer:r.buf->buf offset", "setBufer:r.buf->buf offset", "not found"),
    ("MTLSizeMake(g.x, g.y, g.z)", "g", "no viable conversion"),
    ("[cb_ commit];", "[cb_ commit:YES];", "selector"),
])
def test_planted_objc_errors_fail(have_clang, tmp_path, old, new, msg):
    src = open(MM).read()
    assert old in src
    p = tmp_path / "device_mtl.mm"
    p.write_text(src.replace(old, new, 1))
    rc, out = _check(str(p))
    assert rc != 0 and msg in out, out
