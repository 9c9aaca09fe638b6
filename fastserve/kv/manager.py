"""``KVCacheManager``: the only holder of block tables; reference counts and the prefix cache of
the two-tier KV. Planners decide; this does the bookkeeping, deferring every release an in-flight
plan still touches to ``complete``. Prefix caching and shared-block swaps: docs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastserve.kv.blocks import BlockHash, OutOfBlocks, TierBlocks
from fastserve.kv.prefix import PrefixCache, PrefixHit
from fastserve.kv.tables import SPILL_JOB, JobKV, PoolSizes, Residency, StepReleases, Tier, Tokens
from fastserve.worker.messages import SwapCommand, blocks_for

__all__ = ["SPILL_JOB", "KVCacheManager", "PoolSizes", "Residency", "Tier", "Tokens"]


class KVCacheManager:
    def __init__(self, config: PoolSizes) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = TierBlocks(config.num_device_blocks, "device")
        self.host = TierBlocks(config.num_host_blocks, "host")
        self.prefix = PrefixCache(self.device, self.host, config.block_size, config.prefix_cache_key,
                                  config.prefix_caching, config.host_prefix_cache)
        self._jobs: dict[str, JobKV] = {}
        self._steps: dict[int, StepReleases] = {}
        self._evicted: list[tuple[int, BlockHash]] = []   # device evictions not yet spilled
        self.device_releasing = 0   # device references in-flight steps let go of on completion
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.spilled_blocks = 0
        self.fetched_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    @property
    def num_free_device(self) -> int:
        """Free or cached-evictable: the cache gives way before any job."""
        return self.device.num_available

    @property
    def num_free_host(self) -> int:
        return self.host.num_available

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

    def movable_blocks(self, job_id: str, keep: frozenset[int] = frozenset()) -> int:
        """Device blocks a swap-out or drop frees: those no other table holds, less ``keep``."""
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not Tier.DEVICE:
            return 0
        return sum(self.device.refs[b] == 1 and b not in keep for b in kv.blocks)

    def swap_in_blocks(self, job_id: str) -> int:
        """At most its table: blocks the device still caches are referenced, not copied."""
        kv = self._jobs.get(job_id)
        return 0 if kv is None or kv.tier is not Tier.HOST else len(kv.blocks)

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
        """Including, for a job on the host, bringing its table back."""
        kv = self._jobs.get(job_id)
        want = self.blocks_for(num_tokens)
        if kv is None:
            return want
        if kv.tier is Tier.HOST:
            return max(want, len(kv.blocks))
        return max(want - len(kv.blocks), 0)

    def allocate(self, job_id: str, num_tokens: int, step: int) -> tuple[int, ...]:
        """Device blocks for positions ``0..num_tokens-1``, in use by ``step``; returns the table."""
        kv = self._jobs.get(job_id)
        if kv is None:
            kv = self._jobs[job_id] = JobKV(Tier.DEVICE, [], 0)
        if kv.tier is not Tier.DEVICE:
            raise ValueError(f"job {job_id}: KV is on {kv.tier.value}, cannot run on the device")
        if kv.swap_step is not None and kv.swap_step != step:
            raise ValueError(f"job {job_id}: KV still in transit (swap of step {kv.swap_step})")
        if kv.busy_step is not None:
            raise ValueError(f"job {job_id}: already used by in-flight step {kv.busy_step}")
        extra = self.blocks_for(num_tokens) - len(kv.blocks)
        if extra > 0:
            kv.blocks.extend(self._take_device(extra))
        kv.num_tokens = max(kv.num_tokens, num_tokens)
        kv.busy_step = step
        self._record(step).busy.append(job_id)
        return tuple(kv.blocks)

    def swap_out(self, job_id: str, step: int, reuse_now: bool = False) -> SwapCommand:
        """Move an idle resident job's KV to the host with ``step``. Shared blocks stay and are
        copied, so a job on the host pins no device block. ``reuse_now`` (reactive): ``step``
        itself reuses the blocks, safe since the data plane runs a plan's swaps before its forward."""
        kv = self._settled(job_id, Tier.DEVICE)
        known = [self.host.by_hash.get(self.device.hash_of.get(b, b"")) for b in kv.blocks]
        for hb in known:
            if hb is not None:
                self.host.ref(hb)
        wanted = sum(h is None for h in known)
        if wanted > self.host.num_available:
            raise OutOfBlocks(f"swap out {job_id}: {wanted} host blocks wanted, "
                              f"{self.host.num_available} free")
        dst, _ = self.host.take(wanted)   # evicted host cache blocks are dropped
        rec = self._record(step)
        src: list[int] = []
        copies: list[int] = []
        table: list[int] = []
        fresh = iter(dst)
        for d, hb in zip(kv.blocks, known, strict=True):
            if hb is None:
                hb = next(fresh)
                src.append(d)
                copies.append(hb)
                if d in self.device.hash_of:
                    rec.cache_host.append((hb, self.device.hash_of[d]))
            table.append(hb)
            if self.device.refs[d] > 1:
                rec.device_reads.append(d)
            elif reuse_now:
                self.device.unref((d,))
            else:
                rec.device.append(d)
                self.device_releasing += 1
        kv.blocks, kv.tier, kv.swap_step = table, Tier.HOST, step
        rec.swaps.append(job_id)
        self.swapped_out_blocks += len(src)
        return SwapCommand("out", job_id, tuple(src), tuple(copies))

    def swap_in(self, job_id: str, step: int) -> SwapCommand:
        """Bring a host job's KV back with ``step``: device-cached blocks referenced, the rest copied."""
        kv = self._settled(job_id, Tier.HOST)
        cached = [self.device.by_hash.get(self.host.hash_of.get(hb, b"")) for hb in kv.blocks]
        for d in cached:
            if d is not None:
                self.device.ref(d)
        wanted = sum(d is None for d in cached)
        if wanted > self.device.num_available:
            raise OutOfBlocks(f"swap in {job_id}: {wanted} device blocks wanted, "
                              f"{self.device.num_available} free")
        dst = self._take_device(wanted)
        rec = self._record(step)
        src: list[int] = []
        copies: list[int] = []
        table: list[int] = []
        fresh = iter(dst)
        for hb, d in zip(kv.blocks, cached, strict=True):
            if d is None:
                d = next(fresh)
                src.append(hb)
                copies.append(d)
                if hb in self.host.hash_of:
                    rec.cache_device.append((d, self.host.hash_of[hb]))
            table.append(d)
        rec.host.extend(kv.blocks)        # read by the copy: held until it lands
        rec.swaps.append(job_id)
        kv.blocks, kv.tier, kv.swap_step = table, Tier.DEVICE, step
        self.swapped_in_blocks += len(src)
        return SwapCommand("in", job_id, tuple(src), tuple(copies))

    def drop(self, job_id: str) -> int:
        """Forget an idle job's KV now; returns the device blocks freed (cached ones stay cached)."""
        kv = self._jobs.get(job_id)
        if kv is None:
            return 0
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"drop {job_id}: its blocks are used by an in-flight step")
        freed = self.movable_blocks(job_id)
        del self._jobs[job_id]
        self._unref_table(kv)
        return freed

    def free(self, job_id: str) -> None:
        """Release a finished job's KV; blocks an in-flight step touches go when it completes."""
        self.prefix.forget(job_id)
        kv = self._jobs.pop(job_id, None)
        if kv is None:
            return
        pending = kv.swap_step if kv.swap_step is not None else kv.busy_step
        if pending is None:
            self._unref_table(kv)
            return
        rec = self._record(pending)
        for b in kv.blocks:
            if kv.tier is Tier.HOST:
                rec.host.append(b)
            elif self.device.refs[b] > 1:
                rec.device_reads.append(b)
            else:
                rec.device.append(b)
                self.device_releasing += 1
        for other in (kv.swap_step, kv.busy_step):
            if other is not None and other != pending:
                self._steps[other].busy = [j for j in self._steps[other].busy if j != job_id]
        rec.swaps = [j for j in rec.swaps if j != job_id]
        rec.busy = [j for j in rec.busy if j != job_id]

    def complete(self, step: int) -> list[str]:
        """Cache what the step's copies brought, settle its swaps and releases; returns settled jobs."""
        rec = self._steps.pop(step, None)
        if rec is None:
            return []
        for tier, new in ((self.device, rec.cache_device), (self.host, rec.cache_host)):
            for block, block_hash in new:
                tier.register(block, block_hash)
        self.device.unref_chain(rec.device)
        self.device.unref_chain(rec.device_reads)
        self.device_releasing -= len(rec.device)
        self.host.unref_chain(rec.host)
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
        """What the step's copies wrote is unknown: nothing is cached, its swapped jobs lose their KV."""
        rec = self._steps.get(step)
        lost = [] if rec is None else [j for j in rec.swaps if self.swap_step(j) == step]
        if rec is not None:
            rec.cache_device.clear()
            rec.cache_host.clear()
        for job_id in lost:
            kv = self._jobs.pop(job_id)
            self.prefix.forget_chain(job_id)
            self._unref_table(kv)
            if kv.busy_step is not None and kv.busy_step != step:
                self._steps[kv.busy_step].busy.remove(job_id)
        self.complete(step)
        return lost

    def prefix_hit(self, job_id: str, num_tokens: int, tokens: Tokens,
                   max_host: int | None = None) -> PrefixHit:
        if job_id in self._jobs:
            return PrefixHit(block_size=self.block_size)
        return self.prefix.lookup(job_id, num_tokens, tokens, max_host)

    def admit(self, job_id: str, num_tokens: int, step: int, tokens: Tokens,
              runs: bool, max_host: int | None = None) -> tuple[int, SwapCommand | None]:
        """A table for ``num_tokens`` positions, cached prefix first (host hits copied by the returned
        swap-in); ``max_host``: the host hits planned. Returns the cached positions and the swap-in."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id}: already has KV")
        hit = self.prefix_hit(job_id, num_tokens, tokens, max_host)
        for d in hit.device:
            if d is not None:
                self.device.ref(d)
        for hb in hit.host:
            if hb is not None:
                self.host.ref(hb)
        fresh = self._take_device(sum(d is None for d in hit.device)
                                  + self.blocks_for(num_tokens) - hit.num_blocks)
        table: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        rec = self._record(step)
        for d, hb in zip(hit.device, hit.host, strict=True):
            if d is None:
                assert hb is not None
                d = fresh.pop(0)
                rec.host.append(hb)           # read by the copy: held until it lands
                rec.cache_device.append((d, self.host.hash_of[hb]))
                src.append(hb)
                dst.append(d)
            table.append(d)
        table.extend(fresh)
        kv = self._jobs[job_id] = JobKV(Tier.DEVICE, table, num_tokens, committed=hit.num_blocks)
        cmd = None
        if src:
            kv.swap_step = step
            rec.swaps.append(job_id)
            self.fetched_blocks += len(src)
            cmd = SwapCommand("in", job_id, tuple(src), tuple(dst))
        if runs:
            kv.busy_step = step
            rec.busy.append(job_id)
        if not rec.device and not rec.host and not rec.swaps and not rec.busy:
            del self._steps[step]
        return hit.tokens, cmd

    def commit(self, job_id: str, computed: int, tokens: Tokens) -> None:
        """Cache the full blocks of positions up to ``computed``."""
        kv = self._jobs.get(job_id)
        full = computed // self.block_size
        if not self.prefix.enabled or kv is None or kv.tier is not Tier.DEVICE or full <= kv.committed:
            return
        hashes = self.prefix.hashes(job_id, full, tokens)
        for i in range(kv.committed, full):
            self.device.register(kv.blocks[i], hashes[i])
        kv.committed = full

    def flush_evicted(self, step: int) -> SwapCommand | None:
        """This decision's evicted cached blocks go to the host with ``step`` while it has room, else
        nowhere; after the decision's own swaps took their host blocks."""
        evicted, self._evicted = self._evicted, []
        if not self.prefix.host_enabled:
            return None
        src: list[int] = []
        dst: list[int] = []
        rec = self._record(step)
        for block, block_hash in evicted:
            if block_hash in self.host.by_hash or self.host.num_available == 0:
                continue
            (hb,), _ = self.host.take(1)
            rec.host.append(hb)                 # written by the copy; cached when it lands
            if self.device.refs.get(block, 0):
                # Its new owner may finish first; the copy still reads it until it lands.
                self.device.ref(block)
                rec.device_reads.append(block)
            rec.cache_host.append((hb, block_hash))
            src.append(block)
            dst.append(hb)
        self.spilled_blocks += len(src)
        return SwapCommand("out", SPILL_JOB, tuple(src), tuple(dst)) if src else None

    def reset_prefix_cache(self) -> int:
        """vLLM's ``/reset_prefix_cache``; returns how many blocks were cached."""
        for rec in self._steps.values():
            rec.cache_device.clear()
            rec.cache_host.clear()
        return self.prefix.reset()

    def cache_stats(self) -> dict[str, int]:
        return {"device_cached": self.device.num_cached, "device_evictable": len(self.device.lru),
                "host_cached": self.host.num_cached, "host_evictable": len(self.host.lru),
                "device_evictions": self.device.evictions, "host_evictions": self.host.evictions,
                "spilled_blocks": self.spilled_blocks, "fetched_blocks": self.fetched_blocks}

    def _record(self, step: int) -> StepReleases:
        rec = self._steps.get(step)
        if rec is None:
            rec = self._steps[step] = StepReleases()
        return rec

    def _take_device(self, n: int) -> list[int]:
        blocks, evicted = self.device.take(n)
        self._evicted.extend(evicted)
        return blocks

    def _unref_table(self, kv: JobKV) -> None:
        (self.device if kv.tier is Tier.DEVICE else self.host).unref_chain(kv.blocks)

    def _settled(self, job_id: str, tier: Tier) -> JobKV:
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not tier:
            raise ValueError(f"job {job_id}: KV is not on {tier.value}")
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"job {job_id}: KV is used by an in-flight step")
        return kv

    def check_invariants(self, expected_tokens: Mapping[str, int] | None = None) -> None:
        """Every block free, evictable, or held by exactly its refcount; tables cover
        ``expected_tokens`` (every job with KV listed). O(jobs + blocks): tests only."""
        self._check_tier(self.device)
        self._check_tier(self.host)
        assert not self._evicted, "a decision was left half applied (evictions not flushed)"
        releasing = sum(len(r.device) for r in self._steps.values())
        assert releasing == self.device_releasing, (
            f"device_releasing={self.device_releasing} but in-flight records hold {releasing}")
        assert self.prefix.enabled or not (self.device.hash_of or self.host.hash_of), "caching is off"
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

    def _check_tier(self, pool: TierBlocks) -> None:
        on_device = pool is self.device
        holders: dict[int, list[str]] = {}
        for job_id, kv in self._jobs.items():
            if on_device == (kv.tier is Tier.DEVICE):
                for b in kv.blocks:
                    holders.setdefault(b, []).append(f"owned by {job_id}")
        for step, rec in self._steps.items():
            for b in (rec.device + rec.device_reads) if on_device else rec.host:
                holders.setdefault(b, []).append(f"in flight with step {step}")
        state: dict[int, str] = {}

        def claim(block: int, who: str) -> None:
            assert 0 <= block < pool.capacity, (
                f"{pool.name} block {block} ({who}) is outside [0, {pool.capacity})")
            assert block not in state, f"{pool.name} block {block} is both {state[block]} and {who}"
            state[block] = who

        for b in pool.free_ids():
            claim(b, "free")
            assert b not in pool.hash_of, f"{pool.name} block {b} is free but cached"
        for b in pool.lru:
            claim(b, "cached")
            assert b in pool.hash_of, f"{pool.name} block {b} is evictable but not cached"
        for b, who in holders.items():
            claim(b, who[0])
            assert pool.refs.get(b) == len(who), (
                f"{pool.name} block {b}: refcount {pool.refs.get(b)}, held by {who}")
        leaked = sorted(set(pool.refs) - holders.keys())
        assert not leaked, f"{pool.name} blocks {leaked[:8]} are referenced by nobody"
        missing = sorted(set(range(pool.capacity)) - state.keys())
        assert not missing, f"{pool.name} blocks {missing[:8]} are neither free, owned nor in flight"
        assert all(pool.by_hash.get(h) == b for b, h in pool.hash_of.items()) and \
            len(pool.by_hash) == len(pool.hash_of), f"{pool.name} cache maps disagree"
