"""Our engine on the demo's real model, SmolLM2-135M-Instruct, against ``transformers``.

Greedy tokens from our engine equal ``LlamaForCausalLM.generate(do_sample=False)`` on the same
fp32 folder for six chat prompts (one with a system prompt, a multi-turn conversation, a French
one with an emoji) and two completion prompts, up to ``MAX_NEW_TOKENS`` or EOS:

* (a) all eight in one batch from their first iteration, plans driven by hand;
* (b) the same with one job swapped to the host pool midway and back;
* (c) through the real scheduler and engine loop with chunked prefill, chunks small enough that
  every prompt is split — and the same loop unchunked: EOS ends a job with ``finish_reason``
  ``"stop"``, its EOS token delivered last and counted among its tokens (as vLLM counts
  ``completion_tokens``; the ingress counts every delivered token id);
* (d) tensor parallel over gloo, one process per rank, with the swap. TP 2 cannot split this
  model (9 query heads; vLLM refuses it too), and is refused naming the heads; TP 3 splits it
  evenly — 3 query heads and 1 of the 3 KV heads per rank — and gives HF's tokens.

Prompt ids (``tests/harness/smollm2.py``) come from ``transformers.AutoTokenizer`` on the folder,
so these tests do not depend on our tokenizer module. HF runs once per module (each prompt alone,
batch 1) and keeps its top-2 logit gap at every token: a difference where HF was tied in fp32 is
reported as a tie, and ``test_reference_has_no_ties`` keeps the prompts tie-free so every expectation is exact.
"""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import ChunkedPrefillConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.greedy import SwapMidway, greedy_until_stop
from tests.harness.hf_reference import Reference, assert_same_tokens, hf_greedy_reference
from tests.harness.smollm2 import (
    EXPECTED_FINISH,
    MAX_NEW_TOKENS,
    PROFILE,
    TIE_GAP,
    hf_model,
)
from tests.harness.tensor_parallel import RankPools, run_tensor_parallel

BLOCK_SIZE = 16
#: 8 jobs of at most 63 + 32 tokens take 6 blocks each; room left for a swap-in.
NUM_DEVICE_BLOCKS = 64
NUM_HOST_BLOCKS = 16
#: Smaller than the shortest prompt (7 tokens): every prompt is prefilled in two or more chunks.
CHUNK_TOKENS = 5
#: Job 5 (a 40-token prompt, 32 new tokens) leaves after 8 tokens, misses three steps, returns.
SWAP = SwapMidway("5", out_step=8, in_step=11)
ENGINE_TIMEOUT_S = 300
#: The smallest TP size that splits 9 query heads and 3 KV heads: (3, 1) heads per rank.
TP_SIZE = 3
EXPECTED_TP_HEADS = (3, 1)
#: The ranks each load the whole checkpoint file before their shard: generous.
TP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def references(smollm2_folder: Path, smollm2_prompts: list[list[int]],
               smollm2_llama: LlamaConfig) -> dict[str, Reference]:
    """HF's greedy tokens for every prompt, generated once for every variant."""
    hf = hf_model(smollm2_folder)
    return {str(i): hf_greedy_reference(hf, p, MAX_NEW_TOKENS, smollm2_llama.eos_token_id)
            for i, p in enumerate(smollm2_prompts)}


@pytest.fixture(scope="module")
def executor(smollm2_llama: LlamaConfig, smollm2_folder: Path) -> Iterator[InProcessExecutor]:
    """One model copy for every in-process variant (each starts from fresh block lists)."""
    ex = InProcessExecutor(ModelSpec(smollm2_llama, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE,
                                     load_format="auto", model_path=str(smollm2_folder)))
    yield ex
    ex.close()


def test_reference_has_no_ties(references: dict[str, Reference], smollm2_llama: LlamaConfig) -> None:
    assert {j: r.min_gap >= TIE_GAP for j, r in references.items()} == {j: True for j in references}
    finish = {j: "stop" if r.tokens[-1] == smollm2_llama.eos_token_id else "length" for j, r in references.items()}
    assert finish == EXPECTED_FINISH


def test_model_config_is_smollm2(smollm2_llama: LlamaConfig) -> None:
    c = smollm2_llama
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.eos_token_id) == \
        (49152, 100000.0, True, 2)


def test_greedy_batch_of_eight_matches_generate(executor: InProcessExecutor, smollm2_prompts: list[list[int]],
                                                references: dict[str, Reference], smollm2_llama: LlamaConfig) -> None:
    tokens = greedy_until_stop(Driver(executor), smollm2_prompts, MAX_NEW_TOKENS, smollm2_llama.eos_token_id)
    assert_same_tokens(tokens, references, TIE_GAP)


def test_greedy_matches_generate_through_a_swap_out_and_in(executor: InProcessExecutor,
                                                          smollm2_prompts: list[list[int]],
                                                          references: dict[str, Reference],
                                                          smollm2_llama: LlamaConfig) -> None:
    driver = Driver(executor)
    before = (executor.kv.swapped_out_blocks, executor.kv.swapped_in_blocks)
    tokens = greedy_until_stop(driver, smollm2_prompts, MAX_NEW_TOKENS, smollm2_llama.eos_token_id, SWAP)
    assert_same_tokens(tokens, references, TIE_GAP)
    assert driver.swaps == {"out": 1, "in": 1}
    moved = (executor.kv.swapped_out_blocks - before[0], executor.kv.swapped_in_blocks - before[1])
    assert moved == (3, 3)   # 40 prompt + 8 generated tokens = 48 = 3 blocks of 16


class _ChunkWatch:
    """The executor, counting each job's prefill chunks that do not sample (all but the last).
    It has no ``close``: the engine's shutdown leaves the shared model copy open."""

    def __init__(self, real: InProcessExecutor) -> None:
        self.real = real
        self.chunks: dict[str, int] = defaultdict(int)

    def execute(self, plan: BatchPlan) -> StepOutput:
        for e in plan.entries:
            if e.is_prefill and not e.samples:
                self.chunks[e.job_id] += 1
        return self.real.execute(plan)


async def _serve(ex: InProcessExecutor, prompts: list[list[int]], eos: int, chunk_tokens: int | None
                 ) -> tuple[dict[str, list[int]], dict[str, str | None], dict[str, int]]:
    """All prompts submitted at once to the engine loop and the default scheduler policy."""
    cfg = SchedulerConfig(max_batch_size=len(prompts),
                          chunked_prefill=ChunkedPrefillConfig(enabled=chunk_tokens is not None,
                                                               chunk_tokens=chunk_tokens or 1))
    kv = KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=NUM_DEVICE_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS)
    watch = _ChunkWatch(ex)
    engine = AsyncEngine(Scheduler(cfg, kv, Profile.load(PROFILE), frozenset({eos})), ThreadedExecutor(watch))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    async def consume(job_id: str, prompt: list[int]) -> None:
        stream = engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
                                    job_id=job_id)
        ids: list[int] = []
        async for delta in stream:
            ids += delta.token_ids
            if delta.finished:
                reasons[job_id] = delta.finish_reason
        tokens[job_id] = ids

    await engine.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(consume(str(i), p) for i, p in enumerate(prompts))),
                               timeout=ENGINE_TIMEOUT_S)
    finally:
        await engine.stop()
    return tokens, reasons, dict(watch.chunks)


@pytest.mark.parametrize("chunk_tokens", [None, CHUNK_TOKENS], ids=["whole-smollm2_prompts", "chunked-prefill"])
def test_engine_matches_generate_and_stops_at_eos(executor: InProcessExecutor, smollm2_prompts: list[list[int]],
                                                  references: dict[str, Reference], smollm2_llama: LlamaConfig,
                                                  chunk_tokens: int | None) -> None:
    tokens, reasons, chunks = asyncio.run(_serve(executor, smollm2_prompts, smollm2_llama.eos_token_id, chunk_tokens))
    assert_same_tokens(tokens, references, TIE_GAP)
    assert reasons == EXPECTED_FINISH
    # A job that stopped at EOS delivered it last, counted with its tokens (vLLM's completion_tokens).
    for j, reason in reasons.items():
        assert (tokens[j][-1] == smollm2_llama.eos_token_id) == (reason == "stop"), j
        assert len(tokens[j]) == len(references[j].tokens), j
    if chunk_tokens is None:
        assert chunks == {}
    else:   # ceil(len / chunk) chunks of which all but the last sample nothing
        assert chunks == {str(i): -(-len(p) // chunk_tokens) - 1 for i, p in enumerate(smollm2_prompts)}
        assert min(chunks.values()) >= 1


def test_tensor_parallel_2_is_refused_naming_the_heads(smollm2_llama: LlamaConfig) -> None:
    with pytest.raises(ValueError, match="^tensor_parallel_size=2 does not divide the model's num_attention_heads=9$"):
        smollm2_llama.check_tensor_parallel(2)


def test_tensor_parallel_3_matches_generate_with_a_swap(smollm2_llama: LlamaConfig, smollm2_folder: Path,
                                                        smollm2_prompts: list[list[int]],
                                                        references: dict[str, Reference]) -> None:
    work = functools.partial(greedy_until_stop, prompts=smollm2_prompts, max_tokens=MAX_NEW_TOKENS,
                             eos_token_id=smollm2_llama.eos_token_id, swap=SWAP)
    ranks = run_tensor_parallel(smollm2_llama, smollm2_folder, work,
                                RankPools(BLOCK_SIZE, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS), tp_size=TP_SIZE,
                                timeout_s=TP_TIMEOUT_S)
    assert sorted(ranks) == list(range(TP_SIZE))
    for rank, result in ranks.items():
        assert result.local_heads == EXPECTED_TP_HEADS, f"rank {rank}"
        assert_same_tokens(result.result, references, TIE_GAP)
