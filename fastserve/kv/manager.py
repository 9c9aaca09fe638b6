"""``KVCacheManager``: block tables, reference counts and the prefix cache of the two-tier KV.

The only holder of block tables. It allocates device blocks for first iterations and decode
growth, turns swap decisions into ``SwapCommand``s (device <-> host), drops KV for recompute, and
defers every release that an in-flight plan still touches: the last reference to a block used by
an in-flight step, and the source (and, on abort, the destination) of an uncompleted swap, is let
go only when that step completes (``complete``). Planners decide; this module only does the
bookkeeping, so ``check_invariants`` can prove every block free, cached and evictable, or
referenced by exactly the tables and in-flight steps that hold it.

**Prefix caching** (``kv_cache.prefix_caching``, ``fastserve.kv.prefix``): a new job takes the longest
cached prefix of full blocks (``admit``) — device hits by reference, host hits copied back with
the plan (a swap-in command) — and computes only the rest. Blocks are cached when the step that
computed them completed (``commit``), or when the copy that brought them landed. A job's blocks
outlive it as cached-evictable; taking blocks evicts the least recently released ones, and an
evicted device block's KV moves to the host while the host has room (``flush_evicted``: a
swap-out with the plan that reuses the block — the data plane issues swaps before the forward,
and the forward waits for swaps on its blocks), else it is dropped. The planners count
cached-evictable blocks as free (``num_free_device``): the cache gives way before any job.

**Swapping out a job that shares blocks** frees on the device only the blocks no other table
holds (refcount 1, ``movable_blocks``): a block another job also holds stays there for it — that
job may be running and read it. The job on the host gets its own copy of every block (or a
reference to the host's cached copy of the same hash), so it never pins device blocks while it
is away, and its swap-in references what the device still caches and copies back the rest. A
swap-out takes at most ``num_blocks`` host blocks; a swap-in at most ``num_blocks`` device
blocks. Off (``prefix_caching: false``), nothing is shared or cached and every count is a job's whole table, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastserve.kv.blocks import BlockHash, OutOfBlocks, TierBlocks
from fastserve.kv.prefix import PrefixCache, PrefixHit
from fastserve.kv.tables import SPILL_JOB, JobKV, PoolSizes, Residency, StepReleases, Tier, Tokens
from fastserve.worker.messages import SwapCommand, blocks_for

__all__ = ["SPILL_JOB", "KVCacheManager", "PoolSizes", "Residency", "Tier", "Tokens"]


class KVCacheManager:
    """Block tables, reference counts and the prefix cache of the two-tier KV (above).

    The only holder of block tables: the planners ask it what a job holds and what a swap would
    move; the ``Applier`` asks it to allocate, swap, drop, free, admit and commit; a returned
    or failed step settles here (``complete``, ``fail``). Its tiers (``TierBlocks``) hold the
    blocks, references and cached hashes; ``prefix`` (``PrefixCache``) the jobs' hash chains and
    the lookups over both tiers."""

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
        self.spilled_blocks = 0     # cached device blocks moved to the host on eviction
        self.fetched_blocks = 0     # cached host blocks copied back for a new job's prefix

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_device(self) -> int:
        """Device blocks a new owner can take: free or cached and evictable."""
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
        """Device blocks a swap-out or drop of this resident job frees: those no other table
        holds (all of them when nothing is shared), less ``keep`` (blocks a job admitted in the
        same decision takes as its prefix, which makes them shared)."""
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not Tier.DEVICE:
            return 0
        return sum(self.device.refs[b] == 1 and b not in keep for b in kv.blocks)

    def swap_in_blocks(self, job_id: str) -> int:
        """Device blocks a swap-in of this host job takes at most: its table (blocks the device
        still caches are referenced instead of copied, so it may take fewer)."""
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
        """Device blocks a job still needs so its table covers ``num_tokens`` positions.

        For a job on the host this includes bringing back what its swap-out moved.
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
        """Move an idle resident job's KV to the host with ``step``.

        The rule for shared blocks: the device frees only the blocks no other table holds
        (``movable_blocks``); a block another job also holds stays on the device for it — that
        job may be running — and is *copied*, not moved, so the job on the host holds nothing on
        the device (it could otherwise pin device blocks no resident job reads). A block whose
        hash the host already caches is shared by reference instead of copied. So the host takes
        at most ``num_blocks`` blocks. The moved device blocks are reusable once ``step``
        completes — or, with ``reuse_now`` (reactive preemption), by ``step`` itself: the data
        plane issues a plan's swaps before its forward, in order on one copy thread or stream,
        and the forward waits for swaps touching its blocks (``fastserve.worker.stage.StageRunner``), so
        the copy reads them before anything overwrites them."""
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
                # Another job holds it: it stays (read by the copy until that lands).
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
        """Bring a host job's KV back with ``step``: blocks the device still caches (by hash)
        are referenced, the rest copied. It is resident (usable by a later plan) once that
        step completes, or by an entry of ``step`` itself (reactive)."""
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
        rec.host.extend(kv.blocks)        # read by the copy: let go of when it lands
        rec.swaps.append(job_id)
        kv.blocks, kv.tier, kv.swap_step = table, Tier.DEVICE, step
        self.swapped_in_blocks += len(src)
        return SwapCommand("in", job_id, tuple(src), tuple(copies))

    def drop(self, job_id: str) -> int:
        """Recompute mode: forget an idle job's KV now (no in-flight step or swap touches it,
        so its blocks are reusable at once; cached ones stay cached). Returns the device blocks
        that became free or evictable."""
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
        """Release a finished or aborted job's KV; the last reference to a block an in-flight
        step or swap still touches goes when that step completes."""
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
                rec.device_reads.append(b)  # another holder keeps it: not freed by completion
            else:
                rec.device.append(b)
                self.device_releasing += 1
        for other in (kv.swap_step, kv.busy_step):
            if other is not None and other != pending:
                self._steps[other].busy = [j for j in self._steps[other].busy if j != job_id]
        rec.swaps = [j for j in rec.swaps if j != job_id]
        rec.busy = [j for j in rec.busy if j != job_id]

    # ---- completion ----------------------------------------------------------------------
    def complete(self, step: int) -> list[str]:
        """Step ``step`` finished on every worker: cache what its copies brought, settle its
        swaps, let go of its deferred references. Returns the jobs whose swap settled."""
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
        """Step ``step`` failed: what its copies wrote is unknown, so nothing it brought is
        cached and the jobs it swapped lose their KV (they will recompute). Returns those jobs."""
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

    # ---- the prefix cache ----------------------------------------------------------------
    def prefix_hit(self, job_id: str, num_tokens: int, tokens: Tokens,
                   max_host: int | None = None) -> PrefixHit:
        """The cached prefix a job with no KV would start from (``PrefixCache.lookup``); none
        for a job that already has KV."""
        if job_id in self._jobs:
            return PrefixHit(block_size=self.block_size)
        return self.prefix.lookup(job_id, num_tokens, tokens, max_host)

    def admit(self, job_id: str, num_tokens: int, step: int, tokens: Tokens,
              runs: bool, max_host: int | None = None) -> tuple[int, SwapCommand | None]:
        """Give a job with no KV a table for ``num_tokens`` positions, its cached prefix first:
        device hits by reference, host hits into new blocks with the returned swap-in (the job
        is in transit until ``step`` completes). ``runs``: an entry of ``step`` uses the table
        (its forward waits for the copy). ``max_host``: at most the host hits the decision
        planned (an earlier action of it may have evicted a device hit the walk counted, and the
        host copy of that block is not what it planned to read). Returns the cached positions
        and the swap-in."""
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
                d = fresh.pop(0)   # (few: one per host hit)
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
        """A completed step computed the job's positions up to ``computed``: cache its full
        blocks (a hash already cached elsewhere keeps that copy)."""
        kv = self._jobs.get(job_id)
        full = computed // self.block_size
        if not self.prefix.enabled or kv is None or kv.tier is not Tier.DEVICE or full <= kv.committed:
            return
        hashes = self.prefix.hashes(job_id, full, tokens)
        for i in range(kv.committed, full):
            self.device.register(kv.blocks[i], hashes[i])
        kv.committed = full

    def flush_evicted(self, step: int) -> SwapCommand | None:
        """Where the cached device blocks this decision evicted go: to the host (a swap-out with
        ``step``, before anything writes them) while the host has room and lacks their hash,
        else nowhere. Called once the decision's own swaps took their host blocks."""
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
                # Read by the copy: held until it lands, whoever took it in this decision (that
                # owner may be aborted or finish first; the block must not be free meanwhile).
                self.device.ref(block)
                rec.device_reads.append(block)
            rec.cache_host.append((hb, block_hash))
            src.append(block)
            dst.append(hb)
        self.spilled_blocks += len(src)
        return SwapCommand("out", SPILL_JOB, tuple(src), tuple(dst)) if src else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's ``/reset_prefix_cache``): evictable ones are free
        again, referenced ones stay with their owners unfound by later lookups. Returns how many
        blocks were cached."""
        for rec in self._steps.values():
            rec.cache_device.clear()
            rec.cache_host.clear()
        return self.prefix.reset()

    def cache_stats(self) -> dict[str, int]:
        """Cached blocks per tier (evictable ones among them) and cache traffic."""
        return {"device_cached": self.device.num_cached, "device_evictable": len(self.device.lru),
                "host_cached": self.host.num_cached, "host_evictable": len(self.host.lru),
                "device_evictions": self.device.evictions, "host_evictions": self.host.evictions,
                "spilled_blocks": self.spilled_blocks, "fetched_blocks": self.fetched_blocks}

    # ---- internals -----------------------------------------------------------------------
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
        # Last block first: a chain's tail becomes evictable before its head (a block is only
        # ever found through every block before it).
        (self.device if kv.tier is Tier.DEVICE else self.host).unref_chain(kv.blocks)

    def _settled(self, job_id: str, tier: Tier) -> JobKV:
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not tier:
            raise ValueError(f"job {job_id}: KV is not on {tier.value}")
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"job {job_id}: KV is used by an in-flight step")
        return kv

    # ---- integrity (tests run it after every step: O(jobs + blocks), not for the hot path) --
    def check_invariants(self, expected_tokens: Mapping[str, int] | None = None) -> None:
        """Every block free, cached and evictable, or referenced by exactly the job tables and
        in-flight steps that hold it (its reference count); tables match contexts.

        ``expected_tokens`` (job id -> positions its table must cover) comes from the
        scheduler; jobs with KV must all be listed when it is given.
        """
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
        """Each of the tier's blocks is exactly one of free, cached and evictable, or held (by
        as many tables and in-flight steps as its reference count says)."""
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
