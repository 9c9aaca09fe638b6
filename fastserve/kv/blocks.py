"""``BlockPool``: the free list of one tier (device or host) of the paged KV cache.

Owns nothing but which block ids of its tier are free; who holds the others is the
``KVCacheManager``'s business.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """An allocation asked for more blocks than the pool has free (a planner bug: check first)."""


class BlockPool:
    def __init__(self, num_blocks: int, name: str) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.capacity = num_blocks
        # A stack: the most recently released block is reused first (warm in caches); the
        # initial order hands out low ids first, which keeps test expectations readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"{self.name} pool: cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"{self.name} pool: {n} blocks wanted, {len(self._free)} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)
