"""The engine core: one model copy's step, schedule → execute → update, synchronous.

``EngineCore`` owns the step and nothing around it: a ``Scheduler`` (what runs next, and what
each result means for its jobs) and the clock the step reads. Every caller drives this one core:

- ``step(executor)`` is the whole step, for a caller that runs one plan at a time (the
  scheduler's tests, ``fastserve.bench.bench_scheduler``);
- ``schedule()`` and ``update(plan, output)`` / ``fail(plan)`` are the same step in its two
  halves, for a caller that keeps several plans in flight between them: the server's
  ``AsyncEngine`` (it awaits an executor that may be a P-stage pipeline) and the simulator (it
  prices plans on simulated stages).

Structured outputs (``fastserve.structured``): the core holds each constrained job's grammar
state (``JobGrammars``), as vLLM v1's engine core holds its ``StructuredOutputManager``: a job's
state is made when it is added, each plan leaves ``schedule`` with the grammar mask of every
constrained row that samples, every token ``update`` gives a job advances its state, and a job
that ends (finished, failed, aborted) drops it.

What wraps the step lives with those callers, not here: the server's delivery, watchdog, step
statistics and recovery (``fastserve.engine.async_engine``), the simulator's observations. As vLLM's
``EngineCore.step`` and nano-vllm's ``LLMEngine.step`` are, it is the one place where a plan's
output becomes tokens. Imports no torch, no ray and no asyncio.
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

#: Seconds, monotonic: wall time in the server, simulated time in the simulator and the tests.
Clock = Callable[[], float]


class SyncExecutor(Protocol):
    """Runs one plan to its output (the in-process model, a cost model, a test's script)."""

    def execute(self, plan: BatchPlan) -> StepOutput: ...


@dataclass(frozen=True)
class StepResult:
    """One finished step: its plan, what the executor returned (None: the step failed, and its
    jobs ended with ``error``), and the tokens and finishes it produced, per job."""

    plan: BatchPlan
    output: StepOutput | None
    deltas: list[TokenDelta]


class VirtualClock:
    """A clock the caller moves: simulated time, or a test's exact instants."""

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
        """``check_invariants``: verify the scheduler's and KV manager's state after each half
        of every step (tests and simulator checks; costs O(blocks) a step). ``grammars``: the
        constrained jobs' grammar state (None: a request with a constraint is refused)."""
        self.scheduler = scheduler
        self.clock = clock
        self.check_invariants = check_invariants
        self.grammars = grammars

    # ---- requests ------------------------------------------------------------------------
    def add(self, req: JobRequest) -> Job:
        """Queue a request (raises ``InvalidRequest`` or ``AdmissionQueueFull`` at once). A
        constraint not compiled yet is compiled here, on the caller's thread (the server's
        engine compiles it beforehand, off its loop: ``AsyncEngine.prepare``)."""
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
        """Plans scheduled so far (the scheduler counts them; read here, not kept twice)."""
        return self.scheduler.totals["steps"]

    # ---- the step ------------------------------------------------------------------------
    def step(self, executor: SyncExecutor) -> StepResult | None:
        """Schedule one plan, run it on ``executor``, apply its output. None: nothing to run
        now. A plan that raises fails its own jobs (``finish_reason="error"``), not the caller."""
        plan = self.schedule()
        if plan is None:
            return None
        try:
            output = executor.execute(plan)
        except Exception:
            return self.fail(plan)
        return self.update(plan, output)

    def schedule(self) -> BatchPlan | None:
        """The step's first half: the next plan, or None when nothing can run now."""
        plan = self.scheduler.schedule(self.clock())
        if plan is None:
            return None
        self._check()
        return plan if self.grammars is None else self.grammars.with_masks(plan)

    def update(self, plan: BatchPlan, output: StepOutput) -> StepResult:
        """The step's second half: ``plan``'s output applied (tokens, finishes, quanta)."""
        result = StepResult(plan, output, self.scheduler.update(plan, output, self.clock()))
        self._advance_grammars(result.deltas)
        self._check()
        return result

    def fail(self, plan: BatchPlan) -> StepResult:
        """The second half of a step whose execution failed: its jobs end with ``error``."""
        result = StepResult(plan, None, self.scheduler.fail(plan, self.clock()))
        self._advance_grammars(result.deltas)
        self._check()
        return result

    def _advance_grammars(self, deltas: Sequence[TokenDelta]) -> None:
        """Each constrained job's grammar takes the tokens it was given; an ended job's goes."""
        grammars = self.grammars
        if grammars is None or not len(grammars):
            return
        for delta in deltas:
            if delta.finished:
                grammars.drop(delta.job_id)
            elif delta.token_ids:
                grammars.advance(delta.job_id, delta.token_ids)

    # ---- a lost data plane ---------------------------------------------------------------
    def lose_all_kv(self, plans: Sequence[BatchPlan]) -> None:
        """Every worker's KV is gone; ``plans`` (in flight) did nothing; every job recomputes."""
        self.scheduler.lose_all_kv(list(plans))

    def fail_all(self) -> list[TokenDelta]:
        """End every job with ``error`` (the data plane could not be rebuilt)."""
        if self.grammars is not None:
            self.grammars.clear()
        return self.scheduler.fail_all(self.clock())

    def _check(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants()
