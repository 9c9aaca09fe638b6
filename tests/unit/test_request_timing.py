"""vLLM's per-token and per-request metrics from the engine loop (fastserve.engine.request_timing), exactly.

The real ``Engine`` and ``Scheduler`` run on a manual clock; the data plane is a script that
advances the clock by a chosen time per step (binary-exact, so every interval is exact) and
returns a token for every entry that samples. What the replica's metrics tick records is read
back through ``EngineMetrics`` with recording sinks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from fastserve.engine.async_engine import AsyncEngine
from fastserve.engine.metrics import EngineMetrics
from fastserve.engine.request_timing import RequestTimer, TimingBatch
from fastserve.scheduler.job import Finish, TokenDelta
from fastserve.worker.messages import BatchPlan, StepOutput
from tests.harness.metric_sinks import FakeSink, sinks
from tests.harness.scheduling import TOKEN, make, req

MODEL = "timing-test"
PREFILL = 0.0625
DECODE = 0.015625
STALL = 0.625    # e.g. a swap-in or an MLFQ wait in the middle of the stream


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedDataPlane:
    """Each plan takes the next duration of ``durations`` on ``clock`` (the last one repeats)."""

    max_inflight = 1

    def __init__(self, clock: Clock, durations: Sequence[float]) -> None:
        self.clock, self.durations, self.plans = clock, list(durations), 0

    async def execute(self, plan: BatchPlan) -> StepOutput:
        d = self.durations[min(self.plans, len(self.durations) - 1)]
        self.plans += 1
        self.clock.t += d
        return StepOutput(plan.step_id, {e.job_id: TOKEN for e in plan.entries if e.samples}, {"total": d})

    async def shutdown(self) -> None:
        return None


def serve(jobs: Sequence[tuple[str, int, int]], durations: Sequence[float], batch: int = 16,
          drain_after_step: int | None = None) -> tuple[TimingBatch, TimingBatch | None, AsyncEngine]:
    """Run ``jobs`` (id, prompt length, max_tokens) submitted together at t=0 under FCFS; the
    timing drained at the end (and after step ``drain_after_step``, if given)."""
    clock = Clock()
    plane = ScriptedDataPlane(clock, durations)
    engine = AsyncEngine(make("fcfs", batch=batch), plane, clock=clock)
    early: list[TimingBatch] = []

    async def run() -> None:
        await engine.start()
        try:
            streams = [engine.submit(req(j, p, n)) for j, p, n in jobs]

            async def read(stream: object) -> None:
                async for delta in stream:   # type: ignore[attr-defined]
                    assert isinstance(delta, TokenDelta)
                    if drain_after_step is not None and not early and plane.plans == drain_after_step:
                        early.append(engine.timing.drain())
            await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), 30)
        finally:
            await engine.stop()
    asyncio.run(run())
    return engine.timing.drain(), (early[0] if early else None), engine


def test_a_stall_is_one_long_inter_token_gap_in_its_own_bucket() -> None:
    # prefill, 2 decodes, a stalled decode, a decode: 5 tokens
    batch, _, engine = serve([("a", 8, 5)], [PREFILL, DECODE, DECODE, STALL, DECODE])
    assert batch.itls == [DECODE, DECODE, STALL, DECODE]
    assert batch.ttfts == [PREFILL]
    assert (batch.prompt_tokens, batch.generation_tokens) == (8, 5)
    (f,) = batch.finished
    assert (f.finish_reason, f.prompt_len, f.num_generated) == ("length", 8, 5)
    assert (f.queue_s, f.prefill_s) == (0.0, PREFILL)
    assert f.decode_s == 3 * DECODE + STALL and f.inference_s == PREFILL + 3 * DECODE + STALL
    assert f.e2e_s == f.inference_s and f.time_per_output_token_s == (3 * DECODE + STALL) / 4
    assert len(engine.timing) == 0   # nothing kept for a finished job

    m = EngineMetrics(MODEL, FakeSink, max_model_len=512)
    m.record_timing(batch)
    s = sinks(m)
    # vLLM's ITL buckets: the stall lands alone in (0.5, 0.75]; a per-request mean (0.17) would
    # have put one observation in (0.15, 0.2] and hidden it.
    assert s["inter_token_latency_seconds"].bucket_counts() == {0.025: 3, 0.75: 1}
    assert s["request_time_per_output_token_seconds"].bucket_counts() == {0.2: 1}
    assert s["time_to_first_token_seconds"].observed == [PREFILL]
    assert s["request_prefill_time_seconds"].observed == [PREFILL]
    assert s["request_decode_time_seconds"].observed == [3 * DECODE + STALL]
    assert s["request_queue_time_seconds"].observed == [0.0]
    assert s["request_prompt_tokens"].bucket_counts() == {10: 1}       # 8 in (5, 10]
    assert s["request_generation_tokens"].bucket_counts() == {5: 1}    # 5 in (2, 5]
    assert s["prompt_tokens"].values == {(): 8.0} and s["generation_tokens"].values == {(): 5.0}


def test_queue_time_is_arrival_to_first_scheduled_and_prefill_follows_it() -> None:
    # One job per batch: b waits (queued) for all of a, then runs.
    batch, _, _ = serve([("a", 4, 3), ("b", 6, 2)], [PREFILL, DECODE, DECODE, PREFILL, DECODE], batch=1)
    f = {x.job_id: x for x in batch.finished}
    a_done = PREFILL + 2 * DECODE
    assert (f["a"].queue_s, f["a"].e2e_s) == (0.0, a_done)
    assert f["b"].queue_s == a_done and f["b"].prefill_s == PREFILL and f["b"].decode_s == DECODE
    assert f["b"].e2e_s == a_done + PREFILL + DECODE
    assert sorted(batch.ttfts) == [PREFILL, a_done + PREFILL]
    assert batch.itls == [DECODE, DECODE, DECODE]
    assert (batch.prompt_tokens, batch.generation_tokens) == (10, 5)


def test_token_counters_move_every_step_not_when_the_request_ends() -> None:
    # Drained after the prefill and one decode of a 6-token request: its tokens so far are counted.
    total, early, _ = serve([("a", 12, 6)], [PREFILL, DECODE], drain_after_step=2)
    assert early is not None and (early.prompt_tokens, early.generation_tokens) == (12, 2)
    assert early.finished == [] and early.itls == [DECODE]
    assert (total.prompt_tokens, total.generation_tokens) == (0, 4) and len(total.finished) == 1


def test_an_aborted_job_counts_its_tokens_but_records_no_latency() -> None:
    timer = RequestTimer()
    timer.added("x", 1.0, 5)
    timer.scheduled(["x"], 1.5)
    timer.step([TokenDelta("x", (7,))], 2.0)
    timer.step([TokenDelta("x", (7,)), TokenDelta("unknown", (1,))], 2.25)
    timer.step([TokenDelta.ended("x", "abort")], 3.0)
    batch = timer.drain()
    assert (batch.prompt_tokens, batch.generation_tokens, batch.ttfts, batch.itls) == (5, 2, [1.0], [0.25])
    assert batch.finished == [] and len(timer) == 0
    assert timer.drain() == TimingBatch()


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_one_token_answer_has_no_time_per_output_token(reason: str) -> None:
    timer = RequestTimer()
    timer.added("x", 0.0, 3)
    timer.scheduled(["x"], 0.5)
    timer.scheduled(["x"], 0.75)   # a later plan (after a preemption) does not move it
    timer.step([TokenDelta("x", (2,), Finish(reason))], 1.0)   # type: ignore[arg-type]
    (f,) = timer.drain().finished
    assert (f.queue_s, f.prefill_s, f.decode_s, f.time_per_output_token_s) == (0.5, 0.5, 0.0, None)
    m = EngineMetrics(MODEL, FakeSink)
    m.record_timing(TimingBatch(finished=[f]))
    assert sinks(m)["request_time_per_output_token_seconds"].observed == []
    assert sinks(m)["e2e_request_latency_seconds"].observed == [1.0]
