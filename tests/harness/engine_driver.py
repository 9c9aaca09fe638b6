"""A minimal hand-driven plan builder for exercising the executor without the scheduler.

It allocates blocks from simple free lists and lets a test swap a job out, back in, or drop it
for recomputation at chosen steps. The real control plane (``fastserve/kv``, ``fastserve/scheduler``) is
tested separately; this exists so the data plane's tests can say exactly which plan runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, SwapCommand, blocks_for


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
