"""Prefix caching on a real tiny model: every job gets exactly the tokens it gets with the cache
off, for every policy × swap mode × chunking — with jobs that share a device-cached prefix a
running job holds, a prefix found only on the host (evicted from the device by fillers and
fetched back), one whose cached prefix was evicted part-way (its head still on the device, its
tail on the host or gone), and jobs swapped out or dropped while they share blocks.

Set-up (block size 4, 14 device blocks, 16 host blocks): the shared prefix P is 12 tokens (3
blocks). A and F1 start at once; B (P + 1 token) arrives while A still holds P; fillers arrive
later and push P's blocks off the device (tail first); C, D and E arrive after them.
"""

from __future__ import annotations

import pytest

from fastserve.scheduler.config import PolicyName, SwapMode
from fastserve.scheduler.job import JobRequest
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import CoreDriver
from tests.harness.fields import PROFILE, TINY
from tests.harness.scheduling import every_policy_and_mode, make

BLOCK = 4
DEVICE = 14
HOST = 16
P = tuple(range(20, 32))
#: step index at which each job arrives -> (job id, prompt, max tokens)
ARRIVALS: dict[int, list[tuple[str, tuple[int, ...], int]]] = {
    0: [("A", P + (40, 41, 42), 6), ("F1", tuple(range(60, 74)), 10)],
    3: [("B", P + (43,), 5)],
    12: [("F2", tuple(range(80, 96)), 4), ("F3", tuple(range(100, 113)), 4)],
    30: [("C", P + (44, 45), 4), ("D", P[:8] + (46, 47, 48), 3)],
    31: [("E", P + (40, 41, 42, 49), 3)],
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(policy: PolicyName, mode: SwapMode, chunked: bool, cache: bool
        ) -> tuple[dict[str, list[int]], Scheduler]:
    ex = InProcessExecutor(ModelSpec(TINY, num_device_blocks=DEVICE, num_host_blocks=HOST,
                                     block_size=BLOCK, seed=3))
    s = make(policy, batch=3, alpha=0.05, device=DEVICE, host=HOST, block=BLOCK, mode=mode,
             profile=PROFILE, cache=cache, chunk_tokens=4 if chunked else None,
             eos=frozenset({TINY.eos_token_id}))
    arrivals = {k: [JobRequest(job_id, prompt, greedy(n)) for job_id, prompt, n in jobs]
                for k, jobs in ARRIVALS.items()}
    try:
        tokens = CoreDriver(s, ex).run(arrivals)
    finally:
        ex.close()
    return tokens, s


@pytest.mark.parametrize("chunked", [False, True])
@every_policy_and_mode
def test_the_cache_changes_no_token(policy: PolicyName, mode: SwapMode, chunked: bool) -> None:
    off, _ = run(policy, mode, chunked, cache=False)
    on, s = run(policy, mode, chunked, cache=True)
    assert on == off
    assert sorted(on) == sorted(j for batch in ARRIVALS.values() for j, _, _ in batch)
    assert s.totals["prefix_cache_hits"] > 0
    stats = s.kv.cache_stats()
    # The fillers push P off the device; C, D or E find it (or part of it) on the host.
    assert stats["spilled_blocks"] > 0 and stats["fetched_blocks"] > 0, stats
    # Every reference was let go of: only free and cached-evictable blocks are left.
    assert not s.kv.device.refs and not s.kv.host.refs
