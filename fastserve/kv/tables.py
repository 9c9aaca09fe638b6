"""The ``KVCacheManager``'s records (``JobKV``, ``StepReleases``), the enums its queries answer with,
and what it is built from (``PoolSizes``)."""

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
    """References an in-flight step lets go of, and blocks cached, when it completes."""

    device: list[int] = field(default_factory=list)
    device_reads: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)    # jobs whose swap settles with the step
    busy: list[str] = field(default_factory=list)
    cache_device: list[tuple[int, BlockHash]] = field(default_factory=list)
    cache_host: list[tuple[int, BlockHash]] = field(default_factory=list)


class PoolSizes(Protocol):
    """``KVCacheConfig``'s shape: ``fastserve/kv`` imports nothing from the scheduler."""

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
