"""The KV manager's integrity check (tests run it after every step): O(jobs + blocks), not for
the hot path. Reads the manager's internals; changes nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastserve.kv.prefix import TierBlocks
from fastserve.kv.tables import Tier

if TYPE_CHECKING:
    from fastserve.kv.manager import KVCacheManager


def check_manager(m: KVCacheManager, expected_tokens: Mapping[str, int] | None = None) -> None:
    """Every block free, cached and evictable, or referenced by exactly the job tables and
    in-flight steps that hold it (its reference count); tables match contexts.

    ``expected_tokens`` (job id -> positions its table must cover) comes from the
    scheduler; jobs with KV must all be listed when it is given.
    """
    for pool in (m.device, m.host):
        holders: dict[int, list[str]] = {}
        for job_id, kv in m._jobs.items():
            if (pool is m.device) == (kv.tier is Tier.DEVICE):
                for b in kv.blocks:
                    holders.setdefault(b, []).append(f"owned by {job_id}")
        for step, rec in m._steps.items():
            for b in (rec.device + rec.device_reads) if pool is m.device else rec.host:
                holders.setdefault(b, []).append(f"in flight with step {step}")
        state: dict[int, str] = {}

        def claim(block: int, who: str, pool: TierBlocks = pool,
                  state: dict[int, str] = state) -> None:
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
    assert not m._evicted, "a decision was left half applied (evictions not flushed)"
    releasing = sum(len(r.device) for r in m._steps.values())
    assert releasing == m.device_releasing, (
        f"device_releasing={m.device_releasing} but in-flight records hold {releasing}")
    assert m.caching or not (m.device.hash_of or m.host.hash_of), "caching is off"
    for job_id, kv in m._jobs.items():
        assert kv.tier is not Tier.NONE, f"job {job_id} has a KV entry on no tier"
        assert len(kv.blocks) == m.blocks_for(kv.num_tokens), (
            f"job {job_id}: {len(kv.blocks)} blocks for {kv.num_tokens} positions "
            f"(block size {m.block_size})")
        for waits_on in (kv.busy_step, kv.swap_step):
            assert waits_on is None or waits_on in m._steps, (
                f"job {job_id} waits on step {waits_on}, which has no in-flight record")
        if expected_tokens is not None:
            assert job_id in expected_tokens, f"job {job_id} holds KV but is not active"
            assert kv.num_tokens == expected_tokens[job_id], (
                f"job {job_id}: table covers {kv.num_tokens} positions, "
                f"the job has {expected_tokens[job_id]}")
