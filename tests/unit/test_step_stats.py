"""The engine's step breakdown and the coalescing read of a job's delta stream."""

from __future__ import annotations

import asyncio

import pytest

from fastserve.engine.async_engine import RequestStream
from fastserve.engine.step_stats import StepStats, diff_totals, summarize
from fastserve.scheduler.job import Finish, JobStats, TokenDelta
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec

TINY = OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=128, max_position_embeddings=256, name="tiny")


def test_step_stats_means_per_kind_and_overhead_share() -> None:
    stats = StepStats()
    timings = {"build": 0.001, "forward": 0.080, "sample": 0.010, "lm_head": 0.008, "total": 0.095}
    # Two back-to-back decode steps of 100 ms cycles, and one decode step after an idle spell.
    stats.record("decode", 16, 16, 0.002, 0.096, 0.001, timings, cycle_s=0.100)
    stats.record("decode", 16, 16, 0.002, 0.096, 0.001, timings, cycle_s=0.100)
    stats.record("decode", 4, 4, 0.001, 0.050, 0.001, {"forward": 0.040, "sample": 0.005}, cycle_s=None)
    stats.record("mixed", 2, 130, 0.003, 0.300, 0.002, {"forward": 0.290}, cycle_s=0.310)
    summary = stats.summary()
    decode, mixed = summary["decode"], summary["mixed"]
    assert decode["steps"] == 3 and decode["entries"] == 12 and decode["tokens"] == 12
    assert decode["forward_ms"] == pytest.approx((80 + 80 + 40) / 3)
    assert decode["schedule_ms"] == pytest.approx(5 / 3)
    assert decode["lm_head_ms"] == pytest.approx((8 + 8) / 3)   # a part of sample_ms, not added to it
    assert decode["cycle_ms"] == pytest.approx(100.0)      # idle-preceded steps have no cycle
    assert decode["overhead_ms"] == pytest.approx(10.0)    # 100 − (80 + 10)
    assert decode["overhead_share"] == pytest.approx(0.1)
    assert mixed["tokens"] == 130 and mixed["overhead_ms"] == pytest.approx(20.0)
    before = stats.totals()
    stats.record("decode", 8, 8, 0.001, 0.060, 0.001, {"forward": 0.050, "sample": 0.005}, cycle_s=0.060)
    only_last = summarize(diff_totals(stats.totals(), before))
    assert only_last["decode"]["steps"] == 1 and only_last["decode"]["entries"] == 8
    assert only_last["decode"]["overhead_ms"] == pytest.approx(5.0) and "mixed" not in only_last


def test_a_cpu_step_reports_its_lm_head_inside_its_sample_phase() -> None:
    executor = InProcessExecutor(ModelSpec(TINY, 8, 0, 4, seed=0))
    entry = BatchEntry("a", (2, 11, 57), 0, (0,), True, SamplingParams(temperature=0.0))
    timings = executor.execute(BatchPlan(0, (entry,))).timings
    assert 0.0 < timings["lm_head"] <= timings["sample"]


def test_request_stream_ready_takes_what_is_queued_up_to_the_finish() -> None:
    async def run() -> None:
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        stream = RequestStream("j", queue)
        for token, finished in ((5, False), (6, False), (7, True)):
            queue.put_nowait(TokenDelta.token("j", token, Finish("length") if finished else None))
        queue.put_nowait(TokenDelta.ended("j", "abort"))   # never read: the job finished
        first = await stream.__anext__()
        rest = stream.ready()
        assert [first.token_id, *(d.token_id for d in rest)] == [5, 6, 7]
        assert rest[-1].finished and stream.ready() == []
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(run())


def test_a_lagging_readers_deltas_merge_into_one_with_the_last_ones_finish() -> None:
    finish = Finish("length", JobStats("j", arrival=0.0, prompt_len=2))
    merged = TokenDelta.merge([TokenDelta.token("j", 5), TokenDelta.token("j", 6),
                               TokenDelta.token("j", 7, finish)])
    assert merged.token_ids == (5, 6, 7) and merged.finish is finish and merged.finish_reason == "length"
    assert merged.finished and TokenDelta("j").finished is False
    ended = TokenDelta.ended("j", "abort")
    assert ended.finished and ended.token_id is None and ended.finish == Finish("abort")
