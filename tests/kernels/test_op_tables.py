"""Every backend's op table implements op_list.OPS as declared there: each entry point under its name, its operands
under their names and in their order (the one place they are declared; a table may add schedule knobs with
defaults after them), and each op's reference twin exists."""
from __future__ import annotations

import importlib
import inspect

import pytest
from op_list import OPS


def _table(name: str):
    if name == "cpu":
        pytest.importorskip("lily._lily")
    return importlib.import_module(f"ops_{name}")  # the CUDA table imports without a device (its calls need one)


def _operands(fn, declared: int) -> tuple[str, ...]:
    """fn's parameters in order (a **keywords parameter under its own name); those after the first `declared` must
    have defaults (a table's own schedule knobs, as ops_metal.rms_norm's thread count, left at the engine's choice by
    the family tests) and are not returned."""
    params = list(inspect.signature(fn).parameters.values())
    extra = params[declared:]
    assert all(p.default is not inspect.Parameter.empty for p in extra), f"{fn.__name__}: {extra} have no default"
    return tuple(p.name for p in params[:declared])


@pytest.mark.parametrize("table", ["cpu", "metal", "cuda"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_table_implements_the_declared_op(table, op):
    fn = getattr(_table(table), op.name, None)
    assert callable(fn), f"ops_{table}.py has no {op.name}: op_list declares it for every backend"
    got = _operands(fn, len(op.operands))
    assert got == op.operand_names, f"ops_{table}.{op.name}{got} differs from op_list's operands {op.operand_names}"


@pytest.mark.parametrize("op", [op for op in OPS if op.reference.startswith("lily.")], ids=lambda op: op.name)
def test_reference_twin_exists(op):
    module, _, attr = op.reference.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr, None)), f"{op.reference} is not a function"
