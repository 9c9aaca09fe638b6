"""Automatic prefix caching: block hashes and one tier's reference-counted, cached blocks.

**What is shared.** Only *full* blocks whose KV a completed step computed are cached, keyed by a
chained hash: ``hash(parent block's hash, the block's token ids, extra)``, the root seeded by a
key that names what else changes KV (the model; later adapters). Equal hashes mean equal token
prefixes, so equal KV. A full block is immutable — no step ever writes it again — so jobs share it
by reference and no copy-on-write is needed: a job's last, partial block is always its own, and a
fully cached prompt still computes its last position (to sample), as vLLM does.

**One tier's blocks** (``TierBlocks``, the device or the host pool): a block is exactly one of

* free (in the free list, no hash),
* cached and evictable (a hash, no reference; in the LRU order, oldest first),
* referenced: by job block tables and by in-flight steps that still read or write it (``refs``
  counts both; the manager knows which).

A block whose last reference goes keeps its hash and becomes evictable instead of free; taking
blocks uses the free list first, then evicts the least recently released cached blocks (the
manager decides where an evicted device block's KV goes: the host tier or nowhere).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastserve.kv.blocks import BlockPool, OutOfBlocks

BlockHash = bytes


def root_hash(key: str) -> BlockHash:
    """The parent hash of a sequence's first block: what, beside tokens, shapes its KV."""
    return hashlib.sha256(b"fastserve-prefix\0" + key.encode()).digest()


def salted_root(root: BlockHash, salt: str) -> BlockHash:
    """The root of a salted request's chain (vLLM's ``cache_salt``): its blocks hash apart from
    every unsalted or differently salted request's, so only the same salt finds them."""
    return hashlib.sha256(root + b"\0cache-salt\0" + salt.encode()).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Chained hash of one full block: its parent's hash, its token ids, ``extra`` (per-request
    keys such as an adapter; empty today: a cache salt goes in the root, ``salted_root``).
    SHA-256, so distinct prefixes never share KV by a hash collision."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def hash_blocks(parent: BlockHash, tokens: Sequence[int], block_size: int, start: int,
                stop: int) -> list[BlockHash]:
    """Hashes of full blocks ``start .. stop-1`` of ``tokens``, chained from ``parent`` (the hash
    of block ``start - 1``, or the root)."""
    out = []
    for i in range(start, stop):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a job's tokens, block by block from the first: each block is
    on the device (``device``: block id, else None) or only on the host (``host``)."""

    device: tuple[int | None, ...] = ()
    host: tuple[int | None, ...] = ()
    #: Device hits some table or step already references: they cost no free block.
    in_use: tuple[int, ...] = ()
    #: Host hits no one references: reading them takes them out of the evictable ones.
    host_unreferenced: int = 0
    block_size: int = 1

    @property
    def num_blocks(self) -> int:
        return len(self.device)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_host(self) -> int:
        return sum(b is None for b in self.device)


class TierBlocks(BlockPool):
    """The free list, reference counts and prefix cache of one tier."""

    def __init__(self, num_blocks: int, name: str) -> None:
        super().__init__(num_blocks, name)
        self.refs: dict[int, int] = {}
        self.hash_of: dict[int, BlockHash] = {}
        self.by_hash: dict[BlockHash, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()   # evictable, oldest first
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks a new owner can take now: free plus cached-evictable."""
        return self.num_free + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.hash_of)

    def take(self, n: int) -> tuple[list[int], list[tuple[int, BlockHash]]]:
        """``n`` blocks, each referenced once: free ones first, then the least recently released
        cached ones, whose (block, hash) are returned as evicted (their KV is still there until
        something writes the block)."""
        if n > self.num_available:
            raise OutOfBlocks(f"{self.name} pool: {n} blocks wanted, {self.num_available} "
                              "free or evictable")
        fresh = min(n, self.num_free)
        blocks = self.allocate(fresh)
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
                self.release((b,))

    def unref_chain(self, blocks: Sequence[int]) -> None:
        """``unref`` a table's blocks: cached ones become evictable last block first (a block is
        only ever found through every block before it, so a chain's tail goes first); free ones
        are released in table order (the free list's order without caching)."""
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
        self.release(freed)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Cache ``block`` under ``block_hash`` (it must be referenced); False when the hash is
        already cached in another block (that one stays the cached copy) or the block has one."""
        if block_hash in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        return True

    def forget(self, block: int) -> None:
        """Its KV is not what its hash says (a failed copy): uncache it."""
        if block in self.hash_of:
            self._unhash(block)
            if block in self.lru:
                del self.lru[block]
                self.release((block,))

    def reset(self) -> int:
        """Uncache every block: evictable ones become free; referenced ones keep their owners but
        are found by no later lookup. Returns how many blocks were cached."""
        n = len(self.hash_of)
        for b in list(self.hash_of):
            self._unhash(b)
        self.release(self.lru)
        self.lru.clear()
        return n

    def _unhash(self, block: int) -> BlockHash:
        h = self.hash_of.pop(block)
        del self.by_hash[h]
        return h
