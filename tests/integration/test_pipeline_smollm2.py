"""The Ray pipeline on the demo's real checkpoint: SmolLM2-135M-Instruct at PP 2.

Two stage workers (layers 0–14 and 15–29) each load their layers from the folder's fp32
``model.safetensors``; the embedding is tied, so the first stage reads ``embed_tokens`` to embed
and the last reads the same tensor as its LM head (the checkpoint stores no ``lm_head.weight``).
Three of the parity prompts (the system prompt, the multi-turn conversation, a completion) are
generated greedily with one swap out and in midway — the plan carries the swap to both stages —
and equal ``transformers``' ``generate`` token for token. TP 2 cannot split the model's 9 query
heads (``tests/unit/test_smollm2_parity.py`` checks the refusal and TP 3 in-process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastserve.worker.messages import BatchPlan, StepOutput
from fastserve.worker.pipeline import PipelineExecutor
from fastserve.worker.spec import EngineSpec, ModelSpec, ParallelSpec
from tests.harness.engine_driver import Driver
from tests.harness.greedy import SwapMidway, greedy_until_stop
from tests.harness.hf_reference import assert_same_tokens, hf_greedy_reference
from tests.harness.smollm2 import MAX_NEW_TOKENS, TIE_GAP, hf_model, prompt_ids, smollm2_config

pytestmark = [pytest.mark.slow]

#: Parity jobs "1" (system prompt, stops at EOS), "2" (multi-turn, stops at EOS), "6" (completion).
JOBS = ("1", "2", "6")
PIPELINE_STAGES = 2
BLOCK_SIZE = 16
NUM_DEVICE_BLOCKS = 24
NUM_HOST_BLOCKS = 8
#: Job 6 (here the third, "2") leaves after 4 tokens and comes back 3 steps later.
SWAP = SwapMidway("2", out_step=4, in_step=7)
#: 2 cores, 2 workers: one torch thread each.
WORKER_THREADS = 1


class _SyncPipeline:
    """``PipelineExecutor`` shaped for ``Driver``: one plan at a time on a private event loop."""

    def __init__(self, spec: EngineSpec) -> None:
        self.loop = asyncio.new_event_loop()
        self.pipe = PipelineExecutor(spec)
        self.kv = SimpleNamespace(block_size=spec.model.block_size, num_device_blocks=spec.model.num_device_blocks,
                                  num_host_blocks=spec.model.num_host_blocks)
        self.loop.run_until_complete(self.pipe.start())

    def execute(self, plan: BatchPlan) -> StepOutput:
        return self.loop.run_until_complete(self.pipe.execute(plan))

    def stats(self) -> list[dict[str, int]]:
        return self.loop.run_until_complete(self.pipe.stats())

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.pipe.shutdown())
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def pipeline(ray_local: None, smollm2_folder: Path) -> Iterator[_SyncPipeline]:
    spec = EngineSpec(ModelSpec(smollm2_config(smollm2_folder), NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE,
                                load_format="auto", model_path=str(smollm2_folder), torch_threads=WORKER_THREADS),
                      ParallelSpec(tensor_parallel_size=1, pipeline_parallel_size=PIPELINE_STAGES))
    pipe = _SyncPipeline(spec)
    yield pipe
    pipe.close()


def test_pp2_on_real_tied_weights_matches_generate_through_a_swap(pipeline: _SyncPipeline,
                                                                 smollm2_folder: Path) -> None:
    config = smollm2_config(smollm2_folder)
    every = prompt_ids(smollm2_folder)
    prompts = [every[int(j)] for j in JOBS]
    hf = hf_model(smollm2_folder)
    refs = {str(i): hf_greedy_reference(hf, p, MAX_NEW_TOKENS, config.eos_token_id) for i, p in enumerate(prompts)}
    driver = Driver(pipeline)  # type: ignore[arg-type]
    tokens = greedy_until_stop(driver, prompts, MAX_NEW_TOKENS, config.eos_token_id, SWAP)
    assert_same_tokens(tokens, refs, TIE_GAP)
    assert driver.swaps == {"out": 1, "in": 1}
    stats = pipeline.stats()
    assert len(stats) == PIPELINE_STAGES
    for s in stats:   # the swap ran on both stages' KV
        assert s["swapped_out_blocks"] == s["swapped_in_blocks"] > 0, s
