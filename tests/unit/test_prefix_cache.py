"""Automatic prefix caching (``fastserve.kv.prefix``, ``fastserve.kv.manager``): hand-computed block
accounting, the two tiers, the swap rule for shared blocks, and what the scheduler does with a
cached prefix (skip-join by the uncached suffix, service for it only, not ready before a copy
from the host landed)."""

from __future__ import annotations

import pytest

from fastserve.kv.manager import SPILL_JOB, KVCacheManager, Residency, Tier
from fastserve.kv.prefix import hash_block, root_hash
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig, SwapMode
from fastserve.scheduler.job import JobRequest
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import SamplingParams, StepOutput
from tests.harness.engine_driver import CoreDriver, TimedScript
from tests.harness.fields import PROFILE

BLOCK = 4
PREFIX = tuple(range(10, 22))            # 12 tokens: 3 full blocks


def manager(device: int = 16, host: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(block_size=BLOCK, num_device_blocks=device,
                                        num_host_blocks=host, prefix_caching=caching,
                                        swap_mode="proactive" if host else "recompute"))


def run_first_iteration(kv: KVCacheManager, job: str, tokens: tuple[int, ...], step: int) -> int:
    """Admit ``job`` for its prompt, complete its step, cache what it computed; returns the
    positions it found cached."""
    cached, fetch = kv.admit(job, len(tokens), step, lambda: tokens, runs=True)
    assert fetch is None
    kv.complete(step)
    kv.commit(job, len(tokens), lambda: tokens)
    return cached


def test_the_block_hash_chains_parent_tokens_and_key() -> None:
    root = root_hash("model-a")
    first = hash_block(root, (1, 2, 3, 4))
    assert hash_block(root, (1, 2, 3, 4)) == first
    assert hash_block(root_hash("model-b"), (1, 2, 3, 4)) != first     # another model
    assert hash_block(first, (5, 6, 7, 8)) != hash_block(root, (5, 6, 7, 8))   # another prefix
    assert hash_block(root, (1, 2, 3, 4), b"salt") != first


def test_two_jobs_sharing_a_three_block_prefix_hold_three_shared_blocks_and_their_own() -> None:
    kv = manager()
    a = PREFIX + (50,)                    # 13 tokens: 3 shared blocks + 1 of its own
    b = PREFIX + (60, 61, 62, 63, 64)     # 17 tokens: 3 shared + 2 of its own
    assert run_first_iteration(kv, "a", a, step=0) == 0
    assert kv.block_table("a") == (0, 1, 2, 3)
    assert run_first_iteration(kv, "b", b, step=1) == 12   # prefills positions 12..16 only
    assert kv.block_table("b") == (0, 1, 2, 4, 5)
    assert [kv.device.refs[x] for x in range(6)] == [2, 2, 2, 1, 1, 1]
    assert kv.num_free_device == 16 - 6                    # 3 shared + 1 (a) + 2 (b)
    assert kv.movable_blocks("a") == 1 and kv.movable_blocks("b") == 2
    kv.check_invariants({"a": 13, "b": 17})
    # The prefix survives a's finish: b still holds it, and a newcomer finds it.
    kv.free("a")
    assert 3 in kv.device.free_ids() and [kv.device.refs[x] for x in range(3)] == [1, 1, 1]
    c = PREFIX + (70, 71)
    assert kv.prefix_hit("c", len(c), lambda: c).device == (0, 1, 2)
    kv.free("b")    # b computed 17 positions: 4 full blocks cached, its partial one is free
    assert list(kv.device.lru) == [4, 2, 1, 0] and 5 in kv.device.free_ids()
    assert kv.num_free_device == 16
    kv.check_invariants({})
    assert run_first_iteration(kv, "c", c, step=2) == 12
    assert kv.block_table("c")[:3] == (0, 1, 2)


def test_a_fully_cached_prompt_still_computes_its_last_position() -> None:
    kv = manager()
    run_first_iteration(kv, "a", PREFIX, step=0)           # 12 tokens: 3 full blocks cached
    kv.free("a")
    hit = kv.prefix_hit("b", len(PREFIX), lambda: PREFIX)
    assert hit.tokens == 8              # blocks 0-1; block 2 holds the position to sample
    assert kv.prefix_hit("c", 13, lambda: PREFIX + (9,)).tokens == 12


def test_eviction_is_lru_over_unreferenced_blocks_tail_first() -> None:
    kv = manager(device=6, host=0)
    x, y = (1,) * 9, (2,) * 9                              # 2 full blocks + 1 each
    run_first_iteration(kv, "x", x, step=0)                 # blocks 0 1 2
    run_first_iteration(kv, "y", y, step=1)                 # blocks 3 4 5
    kv.free("x")
    kv.free("y")
    assert list(kv.device.lru) == [1, 0, 4, 3]              # x first, each tail first
    assert sorted(kv.device.free_ids()) == [2, 5]           # partial blocks: not cached
    # Four new blocks: the two free ones, then x's chain (released first), tail first.
    kv.allocate("z", 16, step=2)
    assert kv.block_table("z") == (5, 2, 1, 0)
    assert kv.prefix_hit("x2", 9, lambda: x).tokens == 0
    assert kv.prefix_hit("y2", 9, lambda: y).tokens == 8    # y's chain is still there
    assert kv.flush_evicted(2) is None                      # no host room: dropped
    kv.check_invariants({"z": 16})


def test_a_device_evicted_cached_block_is_found_on_the_host_and_fetched_back() -> None:
    kv = manager(device=4, host=4)
    x = (1,) * 9
    run_first_iteration(kv, "x", x, step=0)                 # blocks 0 1 (cached) 2
    kv.free("x")
    kv.allocate("z", 16, step=1)                            # evicts 1 then 0
    spill = kv.flush_evicted(1)
    assert spill is not None and spill.job_id == SPILL_JOB and spill.direction == "out"
    assert spill.src_blocks == (1, 0)
    assert kv.prefix_hit("x2", 9, lambda: x).tokens == 0    # not cached until the copy lands
    kv.complete(1)
    kv.check_invariants({"z": 16})
    hit = kv.prefix_hit("x2", 9, lambda: x)
    assert hit.device == (None, None) and hit.host == (1, 0) and hit.tokens == 8
    kv.free("z")
    cached, fetch = kv.admit("x2", 9, 2, lambda: x, runs=False)
    assert cached == 8 and fetch is not None and fetch.src_blocks == (1, 0)
    assert kv.residency("x2") is Residency.TRANSIT          # not ready before it lands
    kv.check_invariants({"x2": 9})
    assert kv.complete(2) == ["x2"] and kv.residency("x2") is Residency.RESIDENT
    assert kv.prefix_hit("x3", 9, lambda: x).device == tuple(kv.block_table("x2")[:2])
    kv.check_invariants({"x2": 9})


def test_swapping_out_a_job_frees_only_the_blocks_no_other_job_holds() -> None:
    """The rule (``KVCacheManager.swap_out``): shared blocks stay on the device for the job
    that holds them; the swapped-out job gets its own host copy and holds nothing on the
    device; its swap-in references the blocks the device still caches and copies the rest."""
    kv = manager(device=16, host=8)
    run_first_iteration(kv, "a", PREFIX + (50,), step=0)
    run_first_iteration(kv, "b", PREFIX + (60, 61, 62, 63, 64), step=1)
    free_before = kv.num_free_device
    out = kv.swap_out("b", step=2)
    assert out.src_blocks == (0, 1, 2, 4, 5) and len(out.dst_blocks) == 5
    assert kv.num_free_device == free_before                # only b's 2 blocks: released later
    assert kv.device_releasing == 2
    kv.check_invariants({"a": 13, "b": 17})
    kv.complete(2)
    assert kv.num_free_device == free_before + 2 and kv.tier("b") is Tier.HOST
    assert [kv.device.refs.get(x) for x in range(3)] == [1, 1, 1]   # a's, and only a's
    # Back: the shared prefix and b's cached full block 4 (evictable on the device since the
    # swap-out) are referenced; only the partial block is copied.
    back = kv.swap_in("b", step=3)
    assert back.src_blocks == out.dst_blocks[4:]
    assert kv.block_table("b")[:4] == (0, 1, 2, 4)
    kv.complete(3)
    kv.check_invariants({"a": 13, "b": 17})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def scheduler(cache: bool, mode: SwapMode = "proactive", device: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(starvation_alpha_s=1000.0),
                     KVCacheConfig(block_size=BLOCK, num_device_blocks=device, num_host_blocks=16,
                                   swap_mode=mode, prefix_caching=cache),
                     PROFILE, frozenset({2}))


def finish(s: Scheduler, now: float) -> float:
    """Every job to its end from ``now``, a token 9 each step of 0.01 s; the time it ends."""
    driver = CoreDriver(s, TimedScript(lambda job_id, index: 9, 0.01), now=now)
    driver.run()
    return driver.now


@pytest.mark.parametrize("cache", [True, False])
def test_skip_join_places_a_job_by_its_uncached_suffix_and_charges_only_that(cache: bool) -> None:
    """PROFILE: t_init(n) = 0.01 + 0.09·(n−1)/63, q1 = 0.01, quanta 0.01, 0.02, 0.04, 0.08, ...
    A 61-token prompt whose first 60 tokens are cached computes 1 token: t_init(1) = q1,
    level 1; in full, t_init(61) ≈ 0.0957: level 5."""
    s = scheduler(cache)
    long = tuple(range(3, 63))
    s.add(JobRequest("warm", long, greedy(1)), 0.0)
    now = finish(s, 0.0)
    job = s.add(JobRequest("next", long + (99,), greedy(3)), now)
    assert job.level == (1 if cache else 5)
    plan = s.schedule(now)
    assert plan is not None
    (entry,) = plan.entries
    assert (entry.start_pos, len(entry.token_ids)) == ((60, 1) if cache else (0, 61))
    s.update(plan, StepOutput(plan.step_id, {"next": 9}, {"total": 0.01}), now + 0.01)
    assert job.attained_s == pytest.approx(PROFILE.t_init(1 if cache else 61))
    finish(s, now + 0.01)
    assert job.stats.cached_tokens == (60 if cache else 0)
    assert job.stats.as_dict()["cached_tokens"] == (60 if cache else 0)
    assert s.totals["prefix_cache_hits"] == (60 if cache else 0)


@pytest.mark.parametrize("warm_salt,next_salt,cached", [(None, None, 60), ("t1", "t1", 60), ("t1", None, 0),
                                                         (None, "t1", 0), ("t1", "t2", 0)])
def test_only_jobs_with_the_same_cache_salt_share_a_prefix(warm_salt: str | None, next_salt: str | None,
                                                           cached: int) -> None:
    s = scheduler(cache=True)
    long = tuple(range(3, 63))
    s.add(JobRequest("warm", long, greedy(1), cache_salt=warm_salt), 0.0)
    now = finish(s, 0.0)
    job = s.add(JobRequest("next", long + (99,), greedy(3), cache_salt=next_salt), now)
    assert job.cached_at_arrival == cached
    finish(s, now)
    assert job.stats.cached_tokens == cached
    assert s.state.kv.prefix._salted_roots == {}     # forgotten with the jobs


def test_a_salt_after_the_first_lookup_is_refused() -> None:
    kv = manager()
    kv.prefix_hit("a", len(PREFIX), lambda: PREFIX)
    with pytest.raises(ValueError, match="job a: salted after its blocks were hashed"):
        kv.prefix.salt("a", "t1")


def test_a_job_whose_prefix_is_on_the_host_is_not_ready_until_the_copy_lands() -> None:
    """Proactive: the first plan after the arrival fetches the host blocks (no entry for the
    job), the next runs only the uncached suffix."""
    s = scheduler(True, device=8)
    warm = tuple(range(3, 20))                   # 17 tokens: 4 full blocks + 1
    s.add(JobRequest("warm", warm, greedy(1)), 0.0)
    now = finish(s, 0.0)
    s.add(JobRequest("filler", tuple(range(40, 68)), greedy(1)), now)   # 7 blocks: evicts
    now = finish(s, now)
    # 8 device blocks: warm's 4 cached ones go tail first; the filler takes 3 of them.
    assert s.kv.cache_stats()["spilled_blocks"] == 3
    s.add(JobRequest("again", warm, greedy(2)), now)
    assert s.jobs()["again"].cached_at_arrival == 16
    plan = s.schedule(now)
    assert plan is not None and not plan.entries and [c.job_id for c in plan.swap_in] == ["again"]
    assert len(plan.swap_in[0].src_blocks) == 3              # block 0 was still on the device
    assert s.kv.residency("again") is Residency.TRANSIT
    assert s.schedule(now) is None               # nothing to run before it lands
    s.update(plan, StepOutput(plan.step_id, {}, {"total": 0.01}), now + 0.01)
    plan = s.schedule(now + 0.01)
    assert plan is not None
    (entry,) = plan.entries
    assert (entry.start_pos, len(entry.token_ids)) == (16, 1)
    s.check_invariants()
