"""The engine core: one model copy's step, schedule → execute → update, synchronous.

``EngineCore`` owns the step (a ``Scheduler``, the clock, each constrained job's grammar state):
``step`` whole for one plan at a time, or ``schedule`` and ``update``/``fail`` for callers that
keep several plans in flight (``AsyncEngine``, the simulator). As vLLM's ``EngineCore.step``, the
one place a plan's output becomes tokens. Imports no torch, ray or asyncio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fastserve.errors import InvalidRequest
from fastserve.scheduler.job import Job, JobRequest, TokenDelta
from fastserve.scheduler.scheduler import Scheduler
from fastserve.structured import GrammarError, JobGrammars
from fastserve.worker.messages import BatchPlan, StepOutput

#: Seconds, monotonic: wall time in the server, simulated time elsewhere.
Clock = Callable[[], float]


class SyncExecutor(Protocol):
    def execute(self, plan: BatchPlan) -> StepOutput: ...


@dataclass(frozen=True)
class StepResult:
    """One finished step: its plan, the executor's output (None: failed), and its deltas."""

    plan: BatchPlan
    output: StepOutput | None
    deltas: list[TokenDelta]


class VirtualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back {seconds!r} s")
        self.now += seconds


class EngineCore:
    def __init__(self, scheduler: Scheduler, clock: Clock = time.monotonic, *,
                 check_invariants: bool = False, grammars: JobGrammars | None = None) -> None:
        """``check_invariants`` costs O(blocks) a step; without ``grammars`` a constraint is refused."""
        self.scheduler = scheduler
        self.clock = clock
        self.check_invariants = check_invariants
        self.grammars = grammars

    def add(self, req: JobRequest) -> Job:
        """Queue a request, or raise ``InvalidRequest``/``AdmissionQueueFull``; compiles its
        constraint if not yet compiled."""
        constraint = req.sampling.constraint
        if constraint is not None:
            if self.grammars is None:
                raise InvalidRequest(f"job {req.job_id}: structured outputs are not available on this engine "
                                     "(it was built without the model's tokenizer)")
            if req.job_id in self.grammars:
                raise InvalidRequest(f"job id {req.job_id!r} is already queued")
            try:
                self.grammars.add(req.job_id, constraint)
            except GrammarError as exc:
                raise InvalidRequest(str(exc)) from None
        try:
            return self.scheduler.add(req, self.clock())
        except Exception:
            if constraint is not None and self.grammars is not None:
                self.grammars.drop(req.job_id)
            raise

    def abort(self, job_id: str) -> None:
        self.scheduler.abort(job_id, self.clock())
        if self.grammars is not None:
            self.grammars.drop(job_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def steps(self) -> int:
        return self.scheduler.totals["steps"]

    def step(self, executor: SyncExecutor) -> StepResult | None:
        """One whole step; None: nothing to run. A plan that raises fails its own jobs only."""
        plan = self.schedule()
        if plan is None:
            return None
        try:
            output = executor.execute(plan)
        except Exception:
            return self.fail(plan)
        return self.update(plan, output)

    def schedule(self) -> BatchPlan | None:
        plan = self.scheduler.schedule(self.clock())
        if plan is None:
            return None
        self._check()
        return plan if self.grammars is None else self.grammars.with_masks(plan)

    def update(self, plan: BatchPlan, output: StepOutput) -> StepResult:
        result = StepResult(plan, output, self.scheduler.update(plan, output, self.clock()))
        self._advance_grammars(result.deltas)
        self._check()
        return result

    def fail(self, plan: BatchPlan) -> StepResult:
        result = StepResult(plan, None, self.scheduler.fail(plan, self.clock()))
        self._advance_grammars(result.deltas)
        self._check()
        return result

    def _advance_grammars(self, deltas: Sequence[TokenDelta]) -> None:
        grammars = self.grammars
        if grammars is None or not len(grammars):
            return
        for delta in deltas:
            if delta.finished:
                grammars.drop(delta.job_id)
            elif delta.token_ids:
                grammars.advance(delta.job_id, delta.token_ids)

    def lose_all_kv(self, plans: Sequence[BatchPlan]) -> None:
        """Every worker's KV is gone and ``plans`` did nothing: every job recomputes."""
        self.scheduler.lose_all_kv(list(plans))

    def fail_all(self) -> list[TokenDelta]:
        """End every job with ``error`` (the data plane could not be rebuilt)."""
        if self.grammars is not None:
            self.grammars.clear()
        return self.scheduler.fail_all(self.clock())

    def _check(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants()
