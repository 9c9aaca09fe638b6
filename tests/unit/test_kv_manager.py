"""The KV-cache manager: block tables, two tiers, deferred frees, swap planning by ENST, the
reserve, recompute, admission when both tiers are full, and the integrity check itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastserve.kv.enst import EnstTable
from fastserve.kv.manager import KVCacheManager, Residency, Tier
from fastserve.kv.swap_planner import PoolCounts, SwapDecision, plan_swaps
from fastserve.scheduler.apply import Applied
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig, SwapMode
from fastserve.scheduler.decision import BatchDecision, Decision
from fastserve.scheduler.queues import LevelQueues
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchEntry, StepOutput, SwapCommand
from tests.harness.engine_driver import CoreDriver, TimedScript
from tests.harness.scheduling import PROFILE, TOKEN, ids, make, req, step


def manager(device: int = 8, host: int = 8, block: int = 4) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(block_size=block, num_device_blocks=device,
                                        num_host_blocks=host))


# ---- block tables -------------------------------------------------------------------------
def test_first_iteration_allocates_exactly_the_positions_it_writes() -> None:
    kv = manager()
    assert [kv.blocks_for(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert kv.allocate("a", 5, step=0) == (0, 1)       # positions 0..4: two blocks of 4
    assert kv.allocate("b", 4, step=0) == (2,)
    assert kv.num_free_device == 5
    assert kv.residency("a") is Residency.RESIDENT and kv.busy_step("a") == 0
    kv.check_invariants({"a": 5, "b": 4})
    with pytest.raises(ValueError, match="already used by in-flight step 0"):
        kv.allocate("a", 6, step=1)


def test_decode_growth_adds_a_block_only_when_crossing_a_boundary() -> None:
    kv = manager()
    kv.allocate("a", 5, step=0)
    kv.complete(0)
    tables = []
    for step_id, context in enumerate((6, 7, 8, 9), start=1):
        tables.append(kv.allocate("a", context, step=step_id))
        kv.complete(step_id)
    assert tables == [(0, 1), (0, 1), (0, 1), (0, 1, 2)]
    assert kv.device_blocks_needed("a", 13) == 1 and kv.device_blocks_needed("a", 12) == 0


def test_blocks_of_an_in_flight_step_are_freed_only_when_it_completes() -> None:
    kv = manager()
    kv.allocate("a", 8, step=3)
    kv.free("a")                                   # aborted while its step runs
    assert kv.num_free_device == 6 and kv.device_releasing == 2
    kv.check_invariants({})                        # the two blocks are "in flight"
    assert kv.complete(3) == []
    assert kv.num_free_device == 8 and kv.device_releasing == 0
    kv.check_invariants({})


def test_swap_out_and_in_settle_when_their_step_completes() -> None:
    kv = manager(device=4, host=4)
    kv.allocate("a", 6, step=0)
    kv.complete(0)
    out = kv.swap_out("a", step=1)
    assert out == SwapCommand("out", "a", (0, 1), (0, 1))
    assert kv.residency("a") is Residency.TRANSIT and kv.tier("a") is Tier.HOST
    assert kv.num_free_device == 2 and kv.num_free_host == 2   # source held until completion
    kv.check_invariants({"a": 6})
    assert kv.complete(1) == ["a"]
    assert kv.residency("a") is Residency.HOST and kv.num_free_device == 4
    back = kv.swap_in("a", step=2)
    assert back.direction == "in" and back.src_blocks == (0, 1) and len(back.dst_blocks) == 2
    assert kv.num_free_host == 2                   # host copy held until completion
    kv.complete(2)
    assert kv.residency("a") is Residency.RESIDENT and kv.num_free_host == 4
    kv.check_invariants({"a": 6})


def test_abort_during_a_swap_keeps_both_sides_until_it_completes() -> None:
    kv = manager(device=4, host=4)
    kv.allocate("a", 8, step=0)
    kv.complete(0)
    kv.swap_out("a", step=1)
    kv.free("a")
    assert kv.num_free_device == 2 and kv.num_free_host == 2
    kv.check_invariants({})
    kv.complete(1)
    assert kv.num_free_device == 4 and kv.num_free_host == 4


def test_drop_frees_at_once_but_never_blocks_in_flight() -> None:
    kv = manager()
    kv.allocate("a", 8, step=0)
    with pytest.raises(ValueError, match="in-flight"):
        kv.drop("a")
    kv.complete(0)
    assert kv.drop("a") == 2 and kv.num_free_device == 8 and kv.tier("a") is Tier.NONE


# ---- the integrity check ------------------------------------------------------------------
@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda kv: kv.device._free.append(kv._jobs["a"].blocks[0]), "is both"),
    (lambda kv: kv.device._free.remove(7), "neither free, owned nor in flight"),
    (lambda kv: kv.device._free.append(99), "outside"),
    (lambda kv: setattr(kv._jobs["a"], "num_tokens", 9), "2 blocks for 9 positions"),
    (lambda kv: kv.host._free.pop(), "host blocks"),
    (lambda kv: setattr(kv, "device_releasing", 1), "device_releasing=1"),
])
def test_invariant_checker_catches_a_corrupted_state(
        corrupt: Callable[[KVCacheManager], object], message: str) -> None:
    kv = manager()
    kv.allocate("a", 8, step=0)
    kv.check_invariants({"a": 8})
    corrupt(kv)
    with pytest.raises(AssertionError, match=message):
        kv.check_invariants({"a": 8})


def test_invariant_checker_compares_tables_with_the_jobs_context() -> None:
    kv = manager()
    kv.allocate("a", 8, step=0)
    with pytest.raises(AssertionError, match="table covers 8 positions, the job has 7"):
        kv.check_invariants({"a": 7})
    with pytest.raises(AssertionError, match="holds KV but is not active"):
        kv.check_invariants({})


def test_scheduler_check_catches_a_job_misfiled_in_its_queue() -> None:
    s = make()
    s.add(req("a", 8), 0.0)
    step(s, 0.0, 0.5)
    s.queues.level(1).pending.add("a", 0)     # resident and runnable: must be in "ready"
    with pytest.raises(AssertionError, match="expected \\['evictable', 'ready'\\]"):
        s.check_invariants()


# ---- swap planning by ENST ----------------------------------------------------------------
def _four_jobs(mode: SwapMode = "proactive", reserved: int = 9, cache: bool = True) -> Scheduler:
    """p, q, r, s4 in levels 1..4 (1, 2, 4 and 8 blocks of 8 tokens), all run their first
    iteration in step 0 (15 of 16 device blocks); at t = 0.5 each needs one more block."""
    s = Scheduler(SchedulerConfig(max_batch_size=4, starvation_alpha_s=100.0),
                  KVCacheConfig(block_size=8, num_device_blocks=16, num_host_blocks=32,
                                reserved_blocks=reserved, swap_mode=mode,
                                prefix_caching=cache),
                  PROFILE, eos_token_ids=frozenset({2}))
    for name, prompt in (("p", 8), ("q", 16), ("r", 32), ("s4", 64)):
        s.add(req(name, prompt, max_tokens=8), 0.0)
    plan, _ = step(s, 0.0, 0.5)
    assert ids(plan) == ["p", "q", "r", "s4"] and s.kv.num_free_device == 1
    return s


def test_growth_takes_kv_from_the_lowest_priority_job_one_plan_ahead() -> None:
    s = _four_jobs()
    plan = s.schedule(0.5)
    assert plan is not None
    s.check_invariants()
    # p takes the last free block. q (level 2) and r (level 3) need one more block each: both
    # take it from s4 (level 4, 8 blocks, the only job below them), swapped out by this plan;
    # they run at the next decision, when its blocks are free. Nothing else is evicted: q and
    # r claimed the blocks, and the reserve (9) cannot be met from anyone else's without a
    # victim below them. s4's ENST at the swap: ((q1+q2+q3) + (q2+q3) + q3)/4 = 4.25 s of
    # service, at 0.5 s of wall per second of service (step 0 took 0.5 s, q1 = 1).
    assert ids(plan) == ["p"]
    assert [c.job_id for c in plan.swap_out] == ["s4"]
    assert s.jobs()["s4"].predictions == [(0.5, 2.125)]
    s.update(plan, StepOutput(plan.step_id, {"p": TOKEN}, {"total": 0.5}), 1.0)
    s.check_invariants()
    assert s.kv.num_free_device == 8
    plan, _ = step(s, 1.0, 0.5)
    # p (0.5 + 1 > q1) is now in level 2 behind q.
    assert ids(plan) == ["q", "p", "r"]
    assert [len(e.block_table) for e in plan.entries] == [3, 2, 5]


def test_swap_in_and_out_order_merges_levels_by_enst() -> None:
    # Host jobs a (level 2, last served 0), b (level 2, 3.0), c (level 4, 0.2); α = 5 for each
    # (promotion due at 5, 8, 5.2); B = 2, counts 2, 2, 0, 1 -> waits 0, 1, 5, 13. At now = 4.5:
    # ENST(a) = min(5 - 4.5, 1) = 0.5, ENST(b) = min(8 - 4.5, 1) = 1, ENST(c) = min(0.7, 13) = 0.7
    # c, deep in level 4 but about to be promoted, comes back before b from level 2.
    queues = LevelQueues(4)
    queues.counts[:] = [2, 2, 0, 1]
    due = {"a": 5.0, "b": 8.0, "c": 5.2}
    level = {"a": 2, "b": 2, "c": 4}
    for job_id in due:
        queues.level(level[job_id]).onhost.add(job_id, due[job_id])
        queues.level(level[job_id]).evictable.add(job_id, -due[job_id])
    table = EnstTable(queues.counts, [1.0, 2.0, 4.0, 8.0], 2, 4.5)
    assert [table(level[j], due[j]) for j in "abc"] == pytest.approx([0.5, 1.0, 0.7])
    assert table(1, None) == 0.0 and table(4, None) == 13.0     # never promoted: its level's wait
    assert list(queues.ordered("onhost", lambda lv, j: table(lv, due[j]))) == ["a", "c", "b"]
    assert list(queues.ordered("evictable", lambda lv, j: -table(lv, due[j]))) == ["b", "c", "a"]
    assert len(queues.level(2).onhost) == 2       # the walk leaves the sets as they were
    assert list(queues.ordered("evictable")) == ["b", "a", "c"]         # levels highest first
    assert list(queues.ordered("evictable", lowest_first=True)) == ["c", "b", "a"]


def test_planner_prefetches_while_the_reserve_stays_free() -> None:
    kv = manager(device=10, host=10, block=1)
    for job_id, n in (("x", 3), ("y", 3), ("z", 3)):
        kv.allocate(job_id, n, step=0)
    kv.complete(0)
    for job_id in ("x", "y", "z"):
        kv.swap_out(job_id, step=1)
    kv.complete(1)
    pools = PoolCounts(kv.num_free_device, kv.num_free_host)
    decision = plan_swaps(kv, pools, keep_free=3, wanted={}, prefetch=["y", "x", "z"],
                          victims=[], can_evict=lambda j: True, drop=False)
    assert decision.swap_in == ["y", "x"]          # 10 - 3 - 3 = 4 >= 3; a third would leave 1


def test_planner_brings_wanted_jobs_first_and_passes_over_what_does_not_fit() -> None:
    # Device 10 blocks, keep 2 free. On the host: big (6), small (1), w (3), tiny (1).
    # The next batch wants w: it comes first although ENST ranks it third; then big does not
    # fit (10 - 3 - 6 < 2) and is passed over, not the end: small and tiny still come in.
    kv = manager(device=10, host=16, block=1)
    for job_id, n in (("big", 6), ("small", 1), ("w", 3), ("tiny", 1)):
        kv.allocate(job_id, n, step=0)
        kv.complete(0)
        kv.swap_out(job_id, step=1)
        kv.complete(1)
    pools = PoolCounts(kv.num_free_device, kv.num_free_host)
    decision = plan_swaps(kv, pools, keep_free=2, wanted={"w": 3},
                          prefetch=["big", "small", "w", "tiny"], victims=[],
                          can_evict=lambda j: True, drop=False)
    assert decision.swap_in == ["w", "small", "tiny"]
    assert not decision.swap_out


def test_a_swap_in_pin_expires_after_swap_pin_plans() -> None:
    # Swapped in by step 2 (settled when it returns, before decision 3), "a" is no swap-out
    # victim for the next swap_pin_plans (2) decisions, steps 3 and 4, whether or not it ran;
    # from step 5 it is an ordinary candidate again.
    s = make(device=16, host=16)
    assert s.kv_config.swap_pin_plans == 2
    s.add(req("a", 8), 0.0)
    step(s, 0.0, 0.5)                                       # step 0: a's first iteration
    a = s.jobs()["a"]
    for k, swaps in ((1, SwapDecision(swap_out=["a"])), (2, SwapDecision(swap_in=["a"]))):
        s.applier.apply(Decision(k, BatchDecision(), swaps), 0.5, Applied())
        s.state.next_step = k + 1
        s.applier.settle(s.kv.complete(k), 0.5)
        s.check_invariants()
    assert a.pinned_until == 4
    assert [s.view.pinned("a", k) for k in (3, 4, 5)] == [True, True, False]


@pytest.mark.parametrize("batch", [2, 3])
def test_a_promoted_job_on_the_host_is_wanted_at_its_rank(batch: int) -> None:
    # p (level 4) ran once and was swapped out; r1 (level 1) and r2 (level 2) are resident. p is
    # promoted to level 1, behind r1: the walk wants it (its 9 blocks of 8 tokens, table and
    # growth) before r2, whatever the batch size, and sets those blocks aside — a promotion
    # bounds its wait only if its KV is brought back for it (11 blocks are free: r2 still fits).
    # (``req`` prompts share their first tokens: no prefix caching, or r2 joins level 1.)
    s = Scheduler(SchedulerConfig(max_batch_size=batch, starvation_alpha_s=1000.0),
                  KVCacheConfig(block_size=8, num_device_blocks=16, num_host_blocks=32,
                                reserved_blocks=7, prefix_caching=False),
                  PROFILE, eos_token_ids=frozenset({2}))
    s.add(req("p", 64, max_tokens=8), 0.0)
    step(s, 0.0, 7.0)
    s.applier.apply(Decision(1, BatchDecision(), SwapDecision(swap_out=["p"])), 7.0, Applied())
    s.applier.settle(s.kv.complete(1), 7.0)
    s.state.next_step = 2
    s.add(req("r1", 8, max_tokens=8), 7.0)
    s.add(req("r2", 16, max_tokens=8), 7.0)
    plan, _ = step(s, 7.0, 1.0)
    assert ids(plan) == ["r1", "r2"] and s.kv.residency("p") is Residency.HOST
    p = s.jobs()["p"]
    s.applier.promote(p, 1, 8.0)
    s.check_invariants()
    decision = s.batcher.plan(s.state.next_step)
    assert [r.job_id for r in decision.runs] == ["r1", "r2"]
    assert decision.wanted_host == {"p": 9}
    assert decision.free_device == 16 - 2 - 3 - 9


def test_adaptive_reserve_follows_recent_arrivals() -> None:
    s = Scheduler(SchedulerConfig(), KVCacheConfig(
        block_size=8, num_device_blocks=40, num_host_blocks=40, reserved_blocks=2,
        adaptive_reserve=True, adaptive_window_s=1.0, adaptive_max_fraction=0.25), PROFILE, frozenset({2}))
    for name, prompt in (("a", 8), ("b", 16), ("c", 24)):    # 1 + 2 + 3 prompt blocks
        s.add(req(name, prompt), 0.0)
    assert s.reserve_blocks(0.5) == 2 + 6
    s.add(req("d", 64), 0.6)                                  # 8 more: capped at 40/4 = 10
    assert s.reserve_blocks(0.7) == 2 + 10
    assert s.reserve_blocks(1.5) == 2 + 8                     # a, b, c left the window
    assert s.reserve_blocks(3.0) == 2


# ---- recompute ----------------------------------------------------------------------------
def test_recompute_drops_the_lowest_priority_job_and_replays_prompt_plus_output() -> None:
    # (With prefix caching the replay takes its own cached blocks: test_prefix_cache.py.)
    s = _four_jobs(mode="recompute", reserved=0, cache=False)
    plan = s.schedule(0.5)
    # p takes the last free block; q's growth drops s4 (the lowest priority) and runs in this
    # very plan in its freed blocks, and so does r's.
    assert plan is not None and ids(plan) == ["p", "q", "r"] and not plan.swap_out
    s4 = s.jobs()["s4"]
    assert s4.stats.recomputes == 1 and s.kv.tier("s4") is Tier.NONE
    assert s.kv.num_free_device == 8 - 2               # dropped blocks are free at once
    s.update(plan, StepOutput(plan.step_id, {j: TOKEN for j in ids(plan)}, {"total": 0.5}), 1.0)
    s.check_invariants()
    replays: list[BatchEntry] = []
    now = 1.0
    while s.has_work() and not replays:
        plan, _ = step(s, now, 0.5)
        replays = [e for e in plan.entries if e.job_id == "s4"]
        now += 0.5
    (entry,) = replays
    assert entry.is_prefill and entry.start_pos == 0
    assert entry.token_ids == tuple(range(3, 67)) + (TOKEN,)   # prompt + its one token
    assert entry.step_index == 1


# ---- admission when both tiers are full ---------------------------------------------------
def test_new_jobs_wait_while_both_tiers_are_full_and_nothing_is_killed() -> None:
    # Device and host hold 2 blocks each (4 tokens a block); every job needs 1 block, 2 at its
    # last token. A first iteration and one decode exhaust level 1, so each new job (level 1)
    # takes the device from the level-2 jobs before it until both tiers are full; then jobs
    # wait for admission (the stall breaker drops only for an admitted job: D once, for C).
    s = make(batch=1, device=2, host=2, block=4)
    for name in "ABCDE":
        s.add(req(name, 3, max_tokens=3), 0.0)
    admitted: set[str] = set()
    reasons = {}
    # A plan with a first iteration takes 1.5 s, a decode-only one 1 s.
    driver = CoreDriver(s, TimedScript(lambda job_id, index: TOKEN,
                                       lambda plan: 1.5 if any(e.is_prefill for e in plan.entries) else 1.0),
                        step_s=None)
    k = 0
    while s.has_work():
        if k == 4:
            driver.add(req("N", 3, max_tokens=2))
        full = s.kv.num_free_device == 0 and s.kv.num_free_host == 0
        plan = driver.schedule()
        assert plan is not None
        new = {e.job_id for e in plan.entries} - admitted
        if full:
            assert not new, f"step {k}: admitted {new} while both tiers were full"
        admitted |= new
        for d in driver.complete():
            if d.finished:
                reasons[d.job_id] = (d.finish_reason, k)
        k += 1
    assert {j: r for j, (r, _) in reasons.items()} == dict.fromkeys("ABCDEN", "length")
    assert reasons["A"][1] == 14 and reasons["N"][1] == 13 and "N" in admitted
    assert s.totals["swaps_out"] > 0 and s.totals["errors"] == 0
