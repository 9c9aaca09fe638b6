"""End to end on the real in-process executor (tiny random OPT, no mocks): the engine loop
drives the skip-join MLFQ scheduler with a device pool too small for the load, and every job's
greedy tokens equal those of an unconstrained run, while KV is swapped (proactive, reactive) or
dropped and recomputed (recompute). No Ray: the executor runs in this process.
"""

from __future__ import annotations

import asyncio

import pytest

from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig, SwapMode
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.spec import ModelSpec
from tests.harness.tiny_jobs import BLOCK_SIZE, HOST_POOL, MAX_TOKENS, PROMPTS, SEED, SMALL_DEVICE_POOL, TINY

#: The jobs need 5 + 6 + 8 + 6 + 5 + 7 + 5 + 6 = 48 blocks at their longest; SMALL_DEVICE_POOL
#: (16) forces swaps (no single job needs more than 8).
LARGE_DEVICE_POOL = 128
#: Iteration times of this tiny model on a CPU, roughly: they only place jobs in levels.
PROFILE = Profile.from_dict({"t_init": {"prompt_lens": [1, 64], "seconds": [0.002, 0.01]},
                             "t_dec": {"batch_sizes": [1, 16], "seconds": [0.002, 0.004]}})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def generate(mode: SwapMode, device_blocks: int, batch: int = 16
                   ) -> tuple[dict[str, list[int]], Scheduler]:
    scheduler = Scheduler(
        SchedulerConfig(max_batch_size=batch),
        KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=device_blocks,
                      num_host_blocks=HOST_POOL, swap_mode=mode),
        PROFILE, eos_token_ids=frozenset({TINY.eos_token_id}))
    executor = InProcessExecutor(ModelSpec(TINY, device_blocks, HOST_POOL, BLOCK_SIZE, seed=SEED))
    engine = AsyncEngine(scheduler, ThreadedExecutor(executor))
    await engine.start()
    try:
        streams = {f"job{i}": engine.add_request(p, greedy(n), job_id=f"job{i}")
                   for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))}
        tokens = {}
        for job_id, stream in streams.items():
            deltas = [d async for d in stream]
            assert deltas[-1].finished and deltas[-1].finish_reason == "length", job_id
            tokens[job_id] = [d.token_id for d in deltas if d.token_id is not None]
    finally:
        await engine.stop()
    scheduler.check_invariants()
    assert not scheduler.has_work()
    assert scheduler.kv.num_free_device == device_blocks
    assert scheduler.kv.num_free_host == HOST_POOL
    return tokens, scheduler


@pytest.fixture(scope="module")
def unconstrained() -> dict[str, list[int]]:
    tokens, scheduler = asyncio.run(generate("proactive", LARGE_DEVICE_POOL))
    assert {k: len(v) for k, v in tokens.items()} == {
        f"job{i}": n for i, n in enumerate(MAX_TOKENS)}
    assert scheduler.totals["swaps_out"] == 0 and scheduler.totals["recomputes"] == 0
    return tokens


@pytest.mark.parametrize("mode", ["proactive", "reactive", "recompute"])
def test_small_device_pool_gives_the_unconstrained_tokens(
        mode: SwapMode, unconstrained: dict[str, list[int]]) -> None:
    tokens, scheduler = asyncio.run(generate(mode, SMALL_DEVICE_POOL))
    assert tokens == unconstrained
    totals = scheduler.totals
    if mode == "recompute":
        assert totals["recomputes"] > 0 and totals["swaps_out"] == 0
    else:
        assert totals["swaps_out"] > 0 and totals["swaps_in"] > 0
        assert scheduler.kv.swapped_out_blocks > 0 and scheduler.kv.swapped_in_blocks > 0


def test_one_job_per_batch_also_matches(unconstrained: dict[str, list[int]]) -> None:
    # Batch of 1: every job is preempted after its quantum and resumes later — the strongest
    # interleaving, with the KV of idle jobs moved to the host and back.
    tokens, scheduler = asyncio.run(generate("proactive", SMALL_DEVICE_POOL, batch=1))
    assert tokens == unconstrained
    assert scheduler.totals["demotions"] > 0


def test_abort_mid_generation_frees_every_block() -> None:
    async def run() -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(), KVCacheConfig(block_size=BLOCK_SIZE,
                                             num_device_blocks=SMALL_DEVICE_POOL,
                                             num_host_blocks=HOST_POOL),
            PROFILE, eos_token_ids=frozenset({TINY.eos_token_id}))
        engine = AsyncEngine(scheduler, ThreadedExecutor(
            InProcessExecutor(ModelSpec(TINY, SMALL_DEVICE_POOL, HOST_POOL, BLOCK_SIZE, seed=SEED))))
        await engine.start()
        try:
            keep = engine.add_request(PROMPTS[0], greedy(12), job_id="keep")
            drop = engine.add_request(PROMPTS[1], greedy(60), job_id="drop")
            await drop.__anext__()
            engine.abort("drop")
            rest = [d async for d in drop]
            kept = [d async for d in keep]
        finally:
            await engine.stop()
        assert rest[-1].finish_reason == "abort"
        assert len(kept) == 12 and kept[-1].finish_reason == "length"
        return scheduler

    scheduler = asyncio.run(run())
    scheduler.check_invariants()
    assert scheduler.kv.num_free_device == SMALL_DEVICE_POOL
    assert scheduler.totals["aborted"] == 1
