"""The pipeline tests' plan driver and reference runs (tiny OPT; in-process and Ray pipeline).

``PlanDriver`` produces plans from two alternating job groups with free-list blocks, swapping a
job to the host when its group needs room and back when room returns; blocks a plan frees are
reused two plans later, so the in-process and pipelined runs see the very same ``BatchPlan``s.
``in_process_run`` / ``pipeline_run`` run them; ``wait_no_live_actors`` checks a clean shutdown.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from fastserve.worker import messages
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, StepOutput, SwapCommand
from fastserve.worker.model.config import ModelConfig
from fastserve.worker.pipeline import PipelineExecutor
from fastserve.worker.spec import EngineSpec, ModelSpec, ParallelSpec, PipelineTimeouts
from fastserve.worker.worker import StepRecord
from tests.harness import tiny_jobs
from tests.harness.tiny_jobs import BLOCK_SIZE, HOST_POOL, SEED, SMALL_DEVICE_POOL, TINY

#: The first 6 jobs: 37 blocks at their longest, so SMALL_DEVICE_POOL (16) forces swaps.
PROMPTS = tiny_jobs.PROMPTS[:6]
MAX_TOKENS = tiny_jobs.MAX_TOKENS[:6]
LARGE_DEVICE_POOL = 64
#: Jobs alternate between groups and plans between groups: plan k and k+1 never share a job.
NUM_GROUPS = 2
#: Blocks freed by plan k are reused from plan k + RELEASE_LAG: it has returned by then (P <= 2).
RELEASE_LAG = NUM_GROUPS
#: A parked job comes back only if this many blocks stay free beyond its own (hysteresis).
SWAP_IN_MARGIN = 2
MAX_STEPS = 400
KILL_DEADLINE_S = 30.0
WORKER_THREADS = 1  # 2 cores, up to 4 workers: one torch thread each


def blocks_for(num_tokens: int) -> int:
    return messages.blocks_for(num_tokens, BLOCK_SIZE)


@dataclass
class PlanJob:
    job_id: str
    prompt: list[int]
    max_tokens: int
    group: int
    generated: list[int] = field(default_factory=list)
    scheduled: int = 0  # entries issued so far; each yields one token
    device_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    where: str = "new"  # new | device | host | done
    parked_at: int = -1

    @property
    def exhausted(self) -> bool:
        return self.scheduled >= self.max_tokens

    @property
    def next_context(self) -> int:
        """Tokens in the context once this job's next entry has run."""
        return len(self.prompt) + self.scheduled

    @property
    def growth(self) -> int:
        return max(0, blocks_for(self.next_context) - len(self.device_blocks))

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.scheduled


class PlanDriver:
    """Builds the plans (see the module docstring); checks block ownership after every plan."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.num_device_blocks, self.num_host_blocks = num_device_blocks, num_host_blocks
        self.free_device = list(range(num_device_blocks))
        self.free_host = list(range(num_host_blocks))
        self.pending: dict[int, tuple[list[int], list[int]]] = {}
        self.jobs: dict[str, PlanJob] = {}
        self.step_id = 0
        self.swaps: Counter[str] = Counter()

    def add(self, job_id: str, prompt: list[int], max_tokens: int) -> None:
        self.jobs[job_id] = PlanJob(job_id, list(prompt), max_tokens, len(self.jobs) % NUM_GROUPS)

    def has_work(self) -> bool:
        return any(not j.exhausted for j in self.jobs.values())

    def next_plan(self) -> BatchPlan:
        n = self.step_id
        self.step_id += 1
        assert n < MAX_STEPS, "the plan driver made no progress"
        self._release(n - RELEASE_LAG)
        group = [j for j in self.jobs.values() if j.group == n % NUM_GROUPS and not j.exhausted]
        for j in group:
            assert len(j.generated) == j.scheduled, f"{j.job_id}: its previous plan has not returned"
        freed: tuple[list[int], list[int]] = ([], [])
        self.pending[n] = freed
        running = [j for j in group if j.where == "device"]
        swap_out = self._make_room(running, n, freed[0])
        swap_in = self._swap_in_one(group, running, n, freed[1])
        running += self._admit([j for j in group if j.where == "new"], running)
        entries = tuple(self._entry(j, freed[0]) for j in running)
        self._check_blocks()
        return BatchPlan(n, entries, tuple(swap_out), tuple(swap_in))

    def complete(self, plan: BatchPlan, out: StepOutput) -> None:
        assert out.step_id == plan.step_id
        assert set(out.tokens) == {e.job_id for e in plan.entries}
        for job_id, token in out.tokens.items():
            self.jobs[job_id].generated.append(token)

    def _make_room(self, running: list[PlanJob], n: int, freed: list[int]) -> list[SwapCommand]:
        """Park the jobs with the most work left until the rest can grow this step."""
        out = []
        while running and len(self.free_device) < sum(j.growth for j in running):
            victim = max(running, key=lambda j: (j.remaining, j.job_id))
            running.remove(victim)
            host = self._take(self.free_host, len(victim.device_blocks))
            out.append(SwapCommand("out", victim.job_id, tuple(victim.device_blocks), tuple(host)))
            freed.extend(victim.device_blocks)
            victim.device_blocks, victim.host_blocks, victim.where = [], host, "host"
            victim.parked_at = n
            self.swaps["out"] += 1
        return out

    def _swap_in_one(self, group: list[PlanJob], running: list[PlanJob], n: int,
                     freed: list[int]) -> list[SwapCommand]:
        """Bring back the longest-parked job if it fits with room to spare; it runs next time."""
        parked = sorted((j for j in group if j.where == "host" and j.parked_at < n), key=lambda j: j.parked_at)
        spare = len(self.free_device) - sum(j.growth for j in running)
        for j in parked:
            if spare >= len(j.host_blocks) + SWAP_IN_MARGIN:
                dev = self._take(self.free_device, len(j.host_blocks))
                freed.extend(j.host_blocks)
                cmd = SwapCommand("in", j.job_id, tuple(j.host_blocks), tuple(dev))
                j.device_blocks, j.host_blocks, j.where = dev, [], "device"
                self.swaps["in"] += 1
                return [cmd]
        return []

    def _admit(self, new: list[PlanJob], running: list[PlanJob]) -> list[PlanJob]:
        admitted = []
        for j in new:
            if len(self.free_device) - sum(r.growth for r in running + admitted) >= j.growth:
                admitted.append(j)
        return admitted

    def _entry(self, j: PlanJob, freed: list[int]) -> BatchEntry:
        prefill = j.where == "new"
        j.device_blocks += self._take(self.free_device, j.growth)
        j.where = "device"
        tokens = tuple(j.prompt) if prefill else (j.generated[-1],)
        start = 0 if prefill else j.next_context - 1
        entry = BatchEntry(j.job_id, tokens, start, tuple(j.device_blocks), prefill,
                           SamplingParams(max_tokens=j.max_tokens, temperature=0.0, ignore_eos=True),
                           j.scheduled)
        j.scheduled += 1
        if j.exhausted:  # its blocks are free once this plan has returned
            freed.extend(j.device_blocks)
            j.device_blocks, j.where = [], "done"
        return entry

    def _release(self, step: int) -> None:
        device, host = self.pending.pop(step, ([], []))
        self.free_device += device
        self.free_host += host

    @staticmethod
    def _take(pool: list[int], n: int) -> list[int]:
        assert len(pool) >= n, f"need {n} blocks, {len(pool)} free"
        taken, pool[:] = pool[:n], pool[n:]
        return taken

    def _check_blocks(self) -> None:
        """Every block is free, pending release, or owned by exactly one job."""
        device = self.free_device + [b for d, _ in self.pending.values() for b in d]
        host = self.free_host + [b for _, h in self.pending.values() for b in h]
        for j in self.jobs.values():
            device += j.device_blocks
            host += j.host_blocks
        assert sorted(device) == list(range(self.num_device_blocks))
        assert sorted(host) == list(range(self.num_host_blocks))


def plan_jobs(plan: BatchPlan) -> set[str]:
    return {e.job_id for e in plan.entries} | {c.job_id for c in plan.swap_out + plan.swap_in}


@dataclass
class Run:
    plans: list[BatchPlan]
    tokens: list[dict[str, int]]
    generated: dict[str, list[int]]
    swaps: Counter[str]
    max_inflight_seen: int
    stats: list[dict[str, Any]] = field(default_factory=list)
    timeline: dict[tuple[int, int], list[StepRecord]] = field(default_factory=dict)


Execute = Callable[[BatchPlan], Awaitable[StepOutput]]


def new_driver(num_device_blocks: int) -> PlanDriver:
    driver = PlanDriver(num_device_blocks, HOST_POOL)
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        driver.add(f"job{i}", prompt, n)
    return driver


async def drive(execute: Execute, driver: PlanDriver, window: int) -> Run:
    """Keep up to ``window`` plans in flight until every job has all its tokens."""
    inflight: deque[tuple[BatchPlan, asyncio.Future[StepOutput]]] = deque()
    plans, tokens, most = [], [], 0
    while driver.has_work() or inflight:
        while driver.has_work() and len(inflight) < window:
            plan = driver.next_plan()
            busy = set().union(*(plan_jobs(p) for p, _ in inflight))
            assert not plan_jobs(plan) & busy, f"plan {plan.step_id} reuses in-flight jobs {plan_jobs(plan) & busy}"
            inflight.append((plan, asyncio.ensure_future(execute(plan))))
            plans.append(plan)
            most = max(most, len(inflight))
        plan, task = inflight.popleft()
        out = await task
        driver.complete(plan, out)
        tokens.append(out.tokens)
    generated = {j.job_id: j.generated for j in driver.jobs.values()}
    return Run(plans, tokens, generated, driver.swaps, most)


def in_process_run(num_device_blocks: int, config: ModelConfig = TINY) -> Run:
    """The reference: the same plans on one in-process executor."""
    ex = InProcessExecutor(ModelSpec(config, num_device_blocks, HOST_POOL, BLOCK_SIZE, seed=SEED))

    async def execute(plan: BatchPlan) -> StepOutput:
        return ex.execute(plan)

    try:
        return asyncio.run(drive(execute, new_driver(num_device_blocks), window=1))
    finally:
        ex.close()


def pipeline_spec(tp: int, pp: int, transport: str = "compiled",
                  num_device_blocks: int = SMALL_DEVICE_POOL, device: str = "cpu", **timeouts: Any) -> EngineSpec:
    return EngineSpec(ModelSpec(TINY, num_device_blocks, HOST_POOL, block_size=BLOCK_SIZE, device=device, seed=SEED,
                                torch_threads=WORKER_THREADS),
                      ParallelSpec(tp, pp, transport), PipelineTimeouts(**timeouts))


def live_actors() -> list[str]:
    """Class names of live actors. ``ray.util.state.list_actors`` needs the dashboard (off here);
    the GCS table behind ``ray._private.state`` answers without it."""
    return [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


def wait_dead(actor: ray.actor.ActorHandle, timeout_s: float = 10.0) -> None:
    """``ray.kill`` returns before the process is gone: wait until the GCS says it is dead."""
    actor_id = actor._actor_id.hex()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray._private.state.actors().get(actor_id, {}).get("State") == "DEAD":
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {actor_id} still alive {timeout_s} s after ray.kill")


def wait_no_live_actors(timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := live_actors()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


async def pipeline_run(spec: EngineSpec) -> Run:
    ex = PipelineExecutor(spec)
    await ex.start()
    try:
        run = await drive(ex.execute, new_driver(spec.model.num_device_blocks), ex.max_inflight)
        run.stats = await ex.stats()
        run.timeline = await ex.timeline()
    finally:
        await ex.shutdown()
    return run
