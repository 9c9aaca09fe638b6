"""The demo's real model in tests: SmolLM2-135M-Instruct's parity prompts and their ids.

Six chat prompts (one with a system prompt, a multi-turn conversation, a French one with an
emoji) and two completion prompts, tokenized by ``transformers.AutoTokenizer`` on the model folder
(chat: the folder's chat template with the generation prompt), so the tests that use them do not
depend on our tokenizer module. With ``MAX_NEW_TOKENS`` new tokens, jobs ``"0"``–``"3"`` stop at
EOS and ``"4"``–``"7"`` run to the limit (``EXPECTED_FINISH``); HF's top-2 logits are at least
2e-3 apart at every one of their tokens (measured; no fp32 ties).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from fastserve.worker.model.config import as_model_config
from fastserve.worker.model.llama_config import LlamaConfig
from tests.harness.hf_reference import hf_prompt_ids

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate. Answer every question in pirate speak."},
     {"role": "user", "content": "How do I boil an egg?"}],
    [{"role": "user", "content": "Give me three names for a cat."},
     {"role": "assistant", "content": "Whiskers, Luna and Oliver."},
     {"role": "user", "content": "Now three for a dog."}],
    [{"role": "user", "content": "Traduis en anglais : « Le chat dort sur le canapé. » 😺"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain in one sentence what a hash table is."}],
]
COMPLETIONS = ["The history of the Roman Empire began", "def fibonacci(n):\n    "]
MAX_NEW_TOKENS = 32
#: Pinned so that a change of model, template or tokenizer shows here first.
EXPECTED_FINISH = {"0": "stop", "1": "stop", "2": "stop", "3": "stop",
                   "4": "length", "5": "length", "6": "length", "7": "length"}
#: HF's top two logits closer than this are a tie in fp32: either token is a right answer.
TIE_GAP = 1e-4
PROFILE = Path(__file__).resolve().parents[2] / "config/profiles/smollm2-135m-instruct-cpu-tp1-pp1.json"


def smollm2_config(folder: Path) -> LlamaConfig:
    config = as_model_config(folder)
    assert isinstance(config, LlamaConfig), type(config)
    return config


def prompt_ids(folder: Path) -> list[list[int]]:
    """The chat prompts' then the completion prompts' token ids (jobs ``"0"``..``"7"``)."""
    return hf_prompt_ids(folder, CHATS, COMPLETIONS)


def hf_model(folder: Path) -> transformers.PreTrainedModel:
    """transformers' ``LlamaForCausalLM`` on the folder, fp32."""
    return transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
