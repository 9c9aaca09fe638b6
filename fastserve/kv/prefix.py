"""Automatic prefix caching: block hashes, and the ``PrefixCache`` over both tiers that the
``KVCacheManager`` holds.

**What is shared.** Only *full* blocks whose KV a completed step computed are cached, keyed by a
chained hash: ``hash(parent block's hash, the block's token ids, extra)``, the root seeded by a
key that names what else changes KV (the model; later adapters). Equal hashes mean equal token
prefixes, so equal KV. A full block is immutable — no step ever writes it again — so jobs share it
by reference and no copy-on-write is needed: a job's last, partial block is always its own, and a
fully cached prompt still computes its last position (to sample), as vLLM does.

**The cache over both tiers** (``PrefixCache``): each job's chain of block hashes (rooted in the
model's key, or in its cache salt) and the longest prefix of a job's tokens cached on the device
or, failing that, the host. It reads the tiers' hash maps (``fastserve.kv.blocks.TierBlocks``);
what is cached, evicted or copied is the manager's to decide. A job that asks for prompt
logprobs reads no cached block (``never_read``): each prompt position's logits exist only while
its KV is computed, so its prompt runs whole, as vLLM v1 skips cache hits for such requests; its
blocks are cached for the jobs after it all the same.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastserve.kv.blocks import BlockHash, TierBlocks


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


class PrefixCache:
    """Each job's block hashes and the longest cached prefix of its tokens, over the device and
    host tiers (``TierBlocks``) of one ``KVCacheManager``."""

    def __init__(self, device: TierBlocks, host: TierBlocks, block_size: int, key: str,
                 enabled: bool, host_tier: bool) -> None:
        self.device = device
        self.host = host
        self.block_size = block_size
        self.enabled = enabled
        #: Cached blocks evicted from the device move to the host, and are found there.
        self.host_enabled = enabled and host_tier
        self._root = root_hash(key)
        self._chains: dict[str, list[BlockHash]] = {}
        self._salted_roots: dict[str, BlockHash] = {}   # jobs with a cache salt: their chain's root
        #: Jobs that read no cached block (they need every prompt position computed); their own
        #: blocks are still cached for others.
        self._no_reads: set[str] = set()

    def salt(self, job_id: str, salt: str) -> None:
        """Only jobs with this salt share cached blocks with ``job_id`` (vLLM's ``cache_salt``);
        called before its prefix is first looked up, kept until it is forgotten."""
        if job_id in self._chains:
            raise ValueError(f"job {job_id}: salted after its blocks were hashed")
        self._salted_roots[job_id] = salted_root(self._root, salt)

    def never_read(self, job_id: str) -> None:
        """``job_id`` finds no cached prefix (``lookup`` is empty for it) until it is forgotten:
        a job whose every prompt position must run the model (prompt logprobs)."""
        self._no_reads.add(job_id)

    def hashes(self, job_id: str, n: int, tokens: Callable[[], Sequence[int]]) -> list[BlockHash]:
        """The hashes of the job's first ``n`` full blocks (computed once, then extended)."""
        have = self._chains.setdefault(job_id, [])
        if len(have) < n:
            parent = have[-1] if have else self._salted_roots.get(job_id, self._root)
            have.extend(hash_blocks(parent, tokens(), self.block_size, len(have), n))
        return have[:n]

    def lookup(self, job_id: str, num_tokens: int, tokens: Callable[[], Sequence[int]],
               max_host: int | None = None) -> PrefixHit:
        """The longest cached prefix of the job's first ``num_tokens`` positions, in full blocks,
        leaving at least its last position to compute (it is sampled). Each block is found on
        the device or, failing that, on the host (host tier on; at most ``max_host`` blocks)."""
        if not self.enabled or job_id in self._no_reads:
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
        """Drop the job's hashes (its KV is gone; they are computed again if it is looked up)."""
        self._chains.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        """The job is gone: its hashes and its salt."""
        self._chains.pop(job_id, None)
        self._salted_roots.pop(job_id, None)
        self._no_reads.discard(job_id)

    def reset(self) -> int:
        """Uncache every block of both tiers; returns how many were cached."""
        return self.device.reset() + self.host.reset()
