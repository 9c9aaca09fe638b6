"""Tokenizer folders the tests read, and transformers' tokenizer as the reference for them.

* ``SMOLLM2``: the demo's real model folder (``make model`` writes it); tests that need it skip
  when it has not been converted on this machine.
* ``LLAMA3_STYLE``: ``tests/fixtures/tokenizers/llama3-style``, a few-KB tokenizer.json shaped
  like Llama-3's (BOS-adding post-processor, header/eot specials) with a Llama-3-style chat
  template that refuses non-alternating roles, and a generation_config.json naming two EOS ids.
* ``hf_tokenizer``: ``transformers.AutoTokenizer.from_pretrained(folder)``, offline, once per
  folder (it imports torch; only tests use it).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from fastserve.model_folder import DEFAULT_FOLDER, is_complete

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"
LLAMA3_STYLE = FIXTURES / "llama3-style"
SMOLLM2 = DEFAULT_FOLDER
#: The fixture's ids: generation_config.json says eos_token_id [1, 4] (end_of_text, eot_id).
LLAMA3_BOS, LLAMA3_END_OF_TEXT, LLAMA3_EOT = 0, 1, 4


def require_smollm2() -> Path:
    if not is_complete(SMOLLM2):
        pytest.skip(f"{SMOLLM2} is not converted (make model)")
    return SMOLLM2


@lru_cache(maxsize=4)
def hf_tokenizer(folder: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def hf_chat_ids(folder: Path, messages: list[dict[str, str]], **options: Any) -> list[int]:
    """transformers' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``,
    ``options`` (``continue_final_message``, template variables ...) overriding."""
    options = {"add_generation_prompt": True, **options}
    out = hf_tokenizer(folder).apply_chat_template(messages, tokenize=True, **options)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]
