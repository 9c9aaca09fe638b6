"""Automatic prefix caching: block hashes and the ``PrefixCache`` over both tiers.

Only full blocks a completed step computed are cached, under ``hash(parent, token ids, extra)``
chained from a root that names what else shapes KV. A full block is never written again, so jobs
share it by reference (no copy-on-write); a fully cached prompt still computes its last position.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastserve.kv.blocks import BlockHash, TierBlocks


def root_hash(key: str) -> BlockHash:
    return hashlib.sha256(b"fastserve-prefix\0" + key.encode()).digest()


def salted_root(root: BlockHash, salt: str) -> BlockHash:
    """vLLM's ``cache_salt``: only the same salt finds these blocks."""
    return hashlib.sha256(root + b"\0cache-salt\0" + salt.encode()).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """SHA-256, so distinct prefixes never share KV by a collision."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def hash_blocks(parent: BlockHash, tokens: Sequence[int], block_size: int, start: int,
                stop: int) -> list[BlockHash]:
    """Full blocks ``start .. stop-1``, chained from ``parent`` (block ``start - 1``'s hash, or the root)."""
    out = []
    for i in range(start, stop):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix, per block: on the device (``device``, else None) or only on host."""

    device: tuple[int | None, ...] = ()
    host: tuple[int | None, ...] = ()
    in_use: tuple[int, ...] = ()   # device hits already referenced: they cost no free block
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


class PrefixCache:
    def __init__(self, device: TierBlocks, host: TierBlocks, block_size: int, key: str,
                 enabled: bool, host_tier: bool) -> None:
        self.device = device
        self.host = host
        self.block_size = block_size
        self.enabled = enabled
        self.host_enabled = enabled and host_tier
        self._root = root_hash(key)
        self._chains: dict[str, list[BlockHash]] = {}
        self._salted_roots: dict[str, BlockHash] = {}

    def salt(self, job_id: str, salt: str) -> None:
        """Before the job's first lookup."""
        if job_id in self._chains:
            raise ValueError(f"job {job_id}: salted after its blocks were hashed")
        self._salted_roots[job_id] = salted_root(self._root, salt)

    def hashes(self, job_id: str, n: int, tokens: Callable[[], Sequence[int]]) -> list[BlockHash]:
        have = self._chains.setdefault(job_id, [])
        if len(have) < n:
            parent = have[-1] if have else self._salted_roots.get(job_id, self._root)
            have.extend(hash_blocks(parent, tokens(), self.block_size, len(have), n))
        return have[:n]

    def lookup(self, job_id: str, num_tokens: int, tokens: Callable[[], Sequence[int]],
               max_host: int | None = None) -> PrefixHit:
        """In full blocks, leaving the last position to compute (it is sampled); at most ``max_host``
        blocks from the host."""
        if not self.enabled:
            return PrefixHit(block_size=self.block_size)
        device: list[int | None] = []
        host: list[int | None] = []
        in_use: list[int] = []
        host_free = n_host = 0
        for h in self.hashes(job_id, (num_tokens - 1) // self.block_size, tokens):
            d = self.device.by_hash.get(h)
            hb = None if d is not None or not self.host_enabled else self.host.by_hash.get(h)
            if d is None and (hb is None or (max_host is not None and n_host >= max_host)):
                break
            n_host += d is None
            device.append(d)
            host.append(hb)
            if d is not None and d in self.device.refs:
                in_use.append(d)
            host_free += hb is not None and hb not in self.host.refs
        return PrefixHit(tuple(device), tuple(host), tuple(in_use), host_free, self.block_size)

    def forget_chain(self, job_id: str) -> None:
        self._chains.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        self._chains.pop(job_id, None)
        self._salted_roots.pop(job_id, None)

    def reset(self) -> int:
        return self.device.reset() + self.host.reset()
