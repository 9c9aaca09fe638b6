"""The prefix cache's operations on the KV manager's state (``KVCacheManager`` has them): look a
job's prefix up, admit it with its cached prefix, cache what completed steps computed, send
evicted device blocks to the host, reset. See ``fastserve.kv.manager`` for the rules."""

from __future__ import annotations

from fastserve.kv.prefix import PrefixHit
from fastserve.kv.tables import SPILL_JOB, KVState, Tier, Tokens, _JobKV
from fastserve.worker.messages import SwapCommand


class PrefixCacheOps(KVState):
    # ---- the prefix cache ----------------------------------------------------------------
    def salt(self, job_id: str, salt: str) -> None:
        """Only jobs with this salt share cached blocks with ``job_id`` (vLLM's ``cache_salt``);
        called before its prefix is first looked up, kept until it is freed."""
        self._salt(job_id, salt)

    def prefix_hit(self, job_id: str, num_tokens: int, tokens: Tokens,
                   max_host: int | None = None) -> PrefixHit:
        """The longest cached prefix of the job's first ``num_tokens`` positions, in full blocks,
        leaving at least its last position to compute (it is sampled). Each block is found on
        the device or, failing that, on the host (host tier on; at most ``max_host`` blocks)."""
        if not self.caching or job_id in self._jobs:
            return PrefixHit(block_size=self.block_size)
        hashes = self._job_hashes(job_id, (num_tokens - 1) // self.block_size, tokens)
        device: list[int | None] = []
        host: list[int | None] = []
        in_use: list[int] = []
        host_free = n_host = 0
        for h in hashes:
            d = self.device.by_hash.get(h)
            hb = None if d is not None or not self.host_caching else self.host.by_hash.get(h)
            if d is None and (hb is None or (max_host is not None and n_host >= max_host)):
                break
            n_host += d is None
            device.append(d)
            host.append(hb)
            if d is not None and d in self.device.refs:
                in_use.append(d)
            host_free += hb is not None and hb not in self.host.refs
        return PrefixHit(tuple(device), tuple(host), tuple(in_use), host_free, self.block_size)

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
        kv = self._jobs[job_id] = _JobKV(Tier.DEVICE, table, num_tokens, committed=hit.num_blocks)
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
        if not self.caching or kv is None or kv.tier is not Tier.DEVICE or full <= kv.committed:
            return
        hashes = self._job_hashes(job_id, full, tokens)
        for i in range(kv.committed, full):
            self.device.register(kv.blocks[i], hashes[i])
        kv.committed = full

    def flush_evicted(self, step: int) -> SwapCommand | None:
        """Where the cached device blocks this decision evicted go: to the host (a swap-out with
        ``step``, before anything writes them) while the host has room and lacks their hash,
        else nowhere. Called once the decision's own swaps took their host blocks."""
        evicted, self._evicted = self._evicted, []
        if not self.host_caching:
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
        return self.device.reset() + self.host.reset()

    def cache_stats(self) -> dict[str, int]:
        """Cached blocks per tier (evictable ones among them) and cache traffic."""
        return {"device_cached": self.device.num_cached, "device_evictable": len(self.device.lru),
                "host_cached": self.host.num_cached, "host_evictable": len(self.host.lru),
                "device_evictions": self.device.evictions, "host_evictions": self.host.evictions,
                "spilled_blocks": self.spilled_blocks, "fetched_blocks": self.fetched_blocks}
