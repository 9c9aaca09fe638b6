"""The OPT tokenizer (vocab.json + merges.txt, no tokenizer.json) reproduces HF's ids offline;
streaming text equals the full decode; its chat format is the project's fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastserve.chat_template import ChatTemplateError, apply_chat_template
from fastserve.detokenizer import IncrementalDecoder
from fastserve.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer, TokenizerLoadError

VECTORS_FILE = DEFAULT_TOKENIZER_DIR.parent / "tokenizer_test_vectors.json"
OPT_VOCAB_SIZE = 50265
MODEL_EMBEDDING_ROWS = 50272
BOS = EOS = 2
PAD = 1

# Texts whose characters span several byte-level tokens (emoji, CJK, combining marks, ZWJ).
MULTIBYTE_TEXTS = [
    "Numbers 12345 and emoji 😀",
    "中文字符和日本語のテキスト",
    "family: 👨‍👩‍👧‍👦 flag: 🇯🇵 heart: ❤️",
    "naïve café — “quotes” … ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "한국어 텍스트 and Ελληνικά",
]


def _load_opt_vectors() -> list[dict[str, Any]]:
    data = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
    # GPT-2 vectors use GPT-2 ids; the GPT-2 vocabulary is not shipped, so only OPT is checked.
    return [v for v in data["vectors"] if v["tokenizer"] == "opt"]


OPT_VECTORS = _load_opt_vectors()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = IncrementalDecoder(tok, [BOS], skip_special_tokens=skip_special_tokens)
    deltas = [decoder.step(i) for i in ids]
    deltas.append(decoder.flush())
    assert decoder.text == "".join(deltas)
    return deltas


def test_vectors_file_has_opt_vectors() -> None:
    assert len(OPT_VECTORS) >= 5


@pytest.mark.parametrize("vector", OPT_VECTORS, ids=lambda v: v["text"][:24])
def test_opt_vector_encode(tok: Tokenizer, vector: dict[str, Any]) -> None:
    assert tok.encode(vector["text"], add_special_tokens=False) == vector["ids"]
    expected_with_bos = vector.get("ids_hf_with_bos", [BOS, *vector["ids"]])
    assert tok.encode(vector["text"]) == expected_with_bos


@pytest.mark.parametrize("vector", OPT_VECTORS, ids=lambda v: v["text"][:24])
def test_opt_vector_decode(tok: Tokenizer, vector: dict[str, Any]) -> None:
    assert tok.decode(vector["ids"]) == vector["text"]
    assert "".join(_stream(tok, vector["ids"])) == vector["text"]


def test_special_ids_and_sizes(tok: Tokenizer) -> None:
    assert tok.bos_token_id == BOS
    assert tok.eos_token_id == EOS
    assert tok.pad_token_id == PAD
    assert tok.vocab_size == OPT_VOCAB_SIZE == len(tok)
    assert tok.special_token_ids == frozenset({BOS, PAD})
    assert tok.id_to_token(0) == "<s>"
    assert tok.id_to_token(50260) == "<|endoftext|>"
    assert tok.id_to_token(50264) == "<mask>"
    assert tok.id_to_token(5) == "Ġthe"


def test_default_is_cached_and_from_dir_matches(tok: Tokenizer) -> None:
    assert Tokenizer.default() is tok
    other = Tokenizer.from_dir(str(DEFAULT_TOKENIZER_DIR))
    text = "The quick brown fox"
    assert other.encode(text) == tok.encode(text)


def test_from_dir_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=f"{tmp_path}: no tokenizer.json, and no "
                                                 "vocab.json \\+ merges.txt"):
        Tokenizer.from_dir(tmp_path)


def test_add_prefix_space_is_false(tok: Tokenizer) -> None:
    assert tok.encode("Hello", add_special_tokens=False) != tok.encode(" Hello", add_special_tokens=False)
    assert tok.encode(" leading space", add_special_tokens=False) == [981, 980]


def test_eos_text_is_special_like_hf(tok: Tokenizer) -> None:
    # HF splits registered special tokens out of the text before BPE.
    ids = tok.encode("a</s>b", add_special_tokens=False)
    assert ids == [tok.encode("a", add_special_tokens=False)[0], EOS, tok.encode("b", add_special_tokens=False)[0]]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a</s>b"


def test_decode_skips_specials_and_unknown_ids(tok: Tokenizer) -> None:
    body = tok.encode("hello there", add_special_tokens=False)
    ids = [BOS, *body, EOS, PAD, MODEL_EMBEDDING_ROWS - 1]
    assert tok.decode(ids) == "hello there"
    assert tok.decode(ids, skip_special_tokens=False) == "</s>hello there</s><pad>"
    assert "".join(_stream(tok, ids)) == "hello there"
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == "</s>hello there</s><pad>"


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "plain ascii.",
        "Line1\nLine2\n\n  indented\ttab",
        "<|endoftext|> <s> <mask>",
        *MULTIBYTE_TEXTS,
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = ["one", "two words", *MULTIBYTE_TEXTS]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts, add_special_tokens=False) == [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_holds_back_split_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stream_emoji_split_across_tokens(tok: Tokenizer) -> None:
    # The 4 bytes of U+1F600 are spread over two tokens (" \xf0\x9f", "\x98\x80"): DecodeStream
    # holds the first token whole until the character completes.
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2
    decoder = IncrementalDecoder(tok, [BOS])
    assert decoder.step(ids[0]) == ""
    assert decoder.has_pending_bytes
    assert decoder.step(ids[1]) == " 😀"
    assert not decoder.has_pending_bytes
    assert decoder.flush() == ""


def test_stream_truncated_character_flushes_replacement(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀", add_special_tokens=False)[:1]
    deltas = _stream(tok, ids)
    assert deltas == ["", " \ufffd"]
    assert "".join(deltas) == tok.decode(ids)


def test_extend_matches_steps(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXTS[2], add_special_tokens=False)
    decoder = IncrementalDecoder(tok, [])
    assert decoder.extend(ids) + decoder.flush() == MULTIBYTE_TEXTS[2]
    assert decoder.output_ids == ids


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=MODEL_EMBEDDING_ROWS - 1), max_size=40))
def test_stream_equals_decode_for_any_ids(ids: list[int]) -> None:
    # Arbitrary ids produce invalid UTF-8; replacement characters must match the Rust decoder's.
    tok = Tokenizer.default()
    for skip in (True, False):
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(text: str) -> None:
    tok = Tokenizer.default()
    ids = tok.encode(text, add_special_tokens=False)
    # Text containing "</s>"/"<pad>" is tokenized as specials, which decode() skips by default.
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == text


def test_chat_template_exact() -> None:
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Bye\n"},
    ]
    assert apply_chat_template(messages) == (
        "System: You are terse.\nUser: Hi there\nAssistant: Hello!\nUser: Bye\nAssistant:"
    )


def test_chat_template_minimal_and_empty() -> None:
    assert apply_chat_template([{"role": "user", "content": "Hi"}]) == "User: Hi\nAssistant:"
    assert apply_chat_template([]) == "Assistant:"
    assert apply_chat_template([{"role": "system", "content": ""}]) == "System:\nAssistant:"


@pytest.mark.parametrize(
    "message",
    [{"role": "tool", "content": "x"}, {"content": "x"}, {"role": "user"}],
)
def test_chat_template_rejects_bad_messages(message: dict[str, str]) -> None:
    with pytest.raises(ChatTemplateError, match="message 0: "):
        apply_chat_template([message])


def test_opt_ships_no_template_so_chat_uses_the_fallback_with_bos(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.encode_chat(messages) == tok.encode("User: Hi\nAssistant:") == \
        [BOS, *tok.encode("User: Hi\nAssistant:", add_special_tokens=False)]
