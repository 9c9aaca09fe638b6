"""``engine.batch_invariant``: a request's greedy tokens do not depend on what shares its batch.

On SmolLM2-135M-Instruct in bf16, twelve prompts run together give each prompt the tokens it gets
alone — all twelve in one batch from the first step, with one job swapped to the host pool and
back midway, and through the real scheduler and engine loop with every prompt prefilled in chunks
beside the others' decodes. What makes it hold: every GEMM on one path whose per-row sums do not
depend on the row count (our kernel's AMX tiles, or ``vdpbf16ps`` with every row on one chain:
``fastserve.worker.model.gemm_choice``), and kernels that are per row already (attention over a row's
own keys in a fixed tile order, per-row norms, rotary and argmax). Runs where our bf16 kernel
builds (AVX-512 BF16); the mode is refused elsewhere, as it is with a swap mode that recomputes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from fastserve.config import AppArgs
from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.kernels import cpu_linear, cpu_step
from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.scheduler.config import ChunkedPrefillConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.spec import ModelSpec
from tests.harness.app_config import demo_args, error_of
from tests.harness.engine_driver import Driver
from tests.harness.greedy import SwapMidway, greedy_until_stop
from tests.harness.smollm2 import PROFILE

needs_kernel = pytest.mark.skipif(
    not (cpu_has_bf16() and cpu_linear.available() and cpu_step.available()),
    reason="batch-invariant mode runs on our bf16 kernel, which needs AVX-512 BF16 (not on this CPU or compiler)")

BLOCK_SIZE = 16
MAX_NEW_TOKENS = 24
#: 12 jobs of at most 63 + 24 tokens (6 blocks each), and room to swap one back in.
NUM_DEVICE_BLOCKS = 96
NUM_HOST_BLOCKS = 16
#: Smaller than the shortest prompt: every prompt goes in two or more chunks.
CHUNK_TOKENS = 5
#: The four prompts beside the eight parity prompts.
MORE = ["Once upon a time, in a village by the sea,", "The three primary colours are",
        "import numpy as np\n\ndef mean(xs):\n    ", "Water boils at"]
ENGINE_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def twelve(smollm2_folder: Path, smollm2_prompts: list[list[int]]) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
    return smollm2_prompts + [list(tok(t)["input_ids"]) for t in MORE]


@pytest.fixture(scope="module")
def executor(smollm2_llama: LlamaConfig, smollm2_folder: Path) -> Iterator[InProcessExecutor]:
    if not (cpu_has_bf16() and cpu_linear.available() and cpu_step.available()):
        pytest.skip("batch-invariant mode needs our bf16 kernel (AVX-512 BF16)")
    ex = InProcessExecutor(ModelSpec(smollm2_llama, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, dtype="bfloat16",
                                     load_format="auto", model_path=str(smollm2_folder), batch_invariant=True))
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def alone(executor: InProcessExecutor, twelve: list[list[int]], smollm2_llama: LlamaConfig) -> dict[str, list[int]]:
    """Each prompt's tokens when it runs by itself."""
    return {str(i): greedy_until_stop(Driver(executor), [p], MAX_NEW_TOKENS, smollm2_llama.eos_token_id)["0"]
            for i, p in enumerate(twelve)}


@needs_kernel
def test_every_gemm_takes_one_invariant_path(executor: InProcessExecutor) -> None:
    model = executor.model
    assert model._step_run is not None
    packed = [g._packed for layer in model.layers for g in (layer.self_attn.qkv, layer.mlp.gate_up)]
    packed += [m._packed for layer in model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    packed.append(model._head_packed)
    want = G.AMX if cpu_linear.amx_available() else G.UNIFORM
    assert {p.choice for p in packed if p is not None} == {G.GemmChoice.single(want)} and None not in packed


@needs_kernel
def test_twelve_at_once_equal_each_alone(executor: InProcessExecutor, twelve: list[list[int]],
                                         alone: dict[str, list[int]], smollm2_llama: LlamaConfig) -> None:
    together = greedy_until_stop(Driver(executor), twelve, MAX_NEW_TOKENS, smollm2_llama.eos_token_id)
    assert together == alone
    assert len({len(t) for t in together.values()}) > 1   # some stopped at EOS while others ran on


@needs_kernel
def test_through_a_swap_out_and_in(executor: InProcessExecutor, twelve: list[list[int]],
                                   alone: dict[str, list[int]], smollm2_llama: LlamaConfig) -> None:
    driver = Driver(executor)
    swapped = greedy_until_stop(driver, twelve, MAX_NEW_TOKENS, smollm2_llama.eos_token_id,
                                SwapMidway("5", out_step=6, in_step=9))
    assert driver.swaps == {"out": 1, "in": 1}
    assert swapped == alone


@needs_kernel
def test_through_the_engine_loop_with_chunked_prefill(executor: InProcessExecutor, twelve: list[list[int]],
                                                      alone: dict[str, list[int]], smollm2_llama: LlamaConfig) -> None:
    """Every prompt in chunks of 5 tokens, beside the other jobs' decodes and chunks, through
    the scheduler's own plans."""
    cfg = SchedulerConfig(max_batch_size=len(twelve),
                          chunked_prefill=ChunkedPrefillConfig(enabled=True, chunk_tokens=CHUNK_TOKENS))
    kv = KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=NUM_DEVICE_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS)
    eos = smollm2_llama.eos_token_id
    engine = AsyncEngine(Scheduler(cfg, kv, Profile.load(PROFILE), frozenset({eos})), ThreadedExecutor(executor))
    tokens: dict[str, list[int]] = {}

    async def consume(job_id: str, prompt: list[int]) -> None:
        ids: list[int] = []
        async for delta in engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
                                              job_id=job_id):
            ids += delta.token_ids
        tokens[job_id] = ids

    async def run() -> None:
        await engine.start()
        try:
            await asyncio.wait_for(asyncio.gather(*(consume(str(i), p) for i, p in enumerate(twelve))),
                                   timeout=ENGINE_TIMEOUT_S)
        finally:
            await engine.stop()

    asyncio.run(run())
    assert tokens == alone


def test_the_mode_is_refused_where_it_cannot_hold(smollm2_llama: LlamaConfig) -> None:
    args = demo_args()
    args["engine"] = {"batch_invariant": True}
    assert AppArgs.model_validate(args).engine_spec().model.batch_invariant
    args["kv_cache"]["swap_mode"] = "recompute"
    assert "engine.batch_invariant with kv_cache.swap_mode 'recompute'" in error_of(args)
    # float32 has no invariant GEMM here: refused when the model is built, naming the shape.
    with pytest.raises(ValueError, match="engine.batch_invariant needs a GEMM whose rows do not depend"):
        InProcessExecutor(ModelSpec(smollm2_llama, 8, 0, BLOCK_SIZE, dtype="float32", batch_invariant=True))
    assert torch.get_default_dtype() == torch.float32
