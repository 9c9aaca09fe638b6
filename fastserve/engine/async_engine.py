"""The server's engine: ``EngineCore``'s step driven on asyncio, streaming ``TokenDelta``s per job.

``AsyncEngine`` owns what wraps the step in a server: where each job's deltas go, the plans in
flight (up to ``executor.max_inflight``), the watchdog, step statistics, and failures (a failing
plan fails only its jobs; a lost executor is rebuilt and its jobs recompute). Imports no torch or ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from fastserve.engine.core import Clock, EngineCore, SyncExecutor
from fastserve.engine.request_timing import RequestTimer
from fastserve.engine.step_stats import StepKind, StepStats
from fastserve.errors import AdmissionQueueFull, EngineUnavailable, InvalidRequest
from fastserve.scheduler.config import EngineConfig
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.scheduler import Scheduler
from fastserve.structured import GrammarError, JobGrammars
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs plans. ``max_inflight`` plans may be outstanding at once."""

    @property
    def max_inflight(self) -> int: ...

    async def execute(self, plan: BatchPlan) -> StepOutput: ...

    async def shutdown(self) -> None: ...


class ThreadedExecutor:
    """A synchronous ``execute(plan)`` on one worker thread, so the loop keeps streaming. Build the
    model with ``on_its_thread``: a second torch thread is a second OpenMP team (docs/facts.md)."""

    max_inflight = 1

    def __init__(self, sync_executor: SyncExecutor, pool: ThreadPoolExecutor | None = None) -> None:
        self.sync = sync_executor
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    @classmethod
    async def on_its_thread(cls, build: Callable[[], SyncExecutor]) -> ThreadedExecutor:
        """``build()`` run on the thread that will run every step, wrapped."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        try:
            sync = await asyncio.get_running_loop().run_in_executor(pool, build)
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(sync, pool)

    async def execute(self, plan: BatchPlan) -> StepOutput:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.sync.execute, plan)

    async def shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.shutdown, True)
        close = getattr(self.sync, "close", None)
        if callable(close):
            close()


class DeltaSink(Protocol):
    def put_nowait(self, delta: TokenDelta) -> None: ...


class RequestStream:
    """Async iterator of one job's ``TokenDelta``s; ends after the finishing delta."""

    def __init__(self, job_id: str, queue: asyncio.Queue[TokenDelta]) -> None:
        self.job_id = job_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        self._done = delta.finished
        return delta

    def ready(self) -> list[TokenDelta]:
        """The deltas already queued, without waiting."""
        out: list[TokenDelta] = []
        while not self._done and not self._queue.empty():
            delta = self._queue.get_nowait()
            self._done = delta.finished
            out.append(delta)
        return out


@dataclass(frozen=True)
class _Submitted:
    plan: BatchPlan
    at: float                    # perf_counter at submission
    schedule_s: float
    busy_since: float | None     # end of the step it ran back to back with (None: idle before)


ExecutorFactory = Callable[[], Awaitable[Executor]]


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, executor: Executor,
                 clock: Clock = time.monotonic,
                 config: EngineConfig | None = None,
                 rebuild: ExecutorFactory | None = None,
                 grammars: JobGrammars | None = None) -> None:
        self.core = EngineCore(scheduler, clock, grammars=grammars)
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.executor = executor
        self._rebuild = rebuild
        self._lost: list[BatchPlan] = []
        self._recovering_since: float | None = None
        self.rebuilds = 0
        self.last_rebuild_s: float | None = None
        self.config = config or EngineConfig()
        self._sinks: dict[str, DeltaSink] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: dict[asyncio.Task[StepOutput], _Submitted] = {}
        self.plans_failed = 0
        self.step_stats = StepStats()
        self.timing = RequestTimer()
        self._pass = 0                           # to tell back-to-back steps
        self._last_finish: tuple[int, float] | None = None   # (pass, time) of the last result
        self._last_progress = time.perf_counter()   # a step finished, or the engine went idle

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def clock(self) -> Clock:
        return self.core.clock

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.scheduler.eos_token_ids

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def recovering(self) -> bool:
        return self._recovering_since is not None

    def health(self) -> str | None:
        """None when healthy, else why not: the loop is not running, or work is pending and no
        step has finished for ``watchdog_s`` (a stuck step)."""
        if not self.running:
            return "the engine loop is not running"
        if self.recovering:   # bounded by rebuild_deadline_s
            return None
        stalled = time.perf_counter() - self._last_progress
        if (self._inflight or self.core.has_work()) and stalled > self.config.watchdog_s:
            return (f"no step finished for {stalled:.0f} s with work pending "
                    f"(engine.watchdog_s={self.config.watchdog_s:g})")
        return None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Stop the loop, wait for in-flight plans, end every open stream with ``abort``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # A loop that died has logged why and failed its streams already.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._inflight:
            # Settle what is in flight so blocks and jobs stay consistent; bounded by stop_timeout_s.
            _, stuck = await asyncio.wait(self._inflight, timeout=self.config.stop_timeout_s)
            for step_task in stuck:
                step_task.cancel()
            await asyncio.gather(*self._inflight, return_exceptions=True)
            for step_task, step in list(self._inflight.items()):
                self._finish(step_task, step)
            self._inflight.clear()
        for job_id in list(self._sinks):
            self.abort(job_id)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        await self.executor.shutdown()

    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                    job_id: str | None = None, arrival: float | None = None,
                    priority: int = 0) -> RequestStream:
        job_id = job_id if job_id is not None else f"job-{next(self._ids)}"
        return self.submit(JobRequest(job_id, tuple(prompt_ids), sampling, arrival, priority))

    async def prepare(self, req: JobRequest) -> None:
        """Compile the request's constraint off the loop, within ``compile_timeout_s``, else
        ``InvalidRequest``."""
        constraint = req.sampling.constraint
        grammars = self.core.grammars
        if constraint is None or grammars is None or grammars.compiler.cached(constraint):
            return
        timeout = self.config.structured_outputs.compile_timeout_s
        compiling = asyncio.get_running_loop().run_in_executor(self._compile_pool, grammars.compiler.compile,
                                                                 constraint)
        try:
            await asyncio.wait_for(compiling, timeout)
        except TimeoutError:
            raise InvalidRequest(f"the {constraint.kind} did not compile within {timeout:g} s "
                                 "(engine.structured_outputs.compile_timeout_s)") from None
        except GrammarError as exc:
            raise InvalidRequest(str(exc)) from None

    def submit(self, req: JobRequest) -> RequestStream:
        """Queue a request; its event stream, or a ``RequestError`` at once."""
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.submit_to(req, queue)
        return RequestStream(req.job_id, queue)

    def submit_to(self, req: JobRequest, sink: DeltaSink) -> None:
        """``submit``, with the job's deltas put into ``sink``."""
        if not self.running:
            raise EngineUnavailable("the engine loop is not running; the replica is being replaced")
        if len(self._sinks) >= self.config.max_jobs:
            raise AdmissionQueueFull(f"{len(self._sinks)} jobs already in this engine "
                                     f"(engine.max_jobs={self.config.max_jobs})")
        if not (self._inflight or self.core.has_work()):
            self._last_progress = time.perf_counter()   # the watchdog counts from the first work
        job = self.core.add(req)
        self.timing.added(req.job_id, job.arrival, job.prompt_len)
        self._sinks[req.job_id] = sink
        self._wake.set()

    def abort(self, job_id: str) -> None:
        sink = self._sinks.pop(job_id, None)
        self.timing.forget(job_id)
        self.core.abort(job_id)
        if sink is not None:
            sink.put_nowait(TokenDelta.ended(job_id, "abort"))
        self._wake.set()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A scheduler bug must not leave callers waiting forever.
            log.exception("engine loop crashed; failing every open request")
            for job_id, sink in list(self._sinks.items()):
                sink.put_nowait(TokenDelta.ended(job_id, "error"))
            self._sinks.clear()
            self.timing = RequestTimer()
            raise

    async def _loop(self) -> None:
        while True:
            self._pass += 1
            if self._lost:
                await self._recover()
            self._submit()
            waiters: set[asyncio.Future[object]] = set(self._inflight)  # type: ignore[arg-type]
            wake = asyncio.ensure_future(self._wake.wait())
            waiters.add(wake)  # type: ignore[arg-type]
            timeout = None if self._inflight or not self.core.has_work() \
                else self.config.idle_poll_s
            try:
                done, _ = await asyncio.wait(waiters, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
            self._wake.clear()
            for task in [t for t in self._inflight if t in done]:
                self._finish(task, self._inflight.pop(task))

    def _submit(self) -> None:
        while len(self._inflight) < self.executor.max_inflight:
            started = time.perf_counter()
            plan = self.core.schedule()
            if plan is None:
                return
            self.timing.scheduled((e.job_id for e in plan.entries), self.clock())
            submitted = time.perf_counter()
            task = asyncio.ensure_future(self.executor.execute(plan))
            # A step submitted in the pass right after a result ran back to back with it.
            last = self._last_finish
            busy_since = last[1] if last is not None and last[0] == self._pass - 1 else None
            self._inflight[task] = _Submitted(plan, submitted, submitted - started, busy_since)

    def _finish(self, task: asyncio.Task[StepOutput], step: _Submitted) -> None:
        finished = time.perf_counter()
        plan, submitted, schedule_s, busy_since = step.plan, step.at, step.schedule_s, step.busy_since
        output: StepOutput | None = None
        try:
            output = task.result()
        except (Exception, asyncio.CancelledError):   # the step's failure, not the loop's
            if self._rebuild is not None and getattr(self.executor, "closed", False):
                # The executor itself is gone (a worker died): its jobs resume on a new one.
                log.warning("step %d lost with its executor; %d jobs will resume", plan.step_id,
                            len(plan.entries))
                self._lost.append(plan)
                return
            log.exception("step %d failed; failing its %d jobs", plan.step_id, len(plan.entries))
            self.plans_failed += 1
            result = self.core.fail(plan)
        else:
            result = self.core.update(plan, output)
        if output is not None and plan.entries:
            kind: StepKind = "mixed" if any(e.is_prefill for e in plan.entries) else "decode"
            self.step_stats.record(
                kind, len(plan.entries), sum(len(e.token_ids) for e in plan.entries), schedule_s,
                finished - submitted, time.perf_counter() - finished, output.timings,
                None if busy_since is None else finished - busy_since)
        self._last_finish = (self._pass, finished)
        self._last_progress = finished
        self._deliver(result.deltas)

    def _deliver(self, deltas: Sequence[TokenDelta]) -> None:
        self.timing.step(deltas, self.clock())
        for delta in deltas:
            sink = self._sinks.get(delta.job_id)
            if sink is None:
                continue
            sink.put_nowait(delta)
            if delta.finished:
                del self._sinks[delta.job_id]

    async def _recover(self) -> None:
        """Settle what was in flight, requeue every job for recompute, build a new executor; past
        ``rebuild_deadline_s`` every job errors and the loop stops (Serve replaces the replica)."""
        started = time.perf_counter()
        self._recovering_since = started
        if self._inflight:   # the rest of the lost executor's plans fail too
            await asyncio.gather(*self._inflight, return_exceptions=True)
            self._lost += [step.plan for step in self._inflight.values()]
            self._inflight.clear()
        log.warning("executor lost; rebuilding it, %d jobs resume by recompute", len(self._sinks))
        self.core.lose_all_kv(self._lost)
        self._lost.clear()
        with contextlib.suppress(Exception):
            await self.executor.shutdown()
        assert self._rebuild is not None
        deadline = started + self.config.rebuild_deadline_s
        while True:
            try:
                left = max(deadline - time.perf_counter(), 0.0)
                self.executor = await asyncio.wait_for(self._rebuild(), left)
                break
            except Exception as exc:   # a failed or overdue rebuild: retry until the deadline
                if time.perf_counter() + self.config.rebuild_retry_s >= deadline:
                    self._deliver(self.core.fail_all())
                    raise EngineUnavailable(
                        f"the executor could not be rebuilt within {self.config.rebuild_deadline_s:g} s "
                        f"(engine.rebuild_deadline_s): {exc!r}") from exc
                log.warning("rebuilding the executor failed (%r); retrying", exc)
                await asyncio.sleep(self.config.rebuild_retry_s)
        self.rebuilds += 1
        self.last_rebuild_s = time.perf_counter() - started
        self._recovering_since = None
        self._last_progress = time.perf_counter()
        log.warning("executor rebuilt in %.1f s; resuming", self.last_rebuild_s)
