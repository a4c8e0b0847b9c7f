"""Fixtures of the server tests: a live `lily serve` on 127.0.0.1 (a subprocess on a free port) over a tiny
synthetic checkpoint, and official `openai` clients for it. The tiny random model emits noise, so tests force
behaviour where they need it (grammars, forced tool choice, logit_bias, stop strings) and check protocol and
structure."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("llguidance")

from pathlib import Path  # noqa: E402

import openai  # noqa: E402
from _live import LiveServer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    from lily.testing import write_synthetic_checkpoint
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("tiny_server_ckpt"), "tiny")


@pytest.fixture(scope="session")
def server(tiny_ckpt, tmp_path_factory):
    srv = LiveServer(tiny_ckpt, tmp_path_factory.mktemp("serve") / "serve.log", "--progress-tokens", "64",
                     "--keepalive", "0.2", "--snapshot-interval", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tokenizer(tiny_ckpt):
    from lily.tokenizer import Tokenizer
    return Tokenizer(tiny_ckpt / "tokenizer.json")

