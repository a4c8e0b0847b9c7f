"""Tokenizer wrapper and the streaming detokenizer (byte-level pieces, UTF-8 split across tokens)."""
import pytest

from lily.errors import CheckpointError
from lily.tokenizer import Tokenizer, byte_decoder
from tiny_model_fixtures import write_tokenizer

TEXTS = [
    "Hello world! How are you?",
    "Café naïve résumé — déjà vu.",
    "中文测试：你好，世界！",
    "Emoji 🙂🚀🎉 mixed with ASCII and ∑∫√",
    "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    "never seen: ꙮ𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))


def test_byte_map_is_a_bijection():
    m = byte_decoder()
    assert len(m) == 256 and sorted(m.values()) == list(range(256))


def test_special_ids(tok):
    assert tok.im_end_id == tok.token_to_id("<|im_end|>") is not None
    assert tok.endoftext_id is not None and tok.im_start_id is not None
    assert tok.think_id is not None and tok.think_end_id is not None
    assert tok.stop_token_ids() == [tok.im_end_id, tok.endoftext_id]
    assert tok.im_end_id in tok.special_ids and tok.think_id not in tok.special_ids


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_and_special_tokens_parsed(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    if "<|im_start|>" in text:
        assert tok.im_start_id in ids and tok.im_end_id in ids


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_match_tokenizers_decode(tok, text):
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_partial_characters(tok, text):
    ids = tok.encode(text)
    # the test only means something if some character is split over tokens
    detok = tok.streaming_detokenizer(skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_across_tokens(tok):
    # a character the tiny vocab never merged is spelled as single byte tokens
    text = "☃"
    ids = tok.encode(text)
    assert len(ids) == 3  # E2 98 83
    detok = tok.streaming_detokenizer()
    assert [detok.add(i) for i in ids] == ["", "", "☃"]
    assert detok.flush() == ""


def test_skip_special_tokens_in_stream(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nA</think>B<|im_end|>")
    detok = tok.streaming_detokenizer(skip_special_tokens=True)
    out = detok.add_many(ids) + detok.flush()
    assert out == "assistant\n<think>\nA</think>B"  # <think> is an added, non-special token: kept


def test_incomplete_tail_is_flushed_as_replacement(tok):
    ids = tok.encode("☃")[:2]
    detok = tok.streaming_detokenizer()
    assert detok.add_many(ids) == ""
    assert detok.flush() == "\ufffd"


def test_window_fallback_for_non_byte_level(tok):
    # the generic re-decoding path gives the same text on a byte-level tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        tok.byte_level = False
        try:
            detok = tok.streaming_detokenizer(skip_special_tokens=False)
            deltas = [detok.add(i) for i in ids] + [detok.flush()]
        finally:
            tok.byte_level = True
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer(tmp_path / "tokenizer.json")
