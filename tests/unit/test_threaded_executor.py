"""``ThreadedExecutor.on_its_thread``: the model is built on the thread that runs its steps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fastserve.engine.async_engine import ThreadedExecutor
from fastserve.worker.messages import BatchPlan, StepOutput


class ThreadRecorder:
    def __init__(self) -> None:
        self.built_on = threading.get_ident()
        self.ran_on: list[int] = []

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.ran_on.append(threading.get_ident())
        return StepOutput(plan.step_id, {}, {})


def test_build_and_every_step_share_one_thread_off_the_event_loop() -> None:
    async def scenario() -> tuple[ThreadRecorder, int]:
        executor = await ThreadedExecutor.on_its_thread(ThreadRecorder)
        for step in range(3):
            await executor.execute(BatchPlan(step, ()))
        await executor.shutdown()
        assert isinstance(executor.sync, ThreadRecorder)
        return executor.sync, threading.get_ident()

    recorder, loop_thread = asyncio.run(scenario())
    assert recorder.ran_on == [recorder.built_on] * 3
    assert recorder.built_on != loop_thread


def test_a_failing_build_raises_and_leaves_no_thread_behind() -> None:
    def broken() -> ThreadRecorder:
        raise RuntimeError("weights missing")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="weights missing"):
        asyncio.run(ThreadedExecutor.on_its_thread(broken))
    # The pool's worker exits once shut down (no wait was asked: give it a moment).
    for _ in range(100):
        if not {t.name for t in threading.enumerate()} - before:
            break
        threading.Event().wait(0.01)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("engine-step")} - before
