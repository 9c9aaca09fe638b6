"""The KV manager's state: tiers, per-job tables, per-step records, and the bookkeeping both
the manager's operations (``fastserve.kv.manager``) and the prefix cache's (``fastserve.kv.cache_ops``) use.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastserve.kv.prefix import BlockHash, TierBlocks, hash_blocks, root_hash, salted_root
from fastserve.worker.messages import blocks_for

#: The job id a cache spill's swap-out carries (the data plane only copies blocks).
SPILL_JOB = "prefix-cache"

Tokens = Callable[[], Sequence[int]]


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
    committed: int = 0              # leading full blocks already offered to the cache


@dataclass
class _StepReleases:
    """What one in-flight step holds of the KV cache, settled when it completes: references it
    lets go of then, and blocks it writes that are cached then."""

    device: list[int] = field(default_factory=list)   # unreferenced when the step completes
    #: Device blocks the step reads that other tables also hold (not freed by its completion).
    device_reads: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)    # jobs whose swap settles with the step
    busy: list[str] = field(default_factory=list)     # jobs whose blocks the step's entries use
    cache_device: list[tuple[int, BlockHash]] = field(default_factory=list)
    cache_host: list[tuple[int, BlockHash]] = field(default_factory=list)


class PoolSizes(Protocol):
    """What the manager is built from (``fastserve.scheduler.config.KVCacheConfig`` has it;
    ``fastserve/kv`` imports nothing from ``fastserve/scheduler``)."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_device_blocks(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def host_prefix_cache(self) -> bool: ...
    @property
    def prefix_cache_key(self) -> str: ...


class KVState:
    """Everything the KV manager holds, and its internal helpers."""

    def __init__(self, config: PoolSizes) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = TierBlocks(config.num_device_blocks, "device")
        self.host = TierBlocks(config.num_host_blocks, "host")
        self.caching = config.prefix_caching
        self.host_caching = self.caching and config.host_prefix_cache
        self._root = root_hash(config.prefix_cache_key)
        self._jobs: dict[str, _JobKV] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._salted_roots: dict[str, BlockHash] = {}   # jobs with a cache salt: their chain's root
        self._steps: dict[int, _StepReleases] = {}
        self._evicted: list[tuple[int, BlockHash]] = []   # device evictions not yet spilled
        self.device_releasing = 0   # device references in-flight steps let go of on completion
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.spilled_blocks = 0     # cached device blocks moved to the host on eviction
        self.fetched_blocks = 0     # cached host blocks copied back for a new job's prefix

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- internals -----------------------------------------------------------------------
    def _record(self, step: int) -> _StepReleases:
        rec = self._steps.get(step)
        if rec is None:
            rec = self._steps[step] = _StepReleases()
        return rec

    def _take_device(self, n: int) -> list[int]:
        blocks, evicted = self.device.take(n)
        self._evicted.extend(evicted)
        return blocks

    def _unref_table(self, kv: _JobKV) -> None:
        # Last block first: a chain's tail becomes evictable before its head (a block is only
        # ever found through every block before it).
        (self.device if kv.tier is Tier.DEVICE else self.host).unref_chain(kv.blocks)

    def _job_hashes(self, job_id: str, n: int, tokens: Tokens) -> list[BlockHash]:
        have = self._hashes.setdefault(job_id, [])
        if len(have) < n:
            parent = have[-1] if have else self._salted_roots.get(job_id, self._root)
            have.extend(hash_blocks(parent, tokens(), self.block_size, len(have), n))
        return have[:n]

    def _salt(self, job_id: str, salt: str) -> None:
        if job_id in self._hashes:
            raise ValueError(f"job {job_id}: salted after its blocks were hashed")
        self._salted_roots[job_id] = salted_root(self._root, salt)

    def _settled(self, job_id: str, tier: Tier) -> _JobKV:
        kv = self._jobs.get(job_id)
        if kv is None or kv.tier is not tier:
            raise ValueError(f"job {job_id}: KV is not on {tier.value}")
        if kv.busy_step is not None or kv.swap_step is not None:
            raise ValueError(f"job {job_id}: KV is used by an in-flight step")
        return kv
