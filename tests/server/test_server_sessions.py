"""Sessions on disk through the server: --session-dir keeps the prefix cache across a restart, so the next
turn after the restart prefills only its new tokens."""
from __future__ import annotations

from _live import LiveServer

from lily.session_file import SESSION_SUFFIX

KW = {"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 10}}}


def test_session_survives_a_restart(tiny_ckpt, tmp_path):
    sessions = tmp_path / "sessions"
    msgs = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Pick a city."}]
    srv = LiveServer(tiny_ckpt, tmp_path / "a.log", "--session-dir", str(sessions))
    try:
        r1 = srv.client().chat.completions.create(
            model="tiny", messages=msgs, max_tokens=80, temperature=0.8, seed=1, extra_body=KW,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        assert r1.choices[0].finish_reason == "stop"
    finally:
        assert srv.stop() == 0  # SIGINT: graceful shutdown writes the sessions
    files = list(sessions.glob("*" + SESSION_SUFFIX))
    assert files and (sessions / "replies.json").is_file()

    srv = LiveServer(tiny_ckpt, tmp_path / "b.log", "--session-dir", str(sessions))
    try:
        assert srv.health()["cache"]["snapshots"] >= 1
        msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                        {"role": "user", "content": "And another?"}]
        r2 = srv.client().chat.completions.create(model="tiny", messages=msgs2, max_tokens=3, temperature=0,
                                                  extra_body=KW)
        first = r1.usage.prompt_tokens + r1.usage.completion_tokens
        new = r2.usage.prompt_tokens - first
        assert r2.usage.prompt_tokens_details.cached_tokens == first  # turn 1 whole, with its <|im_end|>
        assert r2.model_extra["timings"]["prompt_n"] == new  # only the new user turn was prefilled
        # explicit save while running
        saved = srv.client().post("/sessions/save", cast_to=object, body={})
        assert saved["data"] and all(f.endswith(SESSION_SUFFIX) for f in saved["data"])
    finally:
        srv.stop()


def test_periodic_save_survives_a_kill(tiny_ckpt, tmp_path):
    """--save-interval: what ran before a kill -9 is on disk, and the restarted server reuses it."""
    import time
    sessions = tmp_path / "sessions"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    srv = LiveServer(tiny_ckpt, tmp_path / "a.log", "--session-dir", str(sessions), "--save-interval", "0.3")
    try:
        assert srv.health()["limits"]["save_interval_s"] == 0.3
        r1 = srv.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                  extra_body=KW)
        deadline = time.time() + 20
        while not list(sessions.glob("*" + SESSION_SUFFIX)) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # let a save in progress finish before the kill
    finally:
        srv.proc.kill()  # no graceful shutdown: only the periodic save can have written the files
        srv.proc.wait()
        srv.stop()
    assert list(sessions.glob("*" + SESSION_SUFFIX))
    srv = LiveServer(tiny_ckpt, tmp_path / "b.log", "--session-dir", str(sessions))
    try:
        msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                        {"role": "user", "content": "Another?"}]
        r2 = srv.client().chat.completions.create(model="tiny", messages=msgs2, max_tokens=2, temperature=0,
                                                  extra_body=KW)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    finally:
        srv.stop()


def test_session_from_another_model_is_refused(tiny_ckpt, tmp_path):
    """A session dir written by another model's weights is skipped (with a warning), not loaded."""
    from lily.testing import write_synthetic_checkpoint
    other = write_synthetic_checkpoint(tmp_path / "other", "tiny", seed=1)
    sessions = tmp_path / "sessions"
    srv = LiveServer(other, tmp_path / "a.log", "--session-dir", str(sessions))
    try:
        srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=3, extra_body=KW)
    finally:
        srv.stop()
    theirs = set(sessions.glob("*" + SESSION_SUFFIX))
    assert theirs
    srv = LiveServer(tiny_ckpt, tmp_path / "b.log", "--session-dir", str(sessions))
    try:
        assert srv.health()["cache"]["snapshots"] == 0
    finally:
        srv.stop()
    assert "saved from another model" in (tmp_path / "b.log").read_text()
    assert theirs <= set(sessions.glob("*" + SESSION_SUFFIX))  # the other model's files are left alone
