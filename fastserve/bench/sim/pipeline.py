"""The simulated data plane: pipeline stages and a PCIe link as timed resources.

When a plan completes: its swaps run on one link (FIFO, outs then ins, as the stage issues them)
beside compute; its forward waits only for same-plan swaps on its blocks, then visits each stage
(one plan at a time, compute / stages). The output returns at max(last stage, swaps) with the
executor's timing keys. Its tokens are the ``tokens`` executor's (a script, or a real model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fastserve.bench.sim.cost import CostModel
from fastserve.engine.core import SyncExecutor
from fastserve.worker.messages import BatchPlan, StepOutput

#: (job id, index of the token in the job's output) -> token id
TokenScript = Callable[[str, int], int]


def constant_tokens(token_id: int) -> TokenScript:
    return lambda job_id, index: token_id


class ScriptedTokens:
    """One token per sampling entry from ``script``; no timings (the caller prices the plan)."""

    def __init__(self, script: TokenScript) -> None:
        self.script = script

    def execute(self, plan: BatchPlan) -> StepOutput:
        return StepOutput(plan.step_id, {e.job_id: self.script(e.job_id, e.step_index)
                                         for e in plan.entries if e.samples})


@dataclass(frozen=True)
class Dispatch:

    completion: float
    output: StepOutput


class SimPipeline:
    """``stages`` (default: the profile's ``pp``) plans may be in flight at once."""

    def __init__(self, cost: CostModel, tokens: SyncExecutor, stages: int | None = None) -> None:
        self.cost = cost
        self.tokens = tokens
        self.stages = cost.stages if stages is None else stages
        if self.stages < 1:
            raise ValueError(f"a pipeline has at least one stage, got {self.stages}")
        self.stage_free = [0.0] * self.stages
        self.pcie_free = 0.0
        self.busy_compute_s = 0.0
        self.busy_pcie_s = 0.0

    def _swaps(self, plan: BatchPlan, now: float) -> tuple[float, float]:
        """Returns (swaps done, forward may start: after the swaps touching its blocks)."""
        used = {b for e in plan.entries for b in e.block_table}
        clock = max(now, self.pcie_free)
        reactive_ready = now
        for cmd in (*plan.swap_out, *plan.swap_in):
            seconds = self.cost.swap_seconds(len(cmd.src_blocks))
            clock += seconds
            self.busy_pcie_s += seconds
            device = cmd.src_blocks if cmd.direction == "out" else cmd.dst_blocks
            if used.intersection(device):
                reactive_ready = clock
        self.pcie_free = clock
        return clock, reactive_ready

    def dispatch(self, plan: BatchPlan, now: float) -> Dispatch:
        swaps_done, reactive_ready = self._swaps(plan, now)
        stage_time = self.cost.compute_seconds(plan) / self.stages if plan.entries else 0.0
        ready = max(now, self.stage_free[0])
        start = max(ready, reactive_ready)
        end = start
        if plan.entries:
            for k in range(self.stages):
                end = max(end, self.stage_free[k]) + stage_time
                self.stage_free[k] = end
            self.busy_compute_s += stage_time * self.stages
        completion = max(end, swaps_done)
        timings = {
            "swap_wait": start - ready,
            "forward": stage_time * self.stages,
            "sample": 0.0,
            "swap_tail": completion - end,
            "total": completion - ready,
        }
        return Dispatch(completion, replace(self.tokens.execute(plan), timings=timings))
