"""The simulator and the real engine agree where every scheduling rule fires.

One deterministic workload runs twice through the skip-join MLFQ scheduler: in the simulator,
and through the real ``Engine`` loop with the real ``InProcessExecutor`` (tiny random OPT, paged
KV, real swaps between the device and host pools). Both price a plan with the same cost model:
the engine's clock is virtual and each plan advances it by what ``SimPipeline`` says the plan
takes, so the timing rules (quanta, α, ENST) see the same seconds in both runs and the test
cannot flake on a loaded machine. Demotions, starvation promotions and swaps all happen; the
runs must finish the jobs in the same order with the same token counts and per-token latency
within 15 %. Naive MLFQ adds first iterations cut at the quantum (a real partial prefill whose
KV and token are discarded).
"""

from __future__ import annotations

import asyncio

import pytest

from fastserve.bench import workloads as W
from fastserve.bench.sim import CostModel, Simulator
from fastserve.bench.sim.pipeline import SimPipeline
from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import KVCacheConfig, PolicyName, SchedulerConfig
from fastserve.scheduler.job import JobStats
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec

TINY = OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=128, name="tiny")
#: Virtual seconds: a decode iteration 1–1.5 s, first iterations 1–8 s, 0.05 s per block copied.
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 64], "seconds": [1.0, 8.0]},
    "t_dec": {"batch_sizes": [1, 4], "seconds": [1.0, 1.5]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.05},
})
BLOCK = 4
DEVICE_BLOCKS = 14
HOST_BLOCKS = 64
#: (job, prompt tokens, output tokens), all arriving at t = 0.
JOBS = (("a", 40, 12), ("b", 6, 18), ("c", 20, 8), ("d", 3, 16), ("e", 12, 6), ("f", 30, 14),
        ("g", 5, 20), ("h", 9, 10))
TOLERANCE = 0.15


def _configs(policy: PolicyName) -> tuple[SchedulerConfig, KVCacheConfig]:
    # α short enough (two iterations, no backlog floor) that starvation promotions happen.
    return (SchedulerConfig(policy=policy, max_batch_size=3, starvation_alpha_s=1.0,
                            starvation_min_iterations=2.0, starvation_backlog_batches=0.0),
            KVCacheConfig(block_size=BLOCK, num_device_blocks=DEVICE_BLOCKS,
                          num_host_blocks=HOST_BLOCKS))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PricedExecutor:
    """The real executor computes tokens and moves KV; the simulator's pipeline prices the plan
    and the virtual clock advances by that price."""

    def __init__(self, real: InProcessExecutor, clock: VirtualClock) -> None:
        self.real = real
        self.clock = clock
        self.pipeline = SimPipeline(CostModel(PROFILE), real)

    def execute(self, plan: BatchPlan) -> StepOutput:
        done = self.pipeline.dispatch(plan, self.clock.now)
        self.clock.now = done.completion
        return done.output

    def close(self) -> None:
        close = getattr(self.real, "close", None)
        if callable(close):
            close()


def _simulate(policy: PolicyName) -> tuple[list[str], dict[str, JobStats], dict[str, int]]:
    sched, kv = _configs(policy)
    result = Simulator(CostModel(PROFILE), sched, kv).run(
        [W.Request(j, 0.0, p, o) for j, p, o in JOBS])
    return result.completion_order, result.stats, result.totals


async def _engine(policy: PolicyName) -> tuple[list[str], dict[str, JobStats], dict[str, int]]:
    sched_cfg, kv_cfg = _configs(policy)
    scheduler = Scheduler(sched_cfg, kv_cfg, PROFILE, frozenset({TINY.eos_token_id}))
    clock = VirtualClock()
    real = InProcessExecutor(ModelSpec(TINY, num_device_blocks=DEVICE_BLOCKS, num_host_blocks=HOST_BLOCKS,
                             block_size=BLOCK))
    engine = AsyncEngine(scheduler, ThreadedExecutor(PricedExecutor(real, clock)), clock=clock)
    order: list[str] = []
    counts: dict[str, int] = {}

    async def consume(stream: object, job_id: str) -> None:
        async for delta in stream:  # type: ignore[attr-defined]
            counts[job_id] = counts.get(job_id, 0) + (delta.token_id is not None)
            if delta.finished:
                assert delta.finish_reason == "length"
                order.append(job_id)

    await engine.start()
    try:
        # Each prompt's second token is its own, so no two jobs share a cached prefix (as in
        # the simulator's prompts).
        streams = [(engine.add_request([2, 60 + k] + [5 + i % 50 for i in range(p - 2)],
                                       SamplingParams(max_tokens=o, temperature=0.0,
                                                      ignore_eos=True), job_id=j), j)
                   for k, (j, p, o) in enumerate(JOBS)]
        await asyncio.wait_for(asyncio.gather(*(consume(s, j) for s, j in streams)), timeout=120)
    finally:
        await engine.stop()
    scheduler.check_invariants()
    stats = {st.job_id: st for st in scheduler.drain_finished()}
    assert counts == {j: st.num_generated for j, st in stats.items()}
    return order, stats, dict(scheduler.totals)


def _per_token(stats: dict[str, JobStats]) -> dict[str, float]:
    out = {}
    for job_id, st in stats.items():
        assert st.finish_time is not None
        out[job_id] = (st.finish_time - st.arrival) / st.num_generated
    return out


@pytest.mark.parametrize("policy", ["skip_join_mlfq", "naive_mlfq"])
def test_sim_and_engine_agree_when_every_rule_fires(policy: PolicyName) -> None:
    sim_order, sim_stats, sim_totals = _simulate(policy)
    real_order, real_stats, real_totals = asyncio.run(_engine(policy))
    for totals in (sim_totals, real_totals):
        if policy == "naive_mlfq":   # first iterations cut at the quantum: a real partial prefill
            assert totals.get("wasted_prefills", 0) > 0, totals
        assert totals.get("demotions", 0) > 0, totals
        assert totals.get("promotions", 0) > 0, totals
        assert totals.get("swaps_out", 0) > 0 and totals.get("swaps_in", 0) > 0, totals
    assert real_order == sim_order
    assert {j: s.num_generated for j, s in real_stats.items()} == {j: o for j, _, o in JOBS}
    assert {j: s.num_generated for j, s in sim_stats.items()} == {j: o for j, _, o in JOBS}
    sim_pt, real_pt = _per_token(sim_stats), _per_token(real_stats)
    for job_id, simulated in sim_pt.items():
        assert real_pt[job_id] == pytest.approx(simulated, rel=TOLERANCE), job_id
