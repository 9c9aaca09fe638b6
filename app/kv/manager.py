"""``KVCacheManager``: block tables and free lists of the two-tier paged KV cache.

The only holder of block tables. It allocates device blocks for first iterations and decode
growth, turns swap decisions into ``SwapCommand``s (device <-> host), drops KV for recompute, and
defers every release that an in-flight plan still touches: the blocks of a job used by an
in-flight step, and the source (and, on abort, the destination) of an uncompleted swap come back
to their free list only when that step completes (``complete``). Planners decide; this module
only does the bookkeeping, so ``check_invariants`` can prove every block is free, owned by
exactly one job, or in flight.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from actors.messages import SwapCommand, blocks_for
from app.kv.blocks import BlockPool, OutOfBlocks


class Tier(enum.Enum):
    NONE = "none"
    DEVICE = "device"
    HOST = "host"


class Residency(enum.Enum):
    NONE = "none"          # no KV
    RESIDENT = "resident"  # on the device, usable by the next plan
    HOST = "host"          # on the host, settled
    TRANSIT = "transit"    # a swap of it is in flight


@dataclass
class _JobKV:
    tier: Tier
    blocks: list[int]
    num_tokens: int                 # positions the table covers
    busy_step: int | None = None    # step whose entry uses these blocks
    swap_step: int | None = None    # step carrying an uncompleted swap of this job


@dataclass
class _StepReleases:
    """What one in-flight step holds of the KV cache, settled when it completes. (Which steps are
    in flight, and what they mean for their jobs, is the scheduler's ``SchedulerState.inflight``;
    the engine holds only the executor's tasks.)"""

    device: list[int] = field(default_factory=list)   # released when the step completes
    host: list[int] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)    # jobs whose swap settles with the step
    busy: list[str] = field(default_factory=list)     # jobs whose blocks the step's entries use


class PoolSizes(Protocol):
    """The sizes the manager is built from (``app.scheduler.config.KVCacheConfig`` has them;
    ``app/kv`` imports nothing from ``app/scheduler``)."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_device_blocks(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...


class KVCacheManager:
    def __init__(self, config: PoolSizes) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = BlockPool(config.num_device_blocks, "device")
        self.host = BlockPool(config.num_host_blocks, "host")
        self._jobs: dict[str, _JobKV] = {}
        self._steps: dict[int, _StepReleases] = {}
        self.device_releasing = 0   # device blocks that come back when in-flight steps complete
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    @property
    def num_free_device(self) -> int:
        return self.device.num_free

    @property
    def num_free_host(self) -> int:
        return self.host.num_free

    def tier(self, job_id: str) -> Tier:
        kv = self._jobs.get(job_id)
        return Tier.NONE if kv is None else kv.tier

    def residency(self, job_id: str) -> Residency:
        kv = self._jobs.get(job_id)
        if kv is None:
            return Residency.NONE
        if kv.swap_step is not None:
            return Residency.TRANSIT
        return Residency.RESIDENT if kv.tier is Tier.DEVICE else Residency.HOST

    def num_blocks(self, job_id: str) -> int:
        kv = self._jobs.get(job_id)
        return 0 if kv is None else len(kv.blocks)

    def num_tokens(self, job_id: str) -> int:
        kv = self._jobs.get(job_id)
        return 0 if kv is None else kv.num_tokens

    def block_table(self, job_id: str) -> tuple[int, ...]:
        kv = self._jobs.get(job_id)
        return () if kv is None else tuple(kv.blocks)

    def swap_step(self, job_id: str) -> int | None:
        kv = self._jobs.get(job_id)
        return None if kv is None else kv.swap_step

    def busy_step(self, job_id: str) -> int | None:
        kv = self._jobs.get(job_id)
        return None if kv is None else kv.busy_step

    def device_blocks_needed(self, job_id: str, num_tokens: int) -> int:
        """Device blocks a job still needs so its table covers ``num_tokens`` positions.

        For a job on the host this includes bringing its whole table back.
        """
        kv = self._jobs.get(job_id)
        want = self.blocks_for(num_tokens)
        if kv is None:
            return want
        if kv.tier is Tier.HOST:
            return max(want, len(kv.blocks))
        return max(want - len(kv.blocks), 0)

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, job_id: str, num_tokens: int, step: int) -> tuple[int, ...]:
        """Give a job device blocks for positions ``0..num_tokens-1`` and mark them in use by
        ``step``; returns its block table. First iterations, recomputes and decode growth."""
        kv = self._jobs.get(job_id)
        if kv is None:
            kv = self._jobs[job_id] = _JobKV(Tier.DEVICE, [], 0)
        if kv.tier is not Tier.DEVICE:
            raise ValueError(f"job {job_id}: KV is on {kv.tier.value}, cannot run on the device")
        if kv.swap_step is not None and kv.swap_step != step:
            raise ValueError(f"job {job_id}: KV still in transit (swap of step {kv.swap_step})")
        if kv.busy_step is not None:
            raise ValueError(f"job {job_id}: already used by in-flight step {kv.busy_step}")
        extra = self.blocks_for(num_tokens) - len(kv.blocks)
        if extra > 0:
            kv.blocks.extend(self.device.allocate(extra))
        kv.num_tokens = max(kv.num_tokens, num_tokens)
        kv.busy_step = step
        self._record(step).busy.append(job_id)
        return tuple(kv.blocks)

    def swap_out(self, job_id: str, step: int, reuse_now: bool = False) -> SwapCommand:
        """Move an idle resident job's KV to the host with ``step``; the device blocks are
        reusable once that step completes — or, with ``reuse_now`` (reactive preemption), by
        ``step`` itself: the data plane issues a plan's swaps before its forward, in order on
        one copy thread or stream, and the forward waits for swaps touching its blocks
        (``actors.stage.StageRunner``), so the copy reads them before anything overwrites them."""
        kv = self._settled(job_id, Tier.DEVICE)
        if len(kv.blocks) > self.host.num_free:
            raise OutOfBlocks(f"swap out {job_id}: {len(kv.blocks)} host blocks wanted, "
                              f"{self.host.num_free} free")
        dst = self.host.allocate(len(kv.blocks))
        src, kv.blocks, kv.tier, kv.swap_step = kv.blocks, dst, Tier.HOST, step
        rec = self._record(step)
        rec.swaps.append(job_id)
        if reuse_now:
            self.device.release(src)
        else:
            rec.device.extend(src)
            self.device_releasing += len(src)
        self.swapped_out_blocks += len(src)
        return SwapCommand("out", job_id, tuple(src), tuple(dst))

    def swap_in(self, job_id: str, step: int) -> SwapCommand:
        """Bring a host job's KV back to the device with ``step``; it is resident (usable by a
        later plan) once that step completes, or by an entry of ``step`` itself (reactive)."""
        kv = self._settled(job_id, Tier.HOST)
        if len(kv.blocks) > self.device.num_free:
            raise OutOfBlocks(f"swap in {job_id}: {len(kv.blocks)} device blocks wanted, "
                              f"{self.device.num_free} free")
        dst = self.device.allocate(len(kv.blocks))
        src, kv.blocks, kv.tier, kv.swap_step = kv.blocks, dst, Tier.DEVICE, step
        rec = self._record(step)
        rec.host.extend(src)
        rec.swaps.append(job_id)
        self.swapped_in_blocks += len(src)
        return SwapCommand("in", job_id, tuple(src), tuple(dst))

    def drop(self, job_id: str) -> int:
        """Recompute mode: forget an idle job's KV now (no in-flight step or swap touches it,
        so its blocks are reusable at once). Returns the blocks freed."""
        kv = self._jobs.get(job_id)
        if kv is None:
            return 0
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"drop {job_id}: its blocks are used by an in-flight step")
        del self._jobs[job_id]
        self._pool(kv.tier).release(kv.blocks)
        return len(kv.blocks)

    def free(self, job_id: str) -> None:
        """Release a finished or aborted job's KV; deferred while an in-flight step or swap
        still touches its blocks."""
        kv = self._jobs.pop(job_id, None)
        if kv is None:
            return
        pending = kv.swap_step if kv.swap_step is not None else kv.busy_step
        if pending is None:
            self._pool(kv.tier).release(kv.blocks)
            return
        rec = self._record(pending)
        if kv.tier is Tier.DEVICE:
            rec.device.extend(kv.blocks)
            self.device_releasing += len(kv.blocks)
        else:
            rec.host.extend(kv.blocks)
        for other in (kv.swap_step, kv.busy_step):
            if other is not None and other != pending:
                self._steps[other].busy = [j for j in self._steps[other].busy if j != job_id]
        rec.swaps = [j for j in rec.swaps if j != job_id]
        rec.busy = [j for j in rec.busy if j != job_id]

    # ---- completion ----------------------------------------------------------------------
    def complete(self, step: int) -> list[str]:
        """Step ``step`` finished on every worker: settle its swaps, release its deferred
        blocks. Returns the jobs whose swap settled (swapped in: now resident)."""
        rec = self._steps.pop(step, None)
        if rec is None:
            return []
        self.device.release(rec.device)
        self.device_releasing -= len(rec.device)
        self.host.release(rec.host)
        for job_id in rec.busy:
            kv = self._jobs.get(job_id)
            if kv is not None and kv.busy_step == step:
                kv.busy_step = None
        for job_id in rec.swaps:
            kv = self._jobs.get(job_id)
            if kv is not None and kv.swap_step == step:
                kv.swap_step = None
        return list(rec.swaps)

    def fail(self, step: int) -> list[str]:
        """Step ``step`` failed: its swapped blocks hold unknown data, so the jobs it swapped
        lose their KV (they will recompute). Returns those jobs."""
        rec = self._steps.get(step)
        lost = [] if rec is None else [j for j in rec.swaps if self.swap_step(j) == step]
        for job_id in lost:
            kv = self._jobs.pop(job_id)
            self._pool(kv.tier).release(kv.blocks)
            if kv.busy_step is not None and kv.busy_step != step:
                self._steps[kv.busy_step].busy.remove(job_id)
        self.complete(step)
        return lost

    # ---- internals -----------------------------------------------------------------------
    def _record(self, step: int) -> _StepReleases:
        rec = self._steps.get(step)
        if rec is None:
            rec = self._steps[step] = _StepReleases()
        return rec

    def _pool(self, tier: Tier) -> BlockPool:
        return self.device if tier is Tier.DEVICE else self.host

    def _settled(self, job_id: str, tier: Tier) -> _JobKV:
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not tier:
            raise ValueError(f"job {job_id}: KV is not on {tier.value}")
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"job {job_id}: KV is used by an in-flight step")
        return kv

    # ---- integrity -----------------------------------------------------------------------
    def check_invariants(self, expected_tokens: Mapping[str, int] | None = None) -> None:
        """Every block free, owned by exactly one job, or in flight; tables match contexts.

        ``expected_tokens`` (job id -> positions its table must cover) comes from the
        scheduler; jobs with KV must all be listed when it is given.
        """
        for pool, tier in ((self.device, Tier.DEVICE), (self.host, Tier.HOST)):
            owner: dict[int, str] = {}

            def claim(block: int, who: str, pool: BlockPool = pool,
                      owner: dict[int, str] = owner) -> None:
                assert 0 <= block < pool.capacity, (
                    f"{pool.name} block {block} ({who}) is outside [0, {pool.capacity})")
                assert block not in owner, (
                    f"{pool.name} block {block} is both {owner[block]} and {who}")
                owner[block] = who

            for b in pool.free_ids():
                claim(b, "free")
            for job_id, kv in self._jobs.items():
                if kv.tier is tier:
                    for b in kv.blocks:
                        claim(b, f"owned by {job_id}")
            for step, rec in self._steps.items():
                for b in rec.device if tier is Tier.DEVICE else rec.host:
                    claim(b, f"in flight with step {step}")
            missing = sorted(set(range(pool.capacity)) - owner.keys())
            assert not missing, f"{pool.name} blocks {missing[:8]} are neither free, owned nor in flight"
        releasing = sum(len(r.device) for r in self._steps.values())
        assert releasing == self.device_releasing, (
            f"device_releasing={self.device_releasing} but in-flight records hold {releasing}")
        for job_id, kv in self._jobs.items():
            assert kv.tier is not Tier.NONE, f"job {job_id} has a KV entry on no tier"
            assert len(kv.blocks) == self.blocks_for(kv.num_tokens), (
                f"job {job_id}: {len(kv.blocks)} blocks for {kv.num_tokens} positions "
                f"(block size {self.block_size})")
            for waits_on in (kv.busy_step, kv.swap_step):
                assert waits_on is None or waits_on in self._steps, (
                    f"job {job_id} waits on step {waits_on}, which has no in-flight record")
            if expected_tokens is not None:
                assert job_id in expected_tokens, f"job {job_id} holds KV but is not active"
                assert kv.num_tokens == expected_tokens[job_id], (
                    f"job {job_id}: table covers {kv.num_tokens} positions, "
                    f"the job has {expected_tokens[job_id]}")
