"""Discrete-event replay of a workload through the real ``Scheduler`` and ``KVCacheManager``.

Owns the event loop and what it observes. It drives the server's own ``EngineCore`` on a
``VirtualClock``: arrivals are ``add``ed at their arrival time; whenever fewer than ``pp`` plans
are in flight the loop takes the step's first half (``schedule``) and hands the plan to
``SimPipeline`` (the cost model), and at each plan's completion it applies the second half
(``update``) — the engine loop of DESIGN.md with simulated time, and the very objects the
server runs (no copies of their logic; no Ray, no torch).

Output lengths are fixed (``ignore_eos`` semantics): every entry emits a fake token and the
scheduler finishes the job at ``max_tokens`` = the request's output length. Observed per request:
arrival, every token time, end, and the scheduler's own accounting (queueing, execution,
swap-blocked seconds) as ``fastserve.bench.metrics.RequestRecord``; device/host KV blocks in use over
time (Figure 8) and the scheduler's counters.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from fastserve.bench.metrics import STATUS_OK, RequestRecord
from fastserve.bench.sim.cost import CostModel
from fastserve.bench.sim.pipeline import SimPipeline
from fastserve.bench.workloads import BOS_TOKEN_ID, Request
from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.scheduler.config import EngineConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.job import JobRequest, JobStats, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import AdmissionQueueFull, Scheduler
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput

#: OPT's end-of-sequence id (``</s>``, the same id as BOS).
OPT_EOS_TOKEN_ID = BOS_TOKEN_ID
#: The id every simulated step "samples": an ordinary token, never EOS (ignore_eos anyway).
FAKE_TOKEN_ID = 4
STATUS_REJECTED = "rejected"     # the scheduler refused it (too large for the pool, queue full)
STATUS_UNFINISHED = "unfinished"  # still running when the simulated time limit was reached
STATUS_ERROR = "error"
#: Consecutive idle polls with work queued but nothing runnable before the loop gives up.
MAX_IDLE_POLLS = 100_000


class SimStalled(RuntimeError):
    """Jobs remain but the scheduler would run nothing, and no time-driven rule freed it."""


@dataclass(frozen=True)
class SimOptions:
    eos_token_ids: frozenset[int] = frozenset({OPT_EOS_TOKEN_ID})
    token_id: int = FAKE_TOKEN_ID
    #: Re-ask the scheduler this often when it is idle with work queued (the engine's idle poll).
    idle_poll_s: float = EngineConfig().idle_poll_s
    #: Stop replaying at this simulated time; requests not done are "unfinished".
    max_sim_time_s: float = math.inf
    #: Run the scheduler's integrity check after every update (tests; O(blocks) per step).
    check_invariants: bool = False


@dataclass
class KVTimeline:
    """Blocks in use after every change: (time, device blocks used, host blocks used)."""

    bytes_per_block: int
    device_capacity: int
    host_capacity: int
    points: list[tuple[float, int, int]] = field(default_factory=list)

    def observe(self, now: float, device_used: int, host_used: int) -> None:
        last = self.points[-1] if self.points else None
        if last is not None and last[1:] == (device_used, host_used):
            return
        if last is not None and last[0] == now:
            self.points[-1] = (now, device_used, host_used)
        else:
            self.points.append((now, device_used, host_used))

    @property
    def peak_device_blocks(self) -> int:
        return max((p[1] for p in self.points), default=0)

    @property
    def peak_host_blocks(self) -> int:
        return max((p[2] for p in self.points), default=0)


@dataclass
class SimResult:
    requests: list[Request]
    records: list[RequestRecord]          # same order as ``requests``
    completion_order: list[str]           # request ids in the order they finished
    kv: KVTimeline
    stats: dict[str, JobStats]            # scheduler accounting of every finished job
    totals: dict[str, int]
    makespan_s: float
    steps: int
    busy_compute_s: float
    busy_pcie_s: float
    wall_s: float

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.requests), "steps": self.steps, "makespan_s": self.makespan_s,
                "peak_device_blocks": self.kv.peak_device_blocks,
                "peak_host_blocks": self.kv.peak_host_blocks, "totals": dict(self.totals),
                "wall_s": self.wall_s}


@dataclass
class _Trace:
    """What the loop saw of one request."""

    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    status: str = STATUS_UNFINISHED


@dataclass
class _RunState:
    """The event loop's state during one ``Simulator.run``."""

    requests: list[Request]
    timeline: KVTimeline
    traces: dict[str, _Trace] = field(init=False)
    inflight: list[tuple[float, int, BatchPlan, StepOutput]] = field(default_factory=list)  # heap by completion
    order: list[str] = field(default_factory=list)
    stats: dict[str, JobStats] = field(default_factory=dict)
    seq: Iterator[int] = field(default_factory=count)
    next_request: int = 0
    idle_polls: int = 0

    def __post_init__(self) -> None:
        self.traces = {r.request_id: _Trace() for r in self.requests}


class Simulator:
    """One replay: a fresh ``Scheduler`` and pipeline; call ``run`` once per instance."""

    def __init__(self, cost: CostModel, scheduler_config: SchedulerConfig, kv_config: KVCacheConfig,
                 options: SimOptions | None = None, scheduler_profile: Profile | None = None) -> None:
        """``scheduler_profile``: what the scheduler believes (skip-join levels, quanta), when it
        differs from the simulated hardware ``cost`` (profiling-error studies, tests)."""
        self.cost = cost
        self.options = options or SimOptions()
        self.scheduler = Scheduler(scheduler_config, kv_config, scheduler_profile or cost.profile,
                                   self.options.eos_token_ids)
        self.clock = VirtualClock()
        self.core = EngineCore(self.scheduler, self.clock,
                               check_invariants=self.options.check_invariants)
        self.pipeline = SimPipeline(cost, self.options.token_id)
        self._fillers: dict[int, tuple[int, ...]] = {}
        # Every prompt's second token is its own, so no two requests share a KV block: with the
        # prefix cache on, identical synthetic prompts would all hit one cached prefix.
        self._prompt_tags = count(max(BOS_TOKEN_ID, OPT_EOS_TOKEN_ID, self.options.token_id) + 1)

    def _prompt(self, n: int) -> tuple[int, ...]:
        """A prompt of n tokens no other request of this run shares a block with."""
        if n <= 1:
            return (BOS_TOKEN_ID,)[:n]
        if n not in self._fillers:
            self._fillers[n] = (self.options.token_id,) * (n - 2)
        return (BOS_TOKEN_ID, next(self._prompt_tags)) + self._fillers[n]

    def run(self, requests: Sequence[Request]) -> SimResult:
        started = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        state = _RunState(reqs, KVTimeline(self.cost.profile.swap_bytes_per_block, self.scheduler.kv.device.capacity,
                                           self.scheduler.kv.host.capacity))
        while True:
            self._admit(state)
            self._dispatch(state)
            self._observe(state.timeline)
            upcoming, is_completion = self._next_event(state)
            if upcoming is None or upcoming > self.options.max_sim_time_s:
                break
            self.clock.now = upcoming
            if is_completion:
                self._complete(state)
        records = [_record(r, state.traces[r.request_id], state.stats.get(r.request_id)) for r in reqs]
        return SimResult(reqs, records, state.order, state.timeline, state.stats, dict(self.scheduler.totals),
                         self.clock.now, self.core.steps, self.pipeline.busy_compute_s,
                         self.pipeline.busy_pcie_s, time.perf_counter() - started)

    def _admit(self, state: _RunState) -> None:
        reqs = state.requests
        while state.next_request < len(reqs) and reqs[state.next_request].arrival_s <= self.clock.now:
            self._add(reqs[state.next_request], state.traces)
            state.next_request += 1

    def _dispatch(self, state: _RunState) -> None:
        """Fill the pipeline: up to ``pp`` plans in flight (one in process)."""
        while self.scheduler.num_inflight() < self.cost.stages:
            plan = self.core.schedule()
            if plan is None:
                return
            done = self.pipeline.dispatch(plan, self.clock.now)
            heapq.heappush(state.inflight, (done.completion, next(state.seq), plan, done.output))

    def _next_event(self, state: _RunState) -> tuple[float | None, bool]:
        """(time of the next event, whether it is a plan completion); None when all is done."""
        reqs = state.requests
        next_arrival = reqs[state.next_request].arrival_s if state.next_request < len(reqs) else math.inf
        next_done = state.inflight[0][0] if state.inflight else math.inf
        if math.isinf(next_arrival) and math.isinf(next_done):
            if not self.scheduler.has_work():
                return None, False
            state.idle_polls += 1
            if state.idle_polls > MAX_IDLE_POLLS:
                raise SimStalled(f"{len(self.scheduler.jobs())} jobs left at t={self.clock.now:.3f}s, "
                                 "nothing runs")
            next_arrival = self.clock.now + self.options.idle_poll_s
        return min(next_arrival, next_done), next_done <= next_arrival

    def _complete(self, state: _RunState) -> None:
        state.idle_polls = 0
        _, _, plan, output = heapq.heappop(state.inflight)
        self._apply(self.core.update(plan, output).deltas, state.traces, state.order)
        for st in self.scheduler.drain_finished():
            state.stats[st.job_id] = st
        self._observe(state.timeline)

    def _add(self, req: Request, traces: dict[str, _Trace]) -> None:
        sampling = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        try:
            self.core.add(JobRequest(req.request_id, self._prompt(req.prompt_len), sampling,
                                     req.arrival_s))
        except (ValueError, AdmissionQueueFull):
            traces[req.request_id].status = STATUS_REJECTED

    def _apply(self, deltas: list[TokenDelta], traces: dict[str, _Trace], order: list[str]) -> None:
        now = self.clock.now
        for d in deltas:
            trace = traces[d.job_id]
            if d.token_id is not None:
                trace.token_times.append(now)
            if d.finished:
                trace.end = now
                trace.status = STATUS_OK if d.finish_reason in ("length", "stop") else STATUS_ERROR
                order.append(d.job_id)

    def _observe(self, timeline: KVTimeline) -> None:
        kv = self.scheduler.kv
        timeline.observe(self.clock.now, kv.device.capacity - kv.num_free_device, kv.host.capacity - kv.num_free_host)


def _record(req: Request, trace: _Trace, st: JobStats | None) -> RequestRecord:
    times = tuple(trace.token_times)
    return RequestRecord(
        arrival=req.arrival_s,
        first_token=times[0] if times else None,
        end=trace.end,
        output_tokens=len(times),
        status=trace.status,
        token_times=times,
        queue_s=None if st is None else st.queueing_s,
        exec_s=None if st is None else st.execution_s,
        swap_s=None if st is None else st.swap_blocked_s,
    )
