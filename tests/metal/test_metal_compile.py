"""Every metal/*.metal file passes the three static checks: signature lint, g++ against the MSL shim (as a
Metal 4 compiler with tensor types, and as a Metal 3.1 one), and clang in C++-for-OpenCL mode (address
spaces), plus an emulator build with a launcher per kernel."""
from __future__ import annotations

import os

import pytest
from metal_env import emu, metal_files, mslc

FILES = metal_files()


def test_there_are_kernel_files():
    assert len(FILES) >= 6


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_lint(path):
    errs = mslc.lint(mslc.inline_includes(path)[0], path)
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_gxx_shim_check(path):
    rc, out = mslc.check(path)
    assert rc == 0, out


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_gxx_shim_check_metal3(path):
    """csrc/metal/metal.cmake builds with -std=metal3.0 (the tensor-op file with metal4.0 where the SDK has
    it): every file must also compile for a Metal 3.1 compiler, tensor code behind __HAVE_TENSOR__."""
    rc, out = mslc.check(path, metal3=True)
    assert rc == 0, out


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_clang_address_space_check(path, have_clang):
    rc, out = mslc.check_as(path)
    assert rc == 0, out


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_emulator_build(path):
    lib = emu.library(path)
    assert lib.kernels
