"""The KV manager's records: what it knows of one job's KV (``JobKV``: tier, block table,
positions covered, the in-flight step or swap using it) and of one in-flight step
(``StepReleases``), the enums its queries answer with, and what it is built from (``PoolSizes``).
The ``KVCacheManager`` (``fastserve.kv.manager``) is their only writer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastserve.kv.blocks import BlockHash

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
class JobKV:
    tier: Tier
    blocks: list[int]
    num_tokens: int                 # positions the table covers
    busy_step: int | None = None    # step whose entry uses these blocks
    swap_step: int | None = None    # step carrying an uncompleted swap of this job
    committed: int = 0              # leading full blocks already offered to the cache


@dataclass
class StepReleases:
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
