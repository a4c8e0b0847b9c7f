"""How to install and run `lily serve`, as the docs say it (issue 38 item 5): `pip install 'lily[server]'`
fetches an unrelated PyPI project, so no doc or message may tell users to run it; the server's packages are
lily's own dependencies (the README's `pip install .` gives a working `lily serve`), and a message names them
when one is missing from an environment."""
from __future__ import annotations

from pathlib import Path

import pytest

from lily.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_no_doc_installs_the_unrelated_pypi_project():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _code_blocks(doc.read_text()):
            assert "lily[server]" not in block, f"{doc.name}: {block}"
    server_md = (ROOT / "docs" / "server.md").read_text()
    assert "lily serve" in _code_blocks(server_md[server_md.index("## The server"):])[0]
    assert "dependencies of lily itself" in server_md and "extension" in server_md


def test_pip_install_dot_brings_the_servers_packages():
    """The README's first command is `pip install .`: the server's packages must be in the base dependencies."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower() for d in deps}
    assert {"fastapi", "uvicorn", "llguidance"} <= names, names


def test_the_missing_dependency_message_names_the_right_install(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_server(name, *args, **kw):
        if name.endswith("server.app"):  # `from .server.app import ...` in lily.cli
            raise ImportError("No module named 'fastapi'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_server)
    from lily.cli import main
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "pip install fastapi uvicorn llguidance" in err and "lily[server]" not in err


def test_serve_help_shows_the_new_limits_and_the_memory_budgets():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    text = " ".join(text.split())
    for flag in ("--park-gib", "--shutdown-grace", "--cors-origins", "--cache-gib"):
        assert flag in text, flag
    assert "free memory" in text and "full context" in text and "localhost" in text
