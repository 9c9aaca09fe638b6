"""One request's bad data fails only that request: the other jobs of the same steps finish with
exactly the tokens they get without it (real engine, scheduler and in-process executor)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.sampler import Sampler
from fastserve.worker.spec import ModelSpec

TINY = OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=128, max_position_embeddings=256, name="tiny")
BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS = 4, 64, 16
PROFILE = Profile.from_dict({"t_init": {"prompt_lens": [1, 64], "seconds": [0.002, 0.01]},
                             "t_dec": {"batch_sizes": [1, 16], "seconds": [0.002, 0.004]}})
GOOD = {"a": ([2, 11, 57, 100, 7], 12), "b": ([2, 300, 4], 15), "c": ([2, *range(20, 30)], 9)}
#: A seed the test sampler refuses: stands for any failure inside one row's sampling.
POISON_SEED = 666


class FailingSampler(Sampler):
    """Fails inside sampling for one seed: the batched draw fails as a whole, then the row-by-row
    fallback fails that row alone."""

    def _generator(self, p: SamplingParams, step: int) -> torch.Generator:
        if p.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return super()._generator(p, step)


async def collect(engine: AsyncEngine, jobs: dict[str, tuple[list[int], SamplingParams]]
                  ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add every job, then read each stream to its end: tokens and finish reason per job."""
    streams = {k: engine.add_request(p, s, job_id=k) for k, (p, s) in jobs.items()}
    tokens, reasons = {}, {}
    for k, stream in streams.items():
        deltas = [d async for d in stream]
        tokens[k] = [d.token_id for d in deltas if d.token_id is not None]
        reasons[k] = str(deltas[-1].finish_reason)
    return tokens, reasons


def tiny_scheduler() -> Scheduler:
    kv = KVCacheConfig(block_size=BLOCK_SIZE, num_device_blocks=DEVICE_BLOCKS, num_host_blocks=HOST_BLOCKS)
    return Scheduler(SchedulerConfig(), kv, PROFILE, eos_token_ids=frozenset({TINY.eos_token_id}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def run(extra: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict[str, list[int]], dict[str, str]]:
    scheduler = tiny_scheduler()
    executor = InProcessExecutor(ModelSpec(TINY, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE, seed=0))
    executor.runner.sampler = FailingSampler(0)
    engine = AsyncEngine(scheduler, ThreadedExecutor(executor))
    await engine.start()
    try:
        jobs = {k: (p, greedy(n)) for k, (p, n) in GOOD.items()} | extra
        tokens, reasons = await collect(engine, jobs)
    finally:
        await engine.stop()
    scheduler.check_invariants()
    assert scheduler.kv.num_free_device == DEVICE_BLOCKS and scheduler.kv.num_free_host == HOST_BLOCKS
    return tokens, reasons


def test_a_failing_row_fails_only_its_job_and_top_p_underflow_keeps_the_top_token() -> None:
    alone, reasons = asyncio.run(run({}))
    assert reasons == {"a": "length", "b": "length", "c": "length"}
    prompt = [2, 7, 8, 9]
    tokens, reasons = asyncio.run(run({
        # top_p below float32's smallest value: the most likely token still survives → greedy.
        "tiny_top_p": (prompt, SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, seed=1,
                                              ignore_eos=True)),
        "poison": (prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=POISON_SEED, ignore_eos=True)),
        "greedy_twin": (prompt, greedy(6)),
    }))
    assert {k: tokens[k] for k in GOOD} == alone
    assert reasons["poison"] == "error" and tokens["poison"] == []
    assert reasons["tiny_top_p"] == "length" and tokens["tiny_top_p"] == tokens["greedy_twin"]


class StuckExecutor:
    """A step that never returns (a hung collective, a deadlocked kernel)."""

    max_inflight = 1

    async def execute(self, plan: object) -> object:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def shutdown(self) -> None:
        return None


def test_a_stuck_step_turns_the_engine_unhealthy_and_a_dead_loop_refuses_work() -> None:
    from fastserve.engine.async_engine import EngineUnavailable
    from fastserve.scheduler.config import EngineConfig

    async def run() -> None:
        scheduler = tiny_scheduler()
        engine = AsyncEngine(scheduler, StuckExecutor(), config=EngineConfig(watchdog_s=0.3))  # type: ignore[arg-type]
        await engine.start()
        assert engine.health() is None                       # idle is healthy, however long
        await asyncio.sleep(0.4)
        assert engine.health() is None
        engine.add_request([2, 5, 6], greedy(4), job_id="stuck")
        await asyncio.sleep(0.1)
        assert engine.health() is None                       # within the watchdog time
        await asyncio.sleep(0.4)
        problem = engine.health()
        assert problem is not None and "engine.watchdog_s=0.3" in problem
        task = engine._task
        assert task is not None
        task.cancel()                                        # the loop dies
        await asyncio.sleep(0)
        with pytest.raises(EngineUnavailable):
            engine.add_request([2, 5], greedy(2))
        assert engine.health() == "the engine loop is not running"

    asyncio.run(run())


def test_an_engine_holds_at_most_max_jobs() -> None:
    from fastserve.scheduler.config import EngineConfig
    from fastserve.scheduler.scheduler import AdmissionQueueFull

    async def run() -> None:
        scheduler = tiny_scheduler()
        engine = AsyncEngine(scheduler, StuckExecutor(), config=EngineConfig(max_jobs=2))  # type: ignore[arg-type]
        await engine.start()
        engine.add_request([2, 5], greedy(4), job_id="a")
        engine.add_request([2, 6], greedy(4), job_id="b")
        with pytest.raises(AdmissionQueueFull, match="engine.max_jobs=2"):
            engine.add_request([2, 7], greedy(4), job_id="c")
        engine.abort("a")   # a slot frees when a job ends
        engine.add_request([2, 7], greedy(4), job_id="c")
        task = engine._task
        assert task is not None
        task.cancel()

    asyncio.run(run())


class DyingExecutor:
    """Runs ``survive`` plans on a real executor, then dies the way a pipeline does when a stage
    worker is killed: the step raises and the executor reports itself closed."""

    max_inflight = 1

    def __init__(self, inner: ThreadedExecutor, survive: int) -> None:
        self.inner, self.survive, self.closed = inner, survive, False

    async def execute(self, plan: object) -> object:
        if self.survive <= 0:
            self.closed = True
            raise RuntimeError("stage 1 tp rank 0 died")
        self.survive -= 1
        return await self.inner.execute(plan)  # type: ignore[arg-type]

    async def shutdown(self) -> None:
        await self.inner.shutdown()


def new_executor() -> ThreadedExecutor:
    return ThreadedExecutor(InProcessExecutor(ModelSpec(TINY, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE, seed=0)))


async def run_with(executor: object, rebuild: object, deadline_s: float = 30.0
                   ) -> tuple[dict[str, list[int]], dict[str, str], AsyncEngine]:
    from fastserve.scheduler.config import EngineConfig

    scheduler = tiny_scheduler()
    engine = AsyncEngine(scheduler, executor, config=EngineConfig(rebuild_deadline_s=deadline_s, rebuild_retry_s=0.1),  # type: ignore[arg-type]
                    rebuild=rebuild)  # type: ignore[arg-type]
    await engine.start()
    try:
        tokens, reasons = await collect(engine, {k: (p, greedy(n)) for k, (p, n) in GOOD.items()})
    finally:
        running = engine.running
        await engine.stop()   # also collects a dead loop's exception
    assert running == (engine.rebuilds > 0 or rebuild is None)
    return tokens, reasons, engine


def test_a_lost_executor_is_rebuilt_and_jobs_resume_with_their_exact_tokens() -> None:
    alone, _ = asyncio.run(run({}))

    async def rebuild() -> ThreadedExecutor:
        return new_executor()

    tokens, reasons, engine = asyncio.run(run_with(DyingExecutor(new_executor(), survive=4), rebuild))
    assert reasons == {"a": "length", "b": "length", "c": "length"}
    assert tokens == alone and engine.rebuilds == 1
    assert engine.scheduler.totals["recomputes"] == len(GOOD)
    engine.scheduler.check_invariants()


def test_the_replica_stays_healthy_while_its_lost_pipeline_is_rebuilt() -> None:
    """Serve replaces a replica whose health check fails: during a rebuild that would end every
    job waiting to resume, so a closed executor is a problem only when no rebuild is under way."""
    from fastserve.engine.replica import EngineReplica

    seen: list[tuple[bool, bool, str | None]] = []

    async def run() -> dict[str, str]:
        replica = EngineReplica.__new__(EngineReplica)
        dying = DyingExecutor(new_executor(), survive=2)
        go = asyncio.Event()

        async def rebuild() -> ThreadedExecutor:
            seen.append((replica.engine.executor is dying and dying.closed, replica.engine.recovering,
                         replica.health_problem()))
            await go.wait()
            return new_executor()

        replica.engine = AsyncEngine(tiny_scheduler(), dying, rebuild=rebuild)  # type: ignore[arg-type]
        await replica.engine.start()
        asyncio.get_running_loop().call_later(0.5, go.set)
        try:
            _, reasons = await collect(replica.engine, {k: (p, greedy(n)) for k, (p, n) in GOOD.items()})
        finally:
            await replica.engine.stop()
        return reasons

    reasons = asyncio.run(run())
    assert seen == [(True, True, None)]
    assert set(reasons.values()) == {"length"}


def test_past_the_rebuild_deadline_every_job_ends_with_an_error() -> None:
    async def never() -> ThreadedExecutor:
        raise RuntimeError("no GPUs left in the placement group")

    tokens, reasons, engine = asyncio.run(run_with(DyingExecutor(new_executor(), survive=2), never, deadline_s=0.5))
    assert set(reasons.values()) == {"error"}
    assert engine.rebuilds == 0 and engine.health() == "the engine loop is not running"


def test_health_on_the_http_port_turns_503_when_a_step_is_stuck() -> None:
    """The real engine (stuck executor) behind the real ingress app: /health answers 503 once
    work has waited for a step longer than engine.watchdog_s."""
    import httpx

    from fastserve.scheduler.config import EngineConfig
    from fastserve.server.http_api import make_api
    from fastserve.server.ingress import OpenAIServer
    from fastserve.server.ingress_requests import ServerContext
    from fastserve.tokenizer import Tokenizer

    async def run() -> list[int]:
        scheduler = tiny_scheduler()
        engine = AsyncEngine(scheduler, StuckExecutor(), config=EngineConfig(watchdog_s=0.3, stop_timeout_s=0.2))  # type: ignore[arg-type]
        await engine.start()

        class EngineBackend:
            async def health(self) -> dict[str, object]:
                problem = engine.health()
                return {"healthy": problem is None, "problem": problem}

        app = make_api(OpenAIServer(ServerContext("tiny", Tokenizer.default(), TINY.vocab_size, 256),
                                    EngineBackend()))  # type: ignore[arg-type]
        codes = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            codes.append((await client.get("/health")).status_code)
            engine.add_request([2, 5, 6], greedy(4), job_id="stuck")
            await asyncio.sleep(0.5)
            resp = await client.get("/health")
            codes.append(resp.status_code)
            assert "engine.watchdog_s=0.3" in resp.json()["error"]["message"]
        await engine.stop()   # bounded even with a step that never returns
        return codes

    assert asyncio.run(run()) == [200, 503]
