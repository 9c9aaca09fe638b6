"""The Ray pipeline against the in-process engine, on a local Ray instance (CPU, tiny OPT).

- TP=2/PP=1, TP=1/PP=2, TP=2/PP=2 (compiled graph) and TP=2/PP=2 (plain actor calls) give exactly
  the in-process greedy tokens for the same sequence of plans, with a device pool small enough
  that jobs are swapped out and back in mid-generation, on every stage; at TP=2 each rank sends
  the next stage half of the hidden states' bytes (the parts are all-gathered on arrival).
- With PP=2 two plans are in flight: stage 0 starts plan k+1 before the last stage ends plan k;
  no job is ever in two in-flight plans (asserted by the driver on every submission).
- Start → run → shutdown leaves no live actor; a killed worker is a ``PipelineError`` within 30 s;
  a cluster without the requested resources is a ``PipelineError`` naming them.
- If the scheduler's ``Engine`` is importable, it drives the pipeline to the same tokens.

The plans come from ``PlanDriver``: jobs alternate between two groups, so consecutive plans never
share a job; blocks come from free lists, and a job is swapped to the host when its group needs
room (largest remaining work first) and back when room returns. Blocks a plan frees are reused
two plans later, when that plan has surely returned — so the plans do not depend on how many are
in flight, and the in-process and pipelined runs see the very same ``BatchPlan``s.
"""


from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.pipeline import PipelineError, PipelineExecutor, PlanFailed
from fastserve.worker.spec import ModelSpec
from tests.harness.pipeline import (
    BLOCK_SIZE,
    HOST_POOL,
    KILL_DEADLINE_S,
    LARGE_DEVICE_POOL,
    MAX_TOKENS,
    PROMPTS,
    SEED,
    SMALL_DEVICE_POOL,
    TINY,
    Run,
    in_process_run,
    new_driver,
    pipeline_run,
    pipeline_spec,
    wait_dead,
    wait_no_live_actors,
)


@pytest.fixture(scope="module")
def reference() -> Run:
    run = in_process_run(SMALL_DEVICE_POOL)
    assert run.swaps["out"] > 0 and run.swaps["in"] > 0, "the small pool should force swaps"
    return run


@pytest.fixture(scope="module")
def runs(ray_local: None) -> Iterator[Callable[[int, int, str], Run]]:
    """Pipelined runs by (tp, pp, transport), each started once per module and shut down."""
    cache: dict[tuple[int, int, str], Run] = {}

    def get(tp: int, pp: int, transport: str) -> Run:
        key = (tp, pp, transport)
        if key not in cache:
            cache[key] = asyncio.run(pipeline_run(pipeline_spec(tp, pp, transport)))
            assert wait_no_live_actors() == [], "shutdown left actors behind"
        return cache[key]

    yield get


@pytest.mark.parametrize("tp, pp, transport", [(2, 1, "compiled"), (1, 2, "compiled"), (2, 2, "compiled"),
                                               (2, 2, "actor")])
def test_greedy_tokens_match_in_process_with_swaps(runs: Callable[[int, int, str], Run], reference: Run,
                                                   tp: int, pp: int, transport: str) -> None:
    run = runs(tp, pp, transport)
    assert run.plans == reference.plans  # the same plans, hence the same swaps and block tables
    assert run.tokens == reference.tokens
    assert run.generated == reference.generated
    assert len(run.stats) == tp * pp
    # Every token's float32 hidden states cross each stage boundary once, split over the TP ranks.
    tokens = sum(len(e.token_ids) for plan in reference.plans for e in plan.entries)
    crossing = tokens * TINY.hidden_size * 4
    for s in run.stats:
        where = f"stage {s['stage']} tp rank {s['tp_rank']}"
        assert s["steps"] == len(reference.plans), where
        assert s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] > 0, where
        assert s["hidden_bytes_sent"] == (crossing // tp if s["stage"] < pp - 1 else 0), where


def test_pp2_keeps_two_plans_in_flight(runs: Callable[[int, int, str], Run]) -> None:
    run = runs(1, 2, "compiled")
    assert run.max_inflight_seen == 2  # and drive() asserted no job was in two of them
    first = {r.step_id: r for r in run.timeline[(0, 0)]}
    last = {r.step_id: r for r in run.timeline[(1, 0)]}
    overlapped = [k for k in last if k + 1 in first and first[k + 1].start < last[k].end]
    assert overlapped, "stage 0 never started plan k+1 before the last stage finished plan k"


def test_killed_worker_is_a_pipeline_error_not_a_hang(ray_local: None) -> None:
    async def scenario() -> None:
        ex = PipelineExecutor(pipeline_spec(2, 2, num_device_blocks=LARGE_DEVICE_POOL))
        await ex.start()
        driver = new_driver(LARGE_DEVICE_POOL)
        for _ in range(2):  # a healthy start
            plan = driver.next_plan()
            driver.complete(plan, await ex.execute(plan))
        try:
            # A dead TP rank under two in-flight plans: its peer is left waiting in an all-reduce.
            # (Waiting for the death first keeps the test deterministic: ray.kill is asynchronous.)
            ray.kill(ex.workers[1][1])
            wait_dead(ex.workers[1][1])
            pending = [asyncio.ensure_future(ex.execute(driver.next_plan())) for _ in range(2)]
            started = time.monotonic()
            results = await asyncio.gather(*pending, return_exceptions=True)
            assert time.monotonic() - started < KILL_DEADLINE_S
            assert all(isinstance(r, PipelineError) and "stage 1 tp rank 1" in str(r) for r in results), results
            assert ex.closed
            with pytest.raises(PipelineError, match="pipeline is closed"):
                await ex.execute(BatchPlan(driver.step_id, ()))
        finally:
            await ex.shutdown()  # idempotent after the failure

    asyncio.run(scenario())
    assert wait_no_live_actors() == []


def test_a_killed_worker_is_an_error_and_a_failing_plan_fails_alone(ray_local: None) -> None:
    async def killed_while_idle() -> None:
        ex = PipelineExecutor(pipeline_spec(1, 2, num_device_blocks=LARGE_DEVICE_POOL))
        await ex.start()
        driver = new_driver(LARGE_DEVICE_POOL)
        plan = driver.next_plan()
        driver.complete(plan, await ex.execute(plan))
        try:
            ray.kill(ex.workers[0][0])
            wait_dead(ex.workers[0][0])
            started = time.monotonic()
            with pytest.raises(PipelineError, match="stage 0 tp rank 0"):
                await ex.execute(driver.next_plan())
            assert time.monotonic() - started < KILL_DEADLINE_S
        finally:
            await ex.shutdown()

    async def bad_plan() -> None:
        # A plan that fails on live workers fails alone: the pipeline keeps serving plans.
        ex = PipelineExecutor(pipeline_spec(1, 2, num_device_blocks=LARGE_DEVICE_POOL))
        await ex.start()
        greedy = SamplingParams(temperature=0.0)
        entry = BatchEntry("x", (2, 3, 4, 5, 6), 0, (LARGE_DEVICE_POOL,), True, greedy)
        try:
            with pytest.raises(PlanFailed, match="plan 0 failed: ValueError: job x: 1 blocks cannot hold 5 tokens"):
                await ex.execute(BatchPlan(0, (entry,)))
            assert not ex.closed
            driver = new_driver(LARGE_DEVICE_POOL)
            plan = driver.next_plan()
            out = await ex.execute(plan)
            assert set(out.tokens) == {e.job_id for e in plan.entries}
        finally:
            await ex.shutdown()

    asyncio.run(killed_while_idle())
    asyncio.run(bad_plan())
    assert wait_no_live_actors() == []


def test_missing_resources_are_named(ray_local: None) -> None:
    # Actor transport: with the compiled graph a GPU pipeline first checks for CuPy's NCCL binding
    # (tests/unit/test_nccl_binding.py), which this machine lacks.
    gpu_spec = pipeline_spec(2, 2, transport="actor", device="cuda", placement_timeout_s=1.0)
    with pytest.raises(PipelineError, match=r"2 bundles of \{'CPU': 0\.02, 'GPU': 2\.0\}.*cluster has"):
        asyncio.run(PipelineExecutor(gpu_spec).start())
    pg = ray.util.placement_group([{"CPU": 1}])
    try:
        short = pipeline_spec(1, 2)
        with pytest.raises(PipelineError, match="placement group has 1 bundles.*needs 2 stage bundles"):
            asyncio.run(PipelineExecutor(short, placement_group=pg, bundle_offset=1).start())
    finally:
        ray.util.remove_placement_group(pg)
    assert wait_no_live_actors() == []


def test_scheduler_engine_drives_the_pipeline(ray_local: None) -> None:
    from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
    from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
    from fastserve.scheduler.profile import Profile
    from fastserve.scheduler.scheduler import Scheduler

    profile = Profile.from_dict({"t_init": {"prompt_lens": [1, 64], "seconds": [0.002, 0.01]},
                                 "t_dec": {"batch_sizes": [1, 16], "seconds": [0.002, 0.004]}})

    async def generate(executor: Any) -> dict[str, list[int]]:
        kv = KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=SMALL_DEVICE_POOL, num_host_blocks=HOST_POOL)
        scheduler = Scheduler(SchedulerConfig(), kv, profile, eos_token_ids=frozenset({TINY.eos_token_id}))
        engine = AsyncEngine(scheduler, executor)
        await engine.start()
        try:
            streams = {f"job{i}": engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                                      job_id=f"job{i}")
                       for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))}
            return {job_id: [d.token_id async for d in s if d.token_id is not None] for job_id, s in streams.items()}
        finally:
            await engine.stop()

    async def on_pipeline() -> dict[str, list[int]]:
        ex = PipelineExecutor(pipeline_spec(1, 2))
        await ex.start()
        return await generate(ex)  # engine.stop() shuts the executor down

    local = InProcessExecutor(ModelSpec(TINY, SMALL_DEVICE_POOL, HOST_POOL, BLOCK_SIZE, seed=SEED))
    expected = asyncio.run(generate(ThreadedExecutor(local)))
    assert asyncio.run(on_pipeline()) == expected
    assert {k: len(v) for k, v in expected.items()} == {f"job{i}": n for i, n in enumerate(MAX_TOKENS)}
    assert wait_no_live_actors() == []
