"""A checkpoint with a NaN in its weights: the server stops the generation with a clear 500 (code
non_finite_logits) instead of streaming noise sampled from NaN logits, and the next request is still served."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
from _http import httpx
from _live import API_KEY, LiveServer

NAN_BYTES = {"BF16": struct.pack("<H", 0x7FC0), "F32": struct.pack("<f", float("nan"))}


def _poison_first_element(shard, suffix: str) -> bool:
    """Write a NaN into the first element of the tensor whose name ends with `suffix`, in place."""
    with open(shard, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name, info in header.items():
            if name.endswith(suffix) and info["dtype"] in NAN_BYTES:
                f.seek(8 + n + info["data_offsets"][0])
                f.write(NAN_BYTES[info["dtype"]])
                return True
    return False


@pytest.fixture(scope="module")
def nan_server(tiny_ckpt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan_ckpt")
    shutil.copytree(tiny_ckpt, folder, dirs_exist_ok=True)
    if not any(_poison_first_element(s, "model.norm.weight") for s in sorted(folder.glob("*.safetensors"))):
        pytest.fail("no final-norm weight found in the tiny checkpoint")
    srv = LiveServer(folder, tmp_path_factory.mktemp("nan_serve") / "serve.log", "--keepalive", "0.2")
    yield srv
    srv.stop()


def test_nan_weights_give_a_clear_error_not_noise(nan_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "The engine", "max_tokens": 8}
    with httpx.Client(base_url=nan_server.url, headers=headers, timeout=30) as c:
        for _ in range(2):  # the server stays usable after the first failure
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "non_finite_logits" and "non-finite logits" in err["message"]
        assert c.get("/health").status_code == 200
