"""Issue 45 against a live `lily serve --parallel 8` with the bundled model (default settings, speculative auto):
eight concurrent clients of mixed prompt and reply lengths, greedy and seeded, one with a grammar, are decoded
together and each gets exactly the text it gets alone; /health and /metrics report the batch."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from _http import httpx
from _live import NO_THINK, LiveServer

from lily.model import BUNDLED_MODEL_DIR
from lily.tokenizer import Tokenizer

_TOK = Tokenizer(BUNDLED_MODEL_DIR / "tokenizer.json")
NO_END = {str(i): -100 for i in {_TOK.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")} - {None}}


def _body(i: int) -> dict:
    sampled = i % 2 == 1
    return {"model": "tiny", "messages": [{"role": "user", "content": "word " * (1 + 5 * i) + f"story {i}"}],
            "max_tokens": 16 + 9 * i, "temperature": 0.9 if sampled else 0.0, "top_p": 0.95,
            **({"seed": 100 + i} if sampled else {}), "logit_bias": NO_END, **NO_THINK,
            # one request with a grammar: drawn on the host, it steps alone beside the batch
            **({"response_format": {"type": "json_object"}} if i == 6 else {})}


def _text(srv: LiveServer, body: dict) -> str:
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_eight_concurrent_clients_are_decoded_together_and_each_gets_its_solo_text(tmp_path):
    srv = LiveServer(None, tmp_path / "serve.log", "--parallel", "8", max_context=4096)
    try:
        bodies = [_body(i) for i in range(8)]
        solo = [_text(srv, b) for b in bodies]  # one at a time: nothing to decode together
        assert srv.health()["batch"]["batched_steps"] == 0
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda b: _text(srv, b), bodies))
        batch = srv.health()["batch"]
        metrics = httpx.get(srv.url + "/metrics", headers=srv.headers(), timeout=10).text
    finally:
        srv.stop()
    assert together == solo
    assert batch["width"] == 8 and batch["batched_steps"] > 20 and batch["mean_rows"] > 2, batch
    assert "lily_batched_steps_total" in metrics and "lily_decode_tokens_per_second" in metrics
