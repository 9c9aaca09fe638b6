"""Rules of the scheduler, each with hand-computed expectations.

Time is virtual: every step is charged exactly the ``total`` the test passes (or the profile's
cost model, via ``CostModelExecutor``). Numbers are chosen binary-exact (0.5, 1, 1.5, ...) so
float comparisons are exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from fastserve.bench.sim.driver import CostModelExecutor, constant_tokens, drive
from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.kv.enst import enst, level_waits
from fastserve.scheduler.config import (
    KVCacheConfig,
    PolicyName,
    SchedulerConfig,
    SwapMode,
    alpha_from_slo,
)
from fastserve.scheduler.job import JobRequest, JobState, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import AdmissionQueueFull
from fastserve.worker.messages import BatchPlan, StepOutput
from tests.harness.scheduling import EOS, PROFILE, ROOT, TOKEN, greedy, ids, make, req, step


# ---- profile ------------------------------------------------------------------------------
def test_profile_interpolates_and_extrapolates() -> None:
    assert PROFILE.t_init(8) == 0.5
    assert PROFILE.t_init(12) == 1.0          # halfway between 0.5 and 1.5
    assert PROFILE.t_init(48) == 5.0          # 3.0 + 4.0 * 16/32
    assert PROFILE.t_init(96) == 11.0         # last segment's slope (1/8 per token) continued
    assert PROFILE.t_init(4) == 0.5           # extrapolates to 0.0: never below the smallest
    assert PROFILE.t_dec(1) == 1.0 and PROFILE.t_dec(16) == 2.0
    assert PROFILE.t_dec(4) == pytest.approx(1.2)
    assert PROFILE.q1 == 1.0
    assert PROFILE.num_levels(2.0) == 4       # 1, 2, 4, 8 >= 7.0 > 4


def test_profile_file_from_the_profiler_gives_enough_levels() -> None:
    prof = Profile.load(ROOT / "config" / "profiles" / "opt-125m-cpu-tp1-pp1.json")
    n = prof.num_levels(2.0)
    assert prof.q1 * 2 ** (n - 1) >= prof.max_t_init > prof.q1 * 2 ** (n - 2)


def test_profile_rejects_bad_grids() -> None:
    with pytest.raises(ValueError, match="ascending"):
        Profile.from_dict({"t_init": {"prompt_lens": [16, 8], "seconds": [1.0, 2.0]},
                           "t_dec": {"batch_sizes": [1], "seconds": [1.0]}})


# ---- skip-join ----------------------------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "t_init", "level"), [
    (8, 0.5, 1),     # q1 = 1 >= 0.5
    (12, 1.0, 1),    # q1 = 1 >= 1.0 exactly
    (13, 1.125, 2),  # q1 < 1.125 <= q2 = 2
    (16, 1.5, 2),
    (32, 3.0, 3),    # q2 = 2 < 3 <= q3 = 4
    (40, 4.0, 3),    # exactly q3
    (41, 4.125, 4),
    (64, 7.0, 4),
    (200, 24.0, 4),  # beyond the last quantum: the lowest level
])
def test_skip_join_level(prompt_len: int, t_init: float, level: int) -> None:
    s = make()
    assert PROFILE.t_init(prompt_len) == t_init
    assert s.add(req("j", prompt_len), 0.0).level == level
    assert make("naive_mlfq").add(req("j", prompt_len), 0.0).level == 1


@pytest.mark.parametrize(("priority", "level"), [(0, 3), (-1, 2), (-5, 1), (1, 4), (9, 4)])
def test_priority_shifts_the_entry_level_within_the_levels(priority: int, level: int) -> None:
    request = JobRequest("j", tuple(range(3, 35)), greedy(4), priority=priority)  # t_init 3: level 3
    assert make().add(request, 0.0).level == level
    assert make("fcfs").add(request, 0.0).level == 1


def test_num_levels_override_extends_the_quanta() -> None:
    s = make(num_levels=6)
    assert s.policy.quanta() == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    assert s.add(req("j", 200), 0.0).level == 6   # t_init 24: q5 = 16 < 24 <= q6 = 32


# ---- demotion -----------------------------------------------------------------------------
def test_demotion_after_the_quantum_is_exceeded() -> None:
    s = make(batch=1)
    job = s.add(req("a", 8, max_tokens=20), 0.0)
    levels = []
    for k in range(10):
        step(s, 0.5 * k, 0.5)
        levels.append(job.level)
    # Charged its own work, whatever the step measured: prefill t_init(8) = 0.5, then q1 = 1 per
    # decode. Level 1: 0.5, 1.5 > q1 -> L2; level 2: 1, 2 (= q2, not exceeded), 3 -> L3;
    # level 3: 1 .. 4, 5 > q3 -> L4.
    assert levels == [1, 2, 2, 2, 3, 3, 3, 3, 3, 4]
    assert job.stats.demotions == 3


def test_demotion_by_eta_levels_stops_at_the_lowest() -> None:
    s = make(batch=1, demotion_eta=2)
    job = s.add(req("a", 8, max_tokens=20), 0.0)
    step(s, 0.0, 1.0)           # prefill: 0.5
    step(s, 1.0, 1.0)           # 1.5 > q1: down 2 levels
    assert job.level == 3
    for k in range(5):          # 5 decodes: 5 > q3 = 4, down 2 more, clamped to level 4
        step(s, 2.0 + k, 1.0)
    assert job.level == 4
    assert job.stats.demotions == 2


def test_each_entry_is_charged_its_own_work_not_the_step() -> None:
    """One long first iteration (t_init(32) = 3) batched with two decodes; the step measures 8 s.
    Each decode is charged one decode iteration (q1 = 1), the prefill t_init of its own 32
    tokens (3): nothing is split, nothing of another job's prefill is anyone else's."""
    s = make(batch=3, cache=False)
    a = s.add(req("a", 8, max_tokens=9), 0.0)
    b = s.add(req("b", 8, max_tokens=9), 0.0)
    step(s, 0.0, 1.0)                 # a and b prefill together: t_init(8) = 0.5 each
    assert (a.attained_s, b.attained_s, a.level, b.level) == (0.5, 0.5, 1, 1)
    long = s.add(req("long", 32, max_tokens=9), 1.0)      # t_init 3: joins level 3 (q3 = 4)
    plan, _ = step(s, 1.0, 8.0)
    assert ids(plan) == ["a", "b", "long"]
    assert [e.is_prefill for e in plan.entries] == [False, False, True]
    # a and b: 0.5 + 1 > q1 -> level 2 with a fresh quantum; long: 3 <= q3, stays.
    assert (a.level, b.level, a.attained_s, b.attained_s) == (2, 2, 0.0, 0.0)
    assert (long.level, long.attained_s, long.stats.demotions) == (3, 3.0, 0)
    assert a.stats.execution_s == 1.0 + 8.0                # latency: the whole steps it sat in


def test_a_job_gets_the_same_tokens_per_level_alone_or_in_a_full_batch() -> None:
    """The tokens a level gives do not depend on how full the batch is (t_dec here grows from 1
    s at batch 1 to 2 s at batch 16, and the steps are charged what the profile says)."""
    def tokens_per_level(batch: int) -> list[int]:
        s = make(batch=batch, num_levels=6)
        jobs = [s.add(req(f"j{i}", 8, max_tokens=40), 0.0) for i in range(batch)]
        per_level = [0] * 6
        now = 0.0
        while jobs[0].num_generated < 40:
            level = jobs[0].level
            plan, _ = step(s, now, PROFILE.t_dec(batch))
            assert len(plan.entries) == batch           # every job runs every step
            per_level[level - 1] += 1
            now += PROFILE.t_dec(batch)
        return per_level

    alone = tokens_per_level(1)
    assert alone == tokens_per_level(16)
    # level 1: the prefill (0.5) and one decode; then 2^(i-1) + 1 decodes until exceeded.
    assert alone == [2, 3, 5, 9, 17, 4]


def test_swap_time_and_step_time_are_no_ones_service() -> None:
    # Level 4 (t_init(41) = 4.125 <= q4 = 8, the lowest: no demotion to hide the charge). A decode
    # measured at 100 s, 90 of them waiting for swaps, is charged q1 = 1 all the same; the
    # wait is swap-blocked time in the job's latency breakdown.
    s = make(batch=1)
    a = s.add(req("a", 41, max_tokens=9), 0.0)
    step(s, 0.0, 0.5)
    plan = s.schedule(0.5)
    assert plan is not None
    s.update(plan, StepOutput(plan.step_id, {"a": TOKEN},
                              {"total": 100.0, "swap_wait": 90.0, "swap_tail": 9.0}), 100.5)
    assert a.level == 4 and a.attained_s == 4.125 + 1.0
    assert a.stats.swap_blocked_s == 90.0 and a.stats.execution_s == 0.5 + 10.0


def test_alpha_is_floored_at_k_decode_iterations_and_fixed_when_the_wait_begins() -> None:
    # α = 0.3 configured; the profile's decode at B = 1 takes 1 s, the measured steps 3 s (they
    # carry first iterations). With k = 10 a job is starving only after ten decode iterations of
    # the profile, 10 s, whatever the steps measure: α is in decode units.
    s = make(batch=1, alpha=0.3, starvation_min_iterations=10.0, step_time_ewma_weight=1.0,
             starvation_backlog_batches=0.0, num_levels=6)
    assert s.starvation_alpha() == 10.0
    s.add(req("a", 8, max_tokens=40), 0.0)
    b = s.add(req("b", 200, max_tokens=2), 0.0)          # level 6, waits behind a
    assert b.starve_due == 10.0
    now = 0.0
    for _ in range(4):                                   # steps at 0, 3, 6, 9
        plan, _ = step(s, now, 3.0)
        now += 3.0
        assert ids(plan) == ["a"] and b.stats.promotions == 0
    assert s.starvation_alpha() == 10.0 and b.level == 6
    plan, _ = step(s, 12.0, 3.0)                         # waited 12 > 10: promoted, runs
    assert ids(plan) == ["b"] and b.stats.promotions == 1


def test_alpha_never_falls_while_a_job_waits_and_rises_with_the_backlog() -> None:
    # B = 1, backlog floor 2 rounds of the step, no iteration floor, α = 2. b arrives in level
    # 6 with 2 jobs in its level and above (a and itself): α = max(2, 2 rounds × 2 × 1 s) = 4.
    # Eight level-1 jobs arrive before b is due; when it comes due (checked at 5 > 4), 9 jobs
    # are ahead of it: α = 2 × 9 × 1 s (the measured step) = 18, and its promotion moves to
    # 18 instead of happening. α never falls while it waits: jobs that finish meanwhile do not
    # bring it back, and b is promoted at the first decision past 18.
    s = make(batch=1, alpha=2.0, num_levels=6, starvation_min_iterations=0.0,
             starvation_backlog_batches=2.0, step_time_ewma_weight=1.0)
    s.add(req("a", 8, max_tokens=1), 0.0)
    b = s.add(req("b", 200, max_tokens=2), 0.0)
    assert b.starve_due == 4.0
    step(s, 0.0, 1.0)                                    # a's one token: a finishes
    for i in range(8):
        s.add(req(f"s{i}", 8, max_tokens=10), 1.0)
    for k in range(5):                                   # the level-1 jobs run, b waits
        step(s, 1.0 + k, 1.0)
    assert b.stats.promotions == 0 and b.starve_due == 18.0
    assert s.totals["promotions_postponed"] == 1
    now = 6.0
    while b.stats.promotions == 0:
        step(s, now, 1.0)
        now += 1.0
    assert now - 1.0 == 19.0 and b.generated     # promoted and run at the decision at 19


def test_a_burst_does_not_turn_into_a_promotion_storm() -> None:
    # 2,000 level-3 jobs (40-token prompts, t_init 4.0) arrive at t = 0, added one by one: the
    # first of them saw few jobs ahead (α = max(0.3, 10 × t_dec(16) = 20, 2 rounds of the
    # backlog then)) and come due after 20 s. At that time 2,000 jobs are ahead of each, so
    # α reads 2 × 125 rounds × 2 s = 500 s and no job is promoted in the first 50 steps (it
    # was: 338 of them, each job whose α had been fixed from the short backlog it saw).
    s = make(batch=16, alpha=0.3, device=400, cache=False)
    for i in range(2000):
        s.add(req(f"j{i}", 40, max_tokens=64), 0.0)
    assert {j.level for j in s.jobs().values()} == {3}
    for k in range(50):
        step(s, 2.0 * k, 2.0)
    assert s.totals["promotions"] == 0 and s.totals["promotions_postponed"] > 0


# ---- starvation ---------------------------------------------------------------------------
def test_promotion_to_level_one_after_alpha() -> None:
    s = make(batch=1, alpha=5.0, num_levels=6, starvation_min_iterations=0.0,
             starvation_backlog_batches=0.0)
    a = s.add(req("a", 8, max_tokens=40), 0.0)     # level 1
    b = s.add(req("b", 200, max_tokens=2), 0.0)    # level 6 (t_init 24), last served = arrival = 0
    for k in range(11):                            # a runs alone, 0.5 s per step
        plan, _ = step(s, 0.5 * k, 0.5)
        assert ids(plan) == ["a"]
    # At t = 5.0 b had waited exactly α: not yet "longer than α"; a (now level 4) ran.
    assert b.level == 6 and a.level == 4 and b.stats.promotions == 0
    promoted = s.schedule(5.5)                     # waited 5.5 > α: promoted, runs at once
    assert promoted is not None and ids(promoted) == ["b"]
    assert b.level == 1 and b.stats.promotions == 1
    assert b.attained_s == 0.0 and b.last_served == 5.5


# ---- ENST ---------------------------------------------------------------------------------
def test_enst_for_a_hand_built_queue_state() -> None:
    # Two jobs in level 1, one in level 2, none in 3, one in 4; B = 2; q = 1, 2, 4, 8.
    # wait(L2) = 2 jobs * q1 / 2 = 1
    # wait(L3) = (2 * (q1 + q2) + 1 * q2) / 2 = (6 + 2) / 2 = 4
    # wait(L4) = (2 * (q1+q2+q3) + 1 * (q2+q3)) / 2 = (14 + 6) / 2 = 10
    assert level_waits([2, 1, 0, 1], [1.0, 2.0, 4.0, 8.0], 2) == [0.0, 1.0, 4.0, 10.0]
    assert enst(4.0, 10.0) == 4.0                 # until promotion 4 < 10

    s = make(batch=2, alpha=5.0, starvation_min_iterations=0.0, starvation_backlog_batches=0.0)
    for name, prompt in (("l1a", 8), ("l1b", 8), ("l2", 16), ("l4", 64)):
        s.add(req(name, prompt), 0.0)
    assert s.queues.counts == [2, 1, 0, 1]
    assert s.enst("l4", 1.0) == 4.0               # min(5 − 1, 10)
    assert s.enst("l4", 0.0) == 5.0               # min(5 − 0, 10)
    assert s.enst("l2", 4.5) == 0.5               # min(5 − 4.5, 1)
    assert s.enst("l1a", 1.0) == 0.0              # nothing above level 1
    plan = s.schedule(0.0)                        # runs l1a and l1b: they stay counted
    assert plan is not None and ids(plan) == ["l1a", "l1b"]
    assert s.queues.counts == [2, 1, 0, 1] and s.enst("l4", 1.0) == 4.0


# ---- FCFS ---------------------------------------------------------------------------------
def test_fcfs_runs_to_completion_without_priority_preemption() -> None:
    order = {}
    policies: tuple[PolicyName, ...] = ("fcfs", "skip_join_mlfq")
    for policy in policies:
        s = make(policy, batch=1)
        s.add(req("long", 64, max_tokens=3), 0.0)
        runs = [ids(step(s, 0.0, 1.0)[0])[0]]
        s.add(req("short", 8, max_tokens=2), 1.0)     # arrives while long is mid-way
        now = 1.0
        while s.has_work():
            runs.append(ids(step(s, now, 1.0)[0])[0])
            now += 1.0
        order[policy] = runs
    assert order["fcfs"] == ["long", "long", "long", "short", "short"]
    assert order["skip_join_mlfq"] == ["long", "short", "short", "long", "long"]


def test_fcfs_defers_admission_in_arrival_order_when_memory_is_full() -> None:
    # 8 blocks of 4 tokens. j1 (24 tokens = 6 blocks, grows to 8) leaves 2 free: j2 (4 blocks)
    # must wait, and so must j3 (1 block) behind it — vLLM-style, nobody jumps the queue.
    s = make("fcfs", batch=4, device=8, host=8, cache=False)
    s.add(req("j1", 24, max_tokens=6), 0.0)
    s.add(req("j2", 16, max_tokens=2), 0.0)
    s.add(req("j3", 4, max_tokens=2), 0.0)
    plans = [step(s, float(k), 1.0)[0] for k in range(7)]
    assert [ids(p) for p in plans[:6]] == [["j1"]] * 6
    assert [len(e.block_table) for p in plans[:6] for e in p.entries] == [6, 7, 7, 7, 7, 8]
    assert ids(plans[6]) == ["j2", "j3"] and all(e.is_prefill for e in plans[6].entries)
    assert not any(p.swap_out or p.swap_in for p in plans)
    assert s.totals["recomputes"] == 0


@pytest.mark.parametrize("mode", ["recompute", "proactive"])
def test_fcfs_preempts_the_most_recently_admitted_job_when_growth_does_not_fit(
        mode: SwapMode) -> None:
    # Blocks of 2 tokens, 4 on the device. j1 and j2 (2-token prompts) both grow to 3 blocks at
    # their 3rd decode (context 5); only 2 more exist, so at step 3 j1 (first come) grows and
    # j2 (admitted last) is preempted.
    s = make("fcfs", batch=2, device=4, host=8, block=2, mode=mode)
    s.add(req("j1", 2, max_tokens=6), 0.0)
    s.add(req("j2", 2, max_tokens=6), 0.0)
    plans = [step(s, float(k), 1.0)[0] for k in range(3)]
    assert [ids(p) for p in plans] == [["j1", "j2"]] * 3
    plan3, _ = step(s, 3.0, 1.0)
    j2 = s.jobs()["j2"]
    if mode == "recompute":   # dropped: its blocks are free at once, j1 grows this very step
        assert ids(plan3) == ["j1"] and plan3.entries[0].block_table == (0, 2, 3)
        assert j2.stats.recomputes == 1 and j2.state is JobState.WAITING
    else:                     # swapped out: its blocks come back when this plan completes
        assert ids(plan3) == [] and [c.job_id for c in plan3.swap_out] == ["j2"]
        assert plan3.swap_out[0].src_blocks == (1, 3)
        plan4, _ = step(s, 4.0, 1.0)
        assert ids(plan4) == ["j1"] and plan4.entries[0].block_table == (0, 2, 3)
        assert j2.stats.swaps_out == 1
    result = drive(s, CostModelExecutor(PROFILE, constant_tokens(TOKEN)), [])
    assert result.reasons == {"j1": "length", "j2": "length"}
    if mode == "recompute":   # j2 recomputed prompt + its 3 tokens in one prefill
        assert j2.stats.num_generated == 6


# ---- batch formation ----------------------------------------------------------------------
def test_batch_goes_from_the_highest_level_down_fifo_within_a_level() -> None:
    s = make(batch=3)
    for name, prompt in (("a", 64), ("b", 8), ("c", 16), ("d", 8), ("e", 16)):
        s.add(req(name, prompt), 0.0)      # levels a:4 b:1 c:2 d:1 e:2
    plan = s.schedule(0.0)
    assert plan is not None and ids(plan) == ["b", "d", "c"]


def test_token_budget_limits_the_batch_but_a_long_prompt_can_run_alone() -> None:
    s = make(batch=16, max_num_batched_tokens=20)
    for name, prompt in (("a", 64), ("b", 8), ("c", 16), ("d", 8)):
        s.add(req(name, prompt), 0.0)
    plan = s.schedule(0.0)            # b + d = 16 tokens; c (16) and a (64) do not fit
    assert plan is not None and ids(plan) == ["b", "d"] and plan.num_tokens == 16
    alone = make(batch=16, max_num_batched_tokens=20)
    alone.add(req("a", 64), 0.0)
    plan = alone.schedule(0.0)
    assert plan is not None and ids(plan) == ["a"] and plan.num_tokens == 64


def test_a_demoted_job_goes_to_the_back_of_its_new_level() -> None:
    s = make(batch=1, cache=False)
    x = s.add(req("x", 16, max_tokens=12), 0.0)   # level 2 (t_init 1.5)
    step(s, 0.0, 1.0)
    step(s, 1.0, 1.0)                             # 1.5 + 1 > q2 -> level 3
    assert x.level == 3
    s.add(req("y", 32, max_tokens=9), 2.0)       # level 3, entered after x
    s.add(req("z", 32, max_tokens=9), 2.0)
    runs = [ids(step(s, 2.0 + k, 1.0)[0]) for k in range(7)]
    # x first (it entered level 3 first) until 5 > q3; then level 4, behind y and z.
    assert runs == [["x"]] * 5 + [["y"], ["y"]]
    assert x.level == 4


# ---- the paper's Figure 7 -----------------------------------------------------------------
def test_figure7_skip_join_beats_fcfs_and_naive_mlfq() -> None:
    """J1 long prompt (t_init 6), J2 short (1), J3 medium (3); 2 iterations each, decode 1;
    one job per batch; all arrive at t = 0 in the order J1, J2, J3. Quanta 1, 2, 4, 8.

    FCFS:        J1 0-6-7, J2 7-8-9, J3 9-12-13                  -> (7+9+13)/3 = 29/3
    naive MLFQ (the paper's, Figure 7(b)): all in Q1; a first iteration longer than the quantum
                 is cut at it (the prompt prefix that costs q runs, its work is lost) and demoted.
                 J1 cut 0-1 (Q2); J2 1-2 (1 = q1: stays), 2-3 done; J3 cut 3-4 (Q2);
                 J1 cut 4-6 (Q3); J3 cut 6-8 (Q3); J1 cut 8-12 (Q4); J3 12-15-16 done (3 <= q3);
                 J1 16-22-23 done                                 -> (23+3+16)/3 = 14
    naive MLFQ, first iterations run whole (our earlier variant): J1 prefill 0-6 (6 > q1: Q2);
                 J2 6-7 (1 = q1: stays), 7-8 done; J3 8-11 (3 > q1: Q2, behind J1); J1 11-12
                 done; J3 12-13 done                              -> (8+12+13)/3 = 11
    skip-join:   J2 joins Q1, J3 Q3, J1 Q4. J2 0-1-2, J3 2-5-6, J1 6-12-13
                                                                  -> (2+6+13)/3 = 7
    SRPT (knows 2, 4, 7 of work) and fixed priority (by input length) pick the same order: 7.
    """
    prof = Profile.from_dict({
        "t_init": {"prompt_lens": [8, 24, 48], "seconds": [1.0, 3.0, 6.0]},
        "t_dec": {"batch_sizes": [1], "seconds": [1.0]},
    })
    arrivals = [(0.0, req("J1", 48, 2)), (0.0, req("J2", 8, 2)), (0.0, req("J3", 24, 2))]
    expected: dict[str, dict[str, float]] = {
        "fcfs": {"J1": 7.0, "J2": 9.0, "J3": 13.0},
        "naive_mlfq": {"J1": 23.0, "J2": 3.0, "J3": 16.0},
        "naive_mlfq_whole": {"J1": 12.0, "J2": 8.0, "J3": 13.0},
        "skip_join_mlfq": {"J1": 13.0, "J2": 2.0, "J3": 6.0},
        "srpt_oracle": {"J1": 13.0, "J2": 2.0, "J3": 6.0},
        "fixed_priority": {"J1": 13.0, "J2": 2.0, "J3": 6.0},
    }
    average = {}
    for name, finish in expected.items():
        whole = name == "naive_mlfq_whole"
        policy: PolicyName = "naive_mlfq" if whole else name  # type: ignore[assignment]
        s = make(policy, batch=1, profile=prof, naive_preempts_first_iteration=not whole,
                 cache=False)
        result = drive(s, CostModelExecutor(prof, constant_tokens(TOKEN)), arrivals,
                       observe=lambda sc, plan, now: sc.check_invariants())
        assert result.finish_times == finish, name
        average[name] = sum(result.finish_times.values()) / 3
    assert average["skip_join_mlfq"] == 7.0
    assert average["fcfs"] == pytest.approx(29 / 3)
    assert average["naive_mlfq"] == 14.0 and average["naive_mlfq_whole"] == 11.0
    assert average["skip_join_mlfq"] < average["fcfs"] < average["naive_mlfq"]


# ---- pipeline semantics, abort, admission -------------------------------------------------
def test_two_plans_in_flight_keep_running_jobs_queued_and_apart() -> None:
    s = make(batch=1)
    s.add(req("x", 8), 0.0)
    s.add(req("y", 8), 0.0)
    p0 = s.schedule(0.0)
    p1 = s.schedule(0.0)                          # before p0's update (pipeline, paper §4.3)
    assert p0 is not None and p1 is not None and ids(p0) == ["x"] and ids(p1) == ["y"]
    assert s.schedule(0.0) is None                # both jobs are in flight
    assert s.jobs()["x"].state is JobState.RUNNING and s.queues.counts[0] == 2
    s.check_invariants()
    s.update(p1, StepOutput(p1.step_id, {"y": TOKEN}, {"total": 1.0}), 1.0)   # out of order
    s.check_invariants()
    p2 = s.schedule(1.0)
    assert p2 is not None and ids(p2) == ["y"]
    s.update(p0, StepOutput(p0.step_id, {"x": TOKEN}, {"total": 1.0}), 1.0)
    s.check_invariants()
    assert s.jobs()["x"].state is JobState.RUNNABLE and s.jobs()["x"].generated == [TOKEN]


def test_abort_of_a_running_job_frees_its_blocks_when_its_plan_completes() -> None:
    s = make(device=8, block=4)
    s.add(req("a", 8), 0.0)
    plan = s.schedule(0.0)
    assert plan is not None and s.kv.num_free_device == 6
    s.abort("a", 0.5)
    s.check_invariants()
    assert s.kv.num_free_device == 6              # still used by the in-flight step
    assert s.update(plan, StepOutput(plan.step_id, {"a": TOKEN}, {"total": 1.0}), 1.0) == []
    assert s.kv.num_free_device == 8 and not s.has_work()
    s.add(req("b", 8), 1.0)
    nxt = s.schedule(1.0)
    assert nxt is not None


def test_admission_queue_limit_raises_and_frees_up_on_admission() -> None:
    s = make(admission_queue_limit=2)
    s.add(req("a", 8), 0.0)
    s.add(req("b", 8), 0.0)
    with pytest.raises(AdmissionQueueFull, match="admission_queue_limit=2"):
        s.add(req("c", 8), 0.0)
    step(s, 0.0, 1.0)                             # a and b admitted
    assert s.num_waiting() == 0
    s.add(req("c", 8), 1.0)


def test_add_rejects_jobs_that_can_never_run() -> None:
    s = make(device=4, block=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.add(req("big", 16, max_tokens=5), 0.0)  # 16 + 4 positions = 5 blocks > 4
    s.add(req("ok", 8), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        s.add(req("ok", 8), 0.0)


# ---- config -------------------------------------------------------------------------------
def test_config_defaults_are_the_papers_and_validation_names_the_value() -> None:
    c = SchedulerConfig()
    assert (c.policy, c.max_batch_size, c.starvation_alpha_s, c.demotion_eta,
            c.quantum_growth) == ("skip_join_mlfq", 16, 0.3, 1, 2.0)
    k = KVCacheConfig(num_device_blocks=10, num_host_blocks=10)
    assert (k.block_size, k.swap_mode) == (16, "proactive")
    with pytest.raises(ValidationError, match="max_batch_size"):
        SchedulerConfig(max_batch_size=0)
    with pytest.raises(ValidationError, match="extra"):
        SchedulerConfig(max_batch=4)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="reserved_blocks=8"):
        KVCacheConfig(num_device_blocks=8, num_host_blocks=8, reserved_blocks=8)
    with pytest.raises(ValidationError, match="num_host_blocks=0"):
        KVCacheConfig(num_device_blocks=8, swap_mode="reactive")
    KVCacheConfig(num_device_blocks=8, swap_mode="recompute")


def test_alpha_from_slo() -> None:
    assert alpha_from_slo(0.35, 0.05) == pytest.approx(0.3)
    assert SchedulerConfig(starvation_alpha_s=alpha_from_slo(0.5)).starvation_alpha_s == 0.5
    with pytest.raises(ValueError, match="no waiting time"):
        alpha_from_slo(0.05, 0.05)


# ---- engine loop (fake data plane; the real one is in tests/integration) ------------------
class FlakyExecutor(CostModelExecutor):
    """Raises on chosen plans, otherwise answers like the cost model."""

    def __init__(self, fail_steps: set[int]) -> None:
        super().__init__(PROFILE, constant_tokens(TOKEN))
        self.fail_steps = fail_steps

    def execute(self, plan: BatchPlan) -> StepOutput:
        if plan.step_id in self.fail_steps:
            raise RuntimeError(f"injected failure in step {plan.step_id}")
        return super().execute(plan)


async def _collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


def test_engine_streams_tokens_and_abort_frees_blocks() -> None:
    async def run() -> None:
        s = make(device=256, block=4)
        engine = AsyncEngine(s, ThreadedExecutor(CostModelExecutor(PROFILE, constant_tokens(TOKEN))))
        assert engine.eos_token_ids == frozenset({EOS})
        await engine.start()
        done = engine.add_request(range(3, 11), greedy(5), job_id="done")
        gone = engine.add_request(range(3, 11), greedy(900), job_id="gone")
        first = await gone.__anext__()
        engine.abort("gone")
        deltas = await _collect(done)
        rest = await _collect(gone)
        await engine.stop()
        assert [d.token_id for d in deltas] == [TOKEN] * 5
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert first.token_id == TOKEN and rest[-1].finish_reason == "abort"
        assert s.kv.num_free_device == 256 and not s.has_work()

    asyncio.run(run())


def test_engine_fails_only_the_jobs_of_a_failing_plan_and_keeps_serving() -> None:
    async def run() -> None:
        s = make(batch=1)
        engine = AsyncEngine(s, ThreadedExecutor(FlakyExecutor({0})))
        await engine.start()
        first = engine.add_request(range(3, 11), greedy(3), job_id="first")
        unlucky = await _collect(first)
        later = await _collect(engine.add_request(range(3, 11), greedy(3), job_id="later"))
        await engine.stop()
        assert [(d.token_id, d.finish_reason) for d in unlucky] == [(None, "error")]
        assert [d.token_id for d in later] == [TOKEN] * 3
        assert engine.plans_failed == 1 and s.totals["errors"] == 1

    asyncio.run(run())


# ---- entry levels on the paper's profiles (quanta as the paper means them) -----------------
@pytest.mark.parametrize(("prompt_len", "level"), [
    (1, 1), (8, 1), (16, 1),      # t_init(16) = t_dec(1) = q1: a short prompt's first iteration
    (17, 2), (64, 2), (128, 3), (256, 4),
    (512, 5),                     # t_init 0.223 s ÷ q1 0.0255 s = 8.7 <= 2^4: level 5
    (1024, 6), (2048, 7),
])
def test_entry_levels_on_the_opt13b_paper_profile(prompt_len: int, level: int) -> None:
    prof = Profile.load(ROOT / "config" / "profiles" / "opt-13b-a100-tp1-pp1.json")
    s = make(profile=prof, device=1024)
    assert s.policy.quanta()[0] == prof.t_dec(1)
    assert s.add(req("j", prompt_len), 0.0).level == level


def test_the_papers_section_4_1_example() -> None:
    # OPT-2.7B: t_init(512) ≈ 0.05 s, q1 = 0.002 s (a decode iteration): 0.032 < 0.05 <= 0.064,
    # so the job skips queues 1–5 and joins Q6.
    prof = Profile.from_dict({
        "t_init": {"prompt_lens": [1, 512], "seconds": [0.002, 0.05]},
        "t_dec": {"batch_sizes": [1, 16], "seconds": [0.002, 0.004]},
    })
    s = make(profile=prof)
    assert s.policy.quanta()[:6] == pytest.approx([0.002, 0.004, 0.008, 0.016, 0.032, 0.064])
    assert s.add(req("j", 512), 0.0).level == 6
