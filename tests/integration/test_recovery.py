"""A dead stage worker is replaced and its jobs resumed: the engine rebuilds the pipeline and
every in-flight job recomputes (prompt + the tokens it already has) on the new workers, so the
clients see a pause and then exactly the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from fastserve.engine.async_engine import AsyncEngine, Executor, ThreadedExecutor
from fastserve.scheduler.config import EngineConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.pipeline import PipelineExecutor
from fastserve.worker.spec import ModelSpec
from tests.harness.pipeline import (
    BLOCK_SIZE,
    HOST_POOL,
    SEED,
    TINY,
    pipeline_spec,
    wait_no_live_actors,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEVICE_POOL = 128
PROMPTS = [[2, 11, 57, 100, 7], [2, 300, 4], [2, *range(20, 40)], [2, 99, 98, 97, 96, 95, 94, 93],
           [2, 5], [2, *range(150, 162)], [2, 42, 43], [2, *range(60, 70)]]
MAX_TOKENS = 24
#: Tokens every stream has seen before a worker is killed (mid-generation for all of them).
KILL_AFTER = 6
PROFILE_DICT = {"t_init": {"prompt_lens": [1, 64], "seconds": [0.002, 0.01]},
                "t_dec": {"batch_sizes": [1, 16], "seconds": [0.002, 0.004]}}


def scheduler() -> Scheduler:
    from fastserve.scheduler.profile import Profile

    kv = KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=DEVICE_POOL, num_host_blocks=HOST_POOL)
    return Scheduler(SchedulerConfig(), kv, Profile.from_dict(PROFILE_DICT),
                     eos_token_ids=frozenset({TINY.eos_token_id}))


async def generate(engine: AsyncEngine, on_progress: Any = None) -> dict[str, list[int]]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    streams = {f"job{i}": engine.add_request(p, greedy, job_id=f"job{i}") for i, p in enumerate(PROMPTS)}
    tokens: dict[str, list[int]] = {k: [] for k in streams}
    reasons: dict[str, str | None] = {}

    async def read(job_id: str) -> None:
        async for delta in streams[job_id]:
            if delta.token_id is not None:
                tokens[job_id].append(delta.token_id)
                if on_progress is not None:
                    on_progress(tokens)
            reasons[job_id] = delta.finish_reason

    await asyncio.gather(*(read(k) for k in streams))
    assert set(reasons.values()) == {"length"}, reasons
    return tokens


def test_killed_stage_worker_is_rebuilt_and_every_stream_gets_its_exact_tokens(ray_local: None) -> None:
    async def reference() -> dict[str, list[int]]:
        local = InProcessExecutor(ModelSpec(TINY, DEVICE_POOL, HOST_POOL, BLOCK_SIZE, seed=SEED))
        engine = AsyncEngine(scheduler(), ThreadedExecutor(local))
        await engine.start()
        try:
            return await generate(engine)
        finally:
            await engine.stop()

    async def disturbed() -> tuple[dict[str, list[int]], AsyncEngine]:
        spec = pipeline_spec(1, 2, transport="actor", num_device_blocks=DEVICE_POOL)

        async def build() -> Executor:
            ex = PipelineExecutor(spec)
            await ex.start()
            return ex

        first = await build()
        engine = AsyncEngine(scheduler(), first, config=EngineConfig(rebuild_deadline_s=120.0), rebuild=build)
        await engine.start()
        killed: list[float] = []

        def kill_once(tokens: dict[str, list[int]]) -> None:
            if not killed and min(len(t) for t in tokens.values()) >= KILL_AFTER:
                assert isinstance(first, PipelineExecutor)
                ray.kill(first.workers[1][0])   # stage 1 of 2, mid-generation
                killed.append(time.monotonic())

        try:
            tokens = await generate(engine, kill_once)
        finally:
            await engine.stop()
        assert killed, "the worker was never killed"
        return tokens, engine

    expected = asyncio.run(reference())
    tokens, engine = asyncio.run(disturbed())
    print(f"pipeline rebuilt {engine.rebuilds} time(s), {engine.last_rebuild_s:.2f} s")
    assert engine.rebuilds == 1 and engine.last_rebuild_s is not None
    assert tokens == expected
    assert engine.scheduler.totals["recomputes"] >= len(PROMPTS)
    assert wait_no_live_actors() == []
