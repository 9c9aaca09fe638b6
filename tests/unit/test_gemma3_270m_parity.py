"""Our engine on the second real model family, Gemma 3 270M, against ``transformers``.

Greedy tokens from our engine, all five prompts in one batch from their first iteration, equal
``Gemma3ForCausalLM.generate(do_sample=False)`` on the same fp32 folder, up to
``MAX_NEW_TOKENS`` or ``<end_of_turn>``: three chat prompts through the folder's Gemma template,
a completion, and a completion longer than the 512-token sliding window. HF runs each prompt
alone and keeps its top-2 logit gap per token, so a difference at an fp32 tie would be reported
as one. Skips, saying how to build it, where the folder has not been converted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastserve.engine.offline import load_app_args
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.model.gemma3_config import FULL, SLIDING, Gemma3Config
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.gemma3 import (
    END_OF_TURN,
    MAX_NEW_TOKENS,
    TIE_GAP,
    gemma3_config,
    hf_model,
    prompt_ids,
    require_gemma3,
)
from tests.harness.greedy import greedy_until_stop
from tests.harness.hf_reference import Reference, assert_same_tokens, hf_greedy_reference

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
#: Five jobs of at most 620 + 16 tokens: 40 blocks each at most.
NUM_DEVICE_BLOCKS = 128
NUM_HOST_BLOCKS = 16


@pytest.fixture(scope="module")
def folder() -> Path:
    return require_gemma3()


@pytest.fixture(scope="module")
def config(folder: Path) -> Gemma3Config:
    return gemma3_config(folder)


@pytest.fixture(scope="module")
def prompts(folder: Path) -> list[list[int]]:
    return prompt_ids(folder)


@pytest.fixture(scope="module")
def references(folder: Path, prompts: list[list[int]]) -> dict[str, Reference]:
    hf = hf_model(folder)
    return {str(i): hf_greedy_reference(hf, p, MAX_NEW_TOKENS, END_OF_TURN) for i, p in enumerate(prompts)}


@pytest.fixture(scope="module")
def executor(config: Gemma3Config, folder: Path) -> Iterator[InProcessExecutor]:
    ex = InProcessExecutor(ModelSpec(config, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE,
                                     load_format="auto", model_path=str(folder)))
    yield ex
    ex.close()


def test_model_config_is_gemma3_270m(config: Gemma3Config, prompts: list[list[int]]) -> None:
    c = config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.head_dim) == \
        (18, 640, 4, 1, 256)
    assert (c.vocab_size, c.sliding_window, c.query_pre_attn_scalar, c.local_rope_theta, c.global_rope_theta) == \
        (262144, 512, 256, 10000.0, 1000000.0)
    assert c.layer_types == ((SLIDING,) * 5 + (FULL,)) * 3
    assert len(prompts[-1]) > c.sliding_window   # the long prompt outgrows the window


def test_demo_config_serves_the_folder_and_stops_on_both_end_tokens(folder: Path) -> None:
    args = load_app_args(ROOT / "config" / "gemma3-demo.yaml")
    assert Path(args.model.config_path).resolve() == folder.resolve()
    assert args.model.eos_token_ids() == frozenset({1, END_OF_TURN})   # <eos>, <end_of_turn>


def test_reference_has_no_ties(references: dict[str, Reference]) -> None:
    assert {j: r.min_gap >= TIE_GAP for j, r in references.items()} == {j: True for j in references}


def test_greedy_batch_matches_generate(executor: InProcessExecutor, prompts: list[list[int]],
                                       references: dict[str, Reference]) -> None:
    tokens = greedy_until_stop(Driver(executor), prompts, MAX_NEW_TOKENS, END_OF_TURN)
    assert_same_tokens(tokens, references, TIE_GAP)
