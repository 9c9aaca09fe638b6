"""Driving an engine step by step in tests, from either side of the ``BatchPlan``.

``CoreDriver`` is the one way a test runs the real control plane one plan at a time: a
``Scheduler`` inside an ``EngineCore`` on a virtual clock, each plan run by an executor (a real
model, or ``TimedScript``) and applied, the scheduler's invariants checked after each half. A
test says what arrives when, aborts, and what to check between steps; the step itself is not
written again in each test. (Paper-scale and property runs with simulated time go through the
simulator's loop: ``fastserve.bench.sim.driver.drive``.)

``Driver`` is the other side: a minimal hand-driven plan builder for exercising the executor
without the scheduler. It allocates blocks from simple free lists and lets a test swap a job out,
back in, or drop it for recomputation at chosen steps, so the data plane's tests can say exactly
which plan runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastserve.engine.core import EngineCore, SyncExecutor, VirtualClock
from fastserve.scheduler.job import Job, JobRequest, TokenDelta
from fastserve.scheduler.scheduler import Scheduler
from fastserve.structured import JobGrammars
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, StepOutput, SwapCommand, blocks_for

if TYPE_CHECKING:
    from fastserve.worker.executor import InProcessExecutor

#: (job id, index of the token in the job's output) -> token id
TokenScript = Callable[[str, int], int]


class TimedScript:
    """A scripted data plane: each sampling entry's token from ``script``, and the plan's
    ``total`` seconds (a number, or a function of the plan)."""

    def __init__(self, script: TokenScript, total: float | Callable[[BatchPlan], float]) -> None:
        self.script = script
        self.total = total

    def execute(self, plan: BatchPlan) -> StepOutput:
        total = self.total(plan) if callable(self.total) else self.total
        return StepOutput(plan.step_id, {e.job_id: self.script(e.job_id, e.step_index)
                                         for e in plan.entries if e.samples}, {"total": total})


class CoreDriver:
    """``scheduler`` driven one plan at a time through an ``EngineCore`` on a virtual clock.

    ``schedule`` takes the step's first half (the plan stays in flight); ``complete`` runs the
    oldest plan in flight on ``executor``, moves the clock by ``step_s`` (None: by the plan's
    reported ``total``) and applies its output; ``step`` is both. Every delta is kept, per job, in
    ``deltas``; every plan in ``plans``; the scheduler's invariants are checked after each half."""

    def __init__(self, scheduler: Scheduler, executor: SyncExecutor, *, step_s: float | None = 0.01,
                 now: float = 0.0, grammars: JobGrammars | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.step_s = step_s
        self.clock = VirtualClock(now)
        self.core = EngineCore(scheduler, self.clock, check_invariants=True, grammars=grammars)
        self.inflight: deque[BatchPlan] = deque()
        self.plans: list[BatchPlan] = []
        self.deltas: dict[str, list[TokenDelta]] = {}

    @property
    def now(self) -> float:
        return self.clock.now

    def tokens(self) -> dict[str, list[int]]:
        """Every job's tokens so far."""
        return {job: [t for d in ds for t in d.token_ids] for job, ds in self.deltas.items()}

    def add(self, req: JobRequest) -> Job:
        return self.core.add(req)

    def abort(self, job_id: str) -> None:
        self.core.abort(job_id)
        self.scheduler.check_invariants()

    def schedule(self) -> BatchPlan | None:
        plan = self.core.schedule()
        if plan is not None:
            self.inflight.append(plan)
            self.plans.append(plan)
        return plan

    def complete(self) -> list[TokenDelta]:
        plan = self.inflight.popleft()
        out = self.executor.execute(plan)
        self.clock.advance(out.timings["total"] if self.step_s is None else self.step_s)
        deltas = self.core.update(plan, out).deltas
        for d in deltas:
            self.deltas.setdefault(d.job_id, []).append(d)
        return deltas

    def step(self) -> BatchPlan | None:
        """One plan scheduled, run and applied; None (and the clock moved by ``step_s``) when
        nothing could run."""
        plan = self.schedule()
        if plan is None:
            self.clock.advance(self.step_s or 0.0)
            return None
        self.complete()
        return plan

    def run(self, arrivals: Mapping[int, Sequence[JobRequest]] | None = None,
            max_steps: int = 400) -> dict[str, list[int]]:
        """Steps until no work is left and every arrival came (``arrivals``: the step each
        request arrives at); every job's tokens."""
        arrivals = arrivals or {}
        last = max(arrivals, default=0)
        for k in range(max_steps):
            for req in arrivals.get(k, ()):
                self.add(req)
            if not self.scheduler.has_work() and k >= last:
                return self.tokens()
            self.step()
        raise AssertionError(f"work left after {max_steps} steps: {self.scheduler.stats()}")


@dataclass
class DriverJob:
    job_id: str
    prompt: list[int]
    sampling: SamplingParams
    generated: list[int] = field(default_factory=list)
    device_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    where: str = "new"  # new | device | host | dropped

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated


class Driver:
    def __init__(self, executor: InProcessExecutor) -> None:
        self.ex = executor
        self.bs = executor.kv.block_size
        self.free_device = list(range(executor.kv.num_device_blocks))
        self.free_host = list(range(executor.kv.num_host_blocks))
        self.jobs: dict[str, DriverJob] = {}
        self.step_id = 0
        self.swaps = {"out": 0, "in": 0}

    def add(self, job_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.jobs[job_id] = DriverJob(job_id, list(prompt), sampling)

    def _blocks_for(self, n_tokens: int) -> int:
        return blocks_for(n_tokens, self.bs)

    def _take(self, pool: list[int], n: int) -> list[int]:
        assert len(pool) >= n, "test pool too small"
        taken, pool[:] = pool[:n], pool[n:]
        return taken

    def swap_out(self, job_id: str) -> SwapCommand:
        job = self.jobs[job_id]
        host = self._take(self.free_host, len(job.device_blocks))
        cmd = SwapCommand("out", job_id, tuple(job.device_blocks), tuple(host))
        self.free_device.extend(job.device_blocks)  # the test reuses them only after the step
        job.device_blocks, job.host_blocks, job.where = [], host, "host"
        self.swaps["out"] += 1
        return cmd

    def swap_in(self, job_id: str) -> SwapCommand:
        job = self.jobs[job_id]
        dev = self._take(self.free_device, len(job.host_blocks))
        cmd = SwapCommand("in", job_id, tuple(job.host_blocks), tuple(dev))
        self.free_host.extend(job.host_blocks)
        job.device_blocks, job.host_blocks, job.where = dev, [], "device"
        self.swaps["in"] += 1
        return cmd

    def drop(self, job_id: str) -> None:
        job = self.jobs[job_id]
        self.free_device.extend(job.device_blocks)
        job.device_blocks, job.where = [], "dropped"

    def _entry(self, job: DriverJob) -> BatchEntry:
        prefill = job.where in ("new", "dropped")
        ctx = job.context
        need = self._blocks_for(len(ctx))
        if prefill:
            job.device_blocks = self._take(self.free_device, need)
        elif need > len(job.device_blocks):
            job.device_blocks += self._take(self.free_device, need - len(job.device_blocks))
        job.where = "device"
        tokens = tuple(ctx) if prefill else (ctx[-1],)
        start = 0 if prefill else len(ctx) - 1
        return BatchEntry(job.job_id, tokens, start, tuple(job.device_blocks), prefill,
                          job.sampling, len(job.generated))

    def step(self, run: list[str], swap_out: tuple[SwapCommand, ...] = (),
             swap_in: tuple[SwapCommand, ...] = ()) -> dict[str, int]:
        entries = tuple(self._entry(self.jobs[j]) for j in run)
        plan = BatchPlan(self.step_id, entries, swap_out, swap_in)
        self.step_id += 1
        out = self.ex.execute(plan)
        for j, tok in out.tokens.items():
            self.jobs[j].generated.append(tok)
        return out.tokens
