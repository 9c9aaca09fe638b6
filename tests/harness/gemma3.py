"""The second real model in tests: Gemma 3 270M (``make model`` converts it), its parity prompts.

Three chat prompts (one with a system prompt, which Gemma's template folds into the first user
turn; a multi-turn conversation), a completion, and a completion longer than the model's
512-token sliding window, so the local layers' window cuts its context in prefill and decode.
Ids come from ``transformers.AutoTokenizer`` on the folder (chat: the folder's template with the
generation prompt). The folder is the pretrained model (not instruction-tuned): its chat answers
run to the token limit rather than to ``<end_of_turn>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from fastserve.model_folder import GEMMA3_FOLDER, is_complete
from fastserve.worker.model.config import as_model_config
from fastserve.worker.model.gemma3_config import Gemma3Config
from tests.harness.hf_reference import hf_prompt_ids

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate. Answer every question in pirate speak."},
     {"role": "user", "content": "How do I boil an egg?"}],
    [{"role": "user", "content": "Give me three names for a cat."},
     {"role": "assistant", "content": "Whiskers, Luna and Oliver."},
     {"role": "user", "content": "Now three for a dog."}],
]
#: The last is longer than the 512-token window (checked by the test that uses it).
COMPLETIONS = ["The history of the Roman Empire began",
               "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(1, 61))]
MAX_NEW_TOKENS = 16
#: <end_of_turn>: what the template ends a turn with; both sides stop on it.
END_OF_TURN = 106
#: HF's top two logits closer than this are a tie in fp32: either token is a right answer.
TIE_GAP = 1e-4


def require_gemma3() -> Path:
    if not is_complete(GEMMA3_FOLDER):
        pytest.skip(f"{GEMMA3_FOLDER} is not converted (make model, or "
                    "python -m fastserve.model_folder --model gemma3)")
    return GEMMA3_FOLDER


def gemma3_config(folder: Path) -> Gemma3Config:
    config = as_model_config(folder)
    assert isinstance(config, Gemma3Config), type(config)
    return config


def prompt_ids(folder: Path) -> list[list[int]]:
    """The chat prompts' then the completion prompts' token ids (jobs ``"0"``..``"4"``)."""
    return hf_prompt_ids(folder, CHATS, COMPLETIONS)


def hf_model(folder: Path) -> transformers.PreTrainedModel:
    """transformers' ``Gemma3ForCausalLM`` on the folder, fp32."""
    return transformers.Gemma3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
