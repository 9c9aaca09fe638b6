"""``TierBlocks``: one tier of the paged KV cache. Each block is exactly one of free, cached and
evictable (a hash, no reference; LRU), or referenced (``refs`` counts tables and in-flight steps).
A block whose last reference goes keeps its hash; taking blocks uses the free list, then the LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: A full block's chained hash (``fastserve.kv.prefix.hash_block``).
BlockHash = bytes


class OutOfBlocks(RuntimeError):
    """More blocks asked for than the pool has free: a planner bug."""


class TierBlocks:
    def __init__(self, num_blocks: int, name: str) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.capacity = num_blocks
        # A stack: the most recently released block is reused first (warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs: dict[int, int] = {}
        self.hash_of: dict[int, BlockHash] = {}
        self.by_hash: dict[BlockHash, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # evictable, oldest first
        self.evictions = 0

    @property
    def num_available(self) -> int:
        return self.num_free + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.hash_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def take(self, n: int) -> tuple[list[int], list[tuple[int, BlockHash]]]:
        """``n`` blocks referenced once, free first, then evicted LRU ones (returned with their hash)."""
        if n > self.num_available:
            raise OutOfBlocks(f"{self.name} pool: {n} blocks wanted, {self.num_available} "
                              "free or evictable")
        fresh = min(n, self.num_free)
        blocks = self._allocate(fresh)
        evicted = []
        for _ in range(n - fresh):
            block, _ = self.lru.popitem(last=False)
            evicted.append((block, self._unhash(block)))
            blocks.append(block)
        self.evictions += len(evicted)
        for b in blocks:
            self.refs[b] = 1
        return blocks, evicted

    def ref(self, block: int) -> None:
        n = self.refs.get(block, 0)
        if n == 0:
            self.lru.pop(block)    # only a cached block is referenced from nothing
        self.refs[block] = n + 1

    def unref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            n = self.refs[b] - 1
            if n:
                self.refs[b] = n
                continue
            del self.refs[b]
            if b in self.hash_of:
                self.lru[b] = None   # most recently released: evicted last
            else:
                self._release((b,))

    def unref_chain(self, blocks: Sequence[int]) -> None:
        """Cached blocks become evictable tail first: a block is only found through every one before it."""
        freed = []
        for b in reversed(blocks):
            n = self.refs[b] - 1
            if n:
                self.refs[b] = n
                continue
            del self.refs[b]
            if b in self.hash_of:
                self.lru[b] = None
            else:
                freed.append(b)
        freed.reverse()
        self._release(freed)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """False when the hash is cached elsewhere (that copy stays) or the block has one."""
        if block_hash in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        return True

    def forget(self, block: int) -> None:
        """Its KV is not what its hash says (a failed copy)."""
        if block in self.hash_of:
            self._unhash(block)
            if block in self.lru:
                del self.lru[block]
                self._release((block,))

    def reset(self) -> int:
        """Uncache every block (owners keep theirs); returns how many were cached."""
        n = len(self.hash_of)
        for b in list(self.hash_of):
            self._unhash(b)
        self._release(self.lru)
        self.lru.clear()
        return n

    def _unhash(self, block: int) -> BlockHash:
        h = self.hash_of.pop(block)
        del self.by_hash[h]
        return h

    def _allocate(self, n: int) -> list[int]:
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

    def _release(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)
