"""Model folders' own tokenizers (tokenizer.json): ids and text equal transformers' AutoTokenizer,
chat prompts equal its apply_chat_template, streaming equals the full decode, bad folders are
refused naming the path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fastserve.chat_template import OPT_FALLBACK, ChatOptions, ChatTemplate, ChatTemplateError
from fastserve.config_model import ModelArgs
from fastserve.detokenizer import IncrementalDecoder
from fastserve.tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer
from tests.harness.tokenizers import (
    LLAMA3_BOS,
    LLAMA3_EOT,
    LLAMA3_STYLE,
    hf_chat_ids,
    hf_tokenizer,
    require_smollm2,
)

SMOL_IM_START, SMOL_IM_END, SMOL_ENDOFTEXT = 1, 2, 0
TEXTS = [
    "Hello world",
    "The capital of France is",
    " leading space and trailing ",
    "Line1\nLine2\n\n\tindented",
    "<|im_start|>user\nHi<|im_end|>",
    "special <|endoftext|> in the middle",
    "emoji 😀👨‍👩‍👧 and flags 🇯🇵",
    "中文字符和日本語のテキスト",
    "naïve café — “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
#: Texts whose characters span several tokens (streaming must hold the pieces back).
MULTIBYTE = TEXTS[6:]
SYSTEM_AND_THREE_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 🇯🇵"},
]
NO_SYSTEM = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_dir(require_smollm2())


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    return Tokenizer.from_dir(LLAMA3_STYLE)


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    decoder = IncrementalDecoder(tok, [], skip_special_tokens=skip)
    deltas = [decoder.step(i) for i in ids]
    deltas.append(decoder.flush())
    assert decoder.text == "".join(deltas)
    return deltas


# ---- SmolLM2 (the real folder) -------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_and_decode_equal_transformers(smol: Tokenizer, text: str) -> None:
    hf = hf_tokenizer(smol.directory)
    ids = smol.encode(text)
    assert ids == hf(text)["input_ids"]
    assert smol.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert smol.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_smollm2_special_tokens_and_no_bos_on_completions(smol: Tokenizer) -> None:
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (SMOL_IM_START, SMOL_IM_END, SMOL_IM_END)
    assert smol.encode("Hi") == [26843]   # SmolLM2's post-processor adds nothing
    assert smol.encode("<|im_end|>") == [SMOL_IM_END]
    assert {SMOL_ENDOFTEXT, SMOL_IM_START, SMOL_IM_END} <= smol.special_token_ids
    assert smol.vocab_size == hf_tokenizer(smol.directory).vocab_size == SMOL_VOCAB


def test_smollm2_chat_template_equals_transformers_with_system_and_three_turns(smol: Tokenizer) -> None:
    ids = smol.encode_chat(SYSTEM_AND_THREE_TURNS)
    assert ids == hf_chat_ids(smol.directory, SYSTEM_AND_THREE_TURNS)
    assert smol.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Japan? 🇯🇵<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert ids.count(SMOL_IM_START) == 5   # the template's own specials, none added again


def test_smollm2_template_injects_its_default_system_prompt(smol: Tokenizer) -> None:
    ids = smol.encode_chat(NO_SYSTEM)
    assert ids == hf_chat_ids(smol.directory, NO_SYSTEM)
    assert smol.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


PARTIAL_ANSWER = [*NO_SYSTEM, {"role": "assistant", "content": "The capital of France is"}]


def test_smollm2_continue_final_message_equals_transformers(smol: Tokenizer) -> None:
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    ids = smol.encode_chat(PARTIAL_ANSWER, options)
    assert ids == hf_chat_ids(smol.directory, PARTIAL_ANSWER, add_generation_prompt=False,
                              continue_final_message=True)
    assert smol.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nThe capital of France is")    # no <|im_end|>: the model goes on


def test_smollm2_without_the_generation_prompt_equals_transformers(smol: Tokenizer) -> None:
    ids = smol.encode_chat(NO_SYSTEM, ChatOptions(add_generation_prompt=False))
    assert ids == hf_chat_ids(smol.directory, NO_SYSTEM, add_generation_prompt=False)
    assert smol.decode(ids, skip_special_tokens=False).endswith("France?<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_the_servers() -> None:
    template = ChatTemplate("{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}", {"bos_token": "<s>"})
    assert template.render(NO_SYSTEM[:1], ChatOptions(template_kwargs={"greeting": "Hey: "})) == \
        "Hey: What is the capital of France?"
    assert template.render(NO_SYSTEM[:1]) == "What is the capital of France?"   # unread: as without it
    for key in ("messages", "add_generation_prompt", "bos_token"):
        with pytest.raises(ChatTemplateError, match=f"chat_template_kwargs may not set '{key}'") as info:
            template.render(NO_SYSTEM, ChatOptions(template_kwargs={key: "x"}))
        assert info.value.param == "chat_template_kwargs"


def test_continue_final_message_refusals() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template.render(PARTIAL_ANSWER, ChatOptions(continue_final_message=True))
    cont = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not write the final message's text"):
        template.render(PARTIAL_ANSWER, cont)
    with pytest.raises(ChatTemplateError, match="needs a final message with text"):
        template.render([*NO_SYSTEM, {"role": "assistant", "content": "  "}], cont)


def test_add_special_tokens_puts_the_tokenizers_bos_before_the_templates(llama3: Tokenizer) -> None:
    plain = llama3.encode_chat(NO_SYSTEM)
    assert plain[0] == LLAMA3_BOS   # the template wrote it
    assert llama3.encode_chat(NO_SYSTEM, ChatOptions(add_special_tokens=True)) == [LLAMA3_BOS, *plain]


def test_the_fallback_format_honours_both_options() -> None:
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    assert OPT_FALLBACK.render(chat[:1], ChatOptions(add_generation_prompt=False)) == "User: Hi"
    assert OPT_FALLBACK.render(chat, ChatOptions(add_generation_prompt=False, continue_final_message=True)) == \
        "User: Hi\nAssistant: Sure,"


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("skip", [True, False])
def test_smollm2_stream_equals_decode_through_multibyte_characters(smol: Tokenizer, text: str,
                                                                   skip: bool) -> None:
    ids = smol.encode(f"<|im_start|>{text}<|im_end|>")
    deltas = _stream(smol, ids, skip)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)


def test_smollm2_emoji_split_over_tokens_is_held_back(smol: Tokenizer) -> None:
    ids = smol.encode(" 😀")
    assert ids == [40303, 218]   # " \xf0\x9f", "\x98\x80"
    decoder = IncrementalDecoder(smol, [])
    assert decoder.step(ids[0]) == ""
    assert decoder.has_pending_bytes
    assert decoder.step(ids[1]) == " 😀"
    assert not decoder.has_pending_bytes
    assert decoder.flush() == ""


SMOL_VOCAB = 49152


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=SMOL_VOCAB - 1), max_size=30))
def test_smollm2_stream_equals_decode_for_any_ids(ids: list[int]) -> None:
    # Arbitrary ids: specials anywhere, invalid UTF-8 that the full decode renders as U+FFFD.
    tok = load_tokenizer(require_smollm2())
    for skip in (True, False):
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


# ---- a second template: the Llama-3-style fixture ------------------------------------------

def test_llama3_style_adds_bos_to_completions_as_transformers(llama3: Tokenizer) -> None:
    hf = hf_tokenizer(LLAMA3_STYLE)
    for text in TEXTS:
        assert llama3.encode(text) == hf(text)["input_ids"]
        assert llama3.encode(text)[0] == LLAMA3_BOS
        assert llama3.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("messages", [SYSTEM_AND_THREE_TURNS, NO_SYSTEM])
def test_llama3_style_chat_template_equals_transformers(llama3: Tokenizer,
                                                        messages: list[dict[str, str]]) -> None:
    ids = llama3.encode_chat(messages)
    assert ids == hf_chat_ids(LLAMA3_STYLE, messages)
    assert ids.count(LLAMA3_BOS) == 1 and ids[0] == LLAMA3_BOS   # written by the template, once
    assert ids.count(LLAMA3_EOT) == len(messages)


def test_llama3_style_chat_text(llama3: Tokenizer) -> None:
    assert llama3.chat_template.render(SYSTEM_AND_THREE_TURNS[:2]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_template_that_raises_is_a_chat_template_error_naming_the_reason(llama3: Tokenizer) -> None:
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate, but messages 0 and 1 "
                                                "are both user"):
        llama3.encode_chat(twice)


# ---- folders that cannot be served ---------------------------------------------------------

def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(LLAMA3_STYLE, folder)
    return folder


def test_corrupt_tokenizer_json_is_refused_naming_the_path(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(TokenizerLoadError, match=f"cannot load the tokenizer at {folder}: Exception: "):
        Tokenizer.from_dir(folder)


def test_a_chat_template_that_does_not_compile_is_refused(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(TokenizerLoadError, match=f"at {folder}: chat template does not compile: .*endfor"):
        Tokenizer.from_dir(folder)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(folder).chat_template.render(NO_SYSTEM) == "What is the capital of France?!"


def test_config_bos_eos_flags_are_ignored_beside_a_tokenizer_json_as_in_transformers(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False,
                                                             "add_eos_token": True}))
    tok = Tokenizer.from_dir(folder)
    assert tok.encode("Hello") == hf_tokenizer(folder)("Hello")["input_ids"]
    assert tok.encode("Hello") == [LLAMA3_BOS, *tok.encode("Hello", add_special_tokens=False)]


def test_config_validation_refuses_an_unloadable_tokenizer(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValidationError, match=f"cannot load the tokenizer at {folder}: no tokenizer.json"):
        ModelArgs(name="m", config_path="config/models", tokenizer_path=str(folder))

