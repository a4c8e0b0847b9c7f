"""tests/requirements.txt (what the README's test command installs) and pyproject.toml's `test` extra list
the same packages, so `pip install ".[test]"` and `pip install -r tests/requirements.txt` cannot drift apart."""
from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normalise(req: str) -> str:
    return "".join(req.split()).replace('"', "'").lower()


def requirements_file() -> list[str]:
    lines = open(os.path.join(ROOT, "tests", "requirements.txt")).read().splitlines()
    return [_normalise(ln.split(" #")[0]) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_requirements_file_matches_test_extra():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = [_normalise(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["test"]]
    listed = requirements_file()
    assert sorted(listed) == sorted(extra), (
        f"only in tests/requirements.txt: {sorted(set(listed) - set(extra))}; "
        f"only in pyproject's test extra: {sorted(set(extra) - set(listed))}")


def test_requirements_file_does_not_install_lily_itself():
    # installing the package from a requirements line would rebuild the C++ extension
    assert not any(r.startswith((".", "lily", "-e")) for r in requirements_file())
