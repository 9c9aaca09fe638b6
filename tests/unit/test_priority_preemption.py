"""Memory preemption by priority (issue: the paper's Strawman 1, "priority inversion for memory").

Two long jobs of a low level hold every device block of a tiny real model's KV pool; a short
job arrives. It must take KV from them — swapped out one plan ahead (proactive), swapped out in
its own plan with the forward stalled for the copy (reactive), or dropped (recompute) — and not
wait for them to finish. The long jobs then finish with exactly the tokens they produce alone.

Hand-computed set-up (block size 4, profile below: q1 = 0.01 s, q2..q5 = 0.02 .. 0.16 s):
* the long jobs' 16-token prompts cost t_init(16) = 0.01 + 0.09·15/63 ≈ 0.0314 s: level 3;
  the prefill and one decode (0.0414 > q3) put them in level 4 after step 1;
* step j ≥ 1 is a decode with j tokens generated, taking blocks_for(16 + j): 6 blocks each from
  step 7 on, so 12 device blocks are all taken; step 8 needs no growth (24 positions), step 9
  would need a 7th block each;
* the short job (a 1-token prompt, t_init 0.01 = q1) arrives before decision 8 in level 1.
"""

from __future__ import annotations

import pytest

from fastserve.scheduler.apply import Applied
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig, SwapMode
from fastserve.scheduler.decision import Decision, Evict
from fastserve.scheduler.job import JobRequest
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import CoreDriver
from tests.harness.fields import PROFILE, TINY
from tests.harness.scheduling import make, req, step

BLOCK = 4
LONG_PROMPTS = {"longA": tuple(range(5, 21)), "longB": tuple(range(30, 46))}
SHORT_PROMPT = (7,)
LONG_TOKENS = 20
ARRIVES_AT_STEP = 8


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(mode: SwapMode, device_blocks: int, with_short: bool) -> tuple[
        dict[str, list[int]], dict[str, int], list[BatchPlan], Scheduler]:
    """Every job to its end; returns tokens, the step of each job's first token, the plans."""
    ex = InProcessExecutor(ModelSpec(TINY, num_device_blocks=device_blocks, num_host_blocks=16,
                                     block_size=BLOCK, seed=3))
    s = Scheduler(SchedulerConfig(starvation_alpha_s=1000.0),
                  KVCacheConfig(block_size=BLOCK, num_device_blocks=device_blocks,
                                num_host_blocks=16, swap_mode=mode),
                  PROFILE, frozenset({TINY.eos_token_id}))
    driver = CoreDriver(s, ex)
    for job_id, prompt in LONG_PROMPTS.items():
        driver.add(JobRequest(job_id, prompt, greedy(LONG_TOKENS)))
    first: dict[str, int] = {}
    for k in range(200):
        if with_short and k == ARRIVES_AT_STEP:
            driver.add(JobRequest("short", SHORT_PROMPT, greedy(2)))
        if not s.has_work():
            break
        assert driver.step() is not None, f"nothing to run at step {k}"
        for job_id in driver.deltas:
            first.setdefault(job_id, k)
    assert not s.has_work()
    ex.close()
    return driver.tokens(), first, driver.plans, s


@pytest.mark.parametrize("mode", ["proactive", "reactive", "recompute"])
def test_a_short_job_takes_kv_from_lower_priority_jobs_that_hold_every_block(
        mode: SwapMode) -> None:
    alone, _, _, _ = run(mode, device_blocks=64, with_short=False)
    tokens, first, plans, s = run(mode, device_blocks=12, with_short=True)
    # Before the short job came, both long jobs ran every step and filled the pool.
    assert all(sorted(e.job_id for e in p.entries) == ["longA", "longB"] for p in plans[:8])
    at = plans[ARRIVES_AT_STEP]
    victim = "longA"      # level 4 both, served together: the first in the swap-out order
    if mode == "proactive":
        # Plan 8 swaps longA out (its blocks are free when the plan completes) and runs longB,
        # which needs no growth; the short job runs at plan 9: its first token in 2 iterations.
        assert [c.job_id for c in at.swap_out] == [victim]
        assert [e.job_id for e in at.entries] == ["longB"]
        assert first["short"] == ARRIVES_AT_STEP + 1
        assert s.totals["swaps_out"] >= 1 and s.totals["recomputes"] == 0
    elif mode == "reactive":
        # Plan 8 swaps longA out and reuses its blocks at once: the forward waits for the copy.
        assert [c.job_id for c in at.swap_out] == [victim]
        assert [e.job_id for e in at.entries] == ["short", "longB"]
        assert set(at.entries[0].block_table) <= set(at.swap_out[0].src_blocks)
        assert first["short"] == ARRIVES_AT_STEP
    else:
        # Plan 8 drops longA (free at once) and runs the short job in its blocks.
        assert not at.swap_out and [e.job_id for e in at.entries] == ["short", "longB"]
        assert first["short"] == ARRIVES_AT_STEP
        assert s.totals["recomputes"] >= 1
    # The long jobs finish later, with exactly the tokens they produce alone.
    assert tokens["longA"] == alone["longA"] and tokens["longB"] == alone["longB"]
    assert len(tokens["short"]) == 2


@pytest.mark.parametrize(("prompt_len", "evicts"), [(15, False), (14, True)])
def test_only_a_strictly_higher_rank_takes_kv(prompt_len: int, evicts: bool) -> None:
    """Fixed priority (one level, shorter prompt first, then arrival): two 15-token jobs hold
    all 8 device blocks (4 each; their first decode stays within them). A newcomer of the same length ranks
    below them (it came later) and waits with nothing evicted; one token shorter, it ranks
    above them and takes the blocks of the later of the two (lowest rank first)."""
    s = Scheduler(SchedulerConfig(policy="fixed_priority"),
                  KVCacheConfig(block_size=BLOCK, num_device_blocks=8, num_host_blocks=16),
                  PROFILE, frozenset({TINY.eos_token_id}))
    for job_id, prompt in LONG_PROMPTS.items():
        s.add(JobRequest(job_id, prompt[:15], greedy(4)), 0.0)
    plan = s.schedule(0.0)
    assert plan is not None and s.kv.num_free_device == 0
    s.update(plan, StepOutput(plan.step_id, {"longA": 9, "longB": 9}, {"total": 0.01}), 0.01)
    s.add(JobRequest("new", tuple(range(60, 60 + prompt_len)), greedy(2)), 0.01)
    plan = s.schedule(0.01)
    assert plan is not None
    s.check_invariants()
    assert [e.job_id for e in plan.entries] == (["longA"] if evicts else ["longA", "longB"])
    assert [c.job_id for c in plan.swap_out] == (["longB"] if evicts else [])


@pytest.mark.parametrize(("gap", "evicts"), [(1, True), (2, False)])
def test_preemption_level_gap(gap: int, evicts: bool) -> None:
    """Two level-4 jobs (63-token prompts, t_init 6.875; their first decode stays in 16 blocks)
    hold all 32 device blocks; a 32-token job (t_init 3, level 3) arrives. With the default gap
    of 1 it takes the blocks of the first of them in the swap-out order (served as recently as
    the other, added first), swapped out one plan ahead; with a gap of 2 a job one level below
    is no victim, and both keep decoding."""
    # (``req`` prompts share their first tokens: without cache=False "new" finds 28 of its 32
    # tokens cached and joins level 1.)
    s = make(device=32, host=64, preemption_level_gap=gap, cache=False)
    s.add(req("a", 63, max_tokens=8), 0.0)
    s.add(req("b", 63, max_tokens=8), 0.0)
    step(s, 0.0, 1.0)
    assert s.kv.num_free_device == 0 and {j.level for j in s.jobs().values()} == {4}
    s.add(req("new", 32, max_tokens=2), 1.0)
    plan = s.schedule(1.0)
    assert plan is not None
    s.check_invariants()
    assert [c.job_id for c in plan.swap_out] == (["a"] if evicts else [])
    assert [e.job_id for e in plan.entries] == (["b"] if evicts else ["a", "b"])


def record_evictions(s: Scheduler) -> list[tuple[int, str, str | None]]:
    """Every eviction the scheduler's applier carries out, as (decision step, victim, the job it was for)."""
    evicted: list[tuple[int, str, str | None]] = []
    apply = s.applier.apply

    def record(decision: Decision, now: float, out: Applied) -> None:
        evicted.extend((decision.step, a.job_id, a.for_job)
                       for a in decision.batch.actions if isinstance(a, Evict))
        apply(decision, now, out)

    s.applier.apply = record  # type: ignore[method-assign]
    return evicted


def test_a_claim_is_held_while_its_swap_out_is_in_flight() -> None:
    """Two plans in flight (a pipeline of two stages), batch 2: four jobs of 20 tokens (level 2,
    t_init 1.875; level 3 once their first iteration exceeded q2) hold the whole 8-block pool
    (2 blocks of 16 each, no growth for 12 more tokens); a 3-token job (level 1) arrives
    needing 1 block. Decision 4 swaps out the lowest job (L2) for it and
    the short job claims the 2 blocks that plan releases; decision 5 comes before plan 4 returns
    and must not evict again for the same job (it did: L3, a second victim for a 1-block need).
    The short job runs at decision 6, once plan 4 returned."""
    s = make(batch=2, device=8, host=64, block=16, cache=False)
    evicted = record_evictions(s)
    for i in range(4):
        s.add(req(f"L{i}", 20, 10), 0.0)
    now = 0.0
    inflight: list[BatchPlan] = []

    def complete(plan: BatchPlan) -> None:
        nonlocal now
        now += 1.0
        s.update(plan, StepOutput(plan.step_id, {e.job_id: 9 for e in plan.entries if e.samples},
                                  {"total": 1.0}), now)
        s.check_invariants()

    for _ in range(4):      # admit and run each long job once, one plan at a time
        plan = s.schedule(now)
        assert plan is not None
        complete(plan)
    assert s.kv.num_free_device == 0 and {s.jobs()[f"L{i}"].level for i in range(4)} == {3}
    s.add(req("short", 3, 2), now)
    ran: dict[int, list[str]] = {}
    for _ in range(4):
        plan = s.schedule(now)
        assert plan is not None
        s.check_invariants()
        ran[plan.step_id] = [e.job_id for e in plan.entries]
        inflight.append(plan)
        if len(inflight) == 2:
            complete(inflight.pop(0))
    while inflight:
        complete(inflight.pop(0))
    assert evicted == [(4, "L2", "short")]
    assert "short" not in ran[4] + ran[5] and "short" in ran[6]
    assert s.kv.swapped_out_blocks == 2


def test_a_victim_the_later_ones_cover_stays_resident() -> None:
    """Batch 1, a 4-block pool of 16-token blocks: A (3-token prompt, 1 block) decodes alone
    until level 4; B (40 tokens, 3 blocks, level 3) runs once and the pool is full; S (20
    tokens, level 2) arrives needing 2 blocks. The scan takes A (lowest) then B, 4 blocks for a
    2-block need; B alone covers it, so A stays (before: both went out and A came back a plan
    later) and, resident, runs in the very plan that swaps B out. S runs once that plan returned."""
    s = make(batch=1, device=4, host=64, block=16, cache=False)
    evicted = record_evictions(s)
    now = 0.0
    s.add(req("A", 3, 13), now)
    while s.jobs()["A"].level < 4:
        step(s, now, 1.0)
        now += 1.0
    assert (now, s.kv.num_blocks("A")) == (10.0, 1)
    s.add(req("B", 40, 8), now)
    plan, _ = step(s, now, 1.0)
    now += 1.0
    assert [e.job_id for e in plan.entries] == ["B"] and s.jobs()["B"].level == 3
    assert s.kv.num_blocks("B") == 3 and s.kv.num_free_device == 0
    s.add(req("S", 20, 4), now)
    ran = []
    for _ in range(2):
        plan, _ = step(s, now, 1.0)
        now += 1.0
        ran.append(([e.job_id for e in plan.entries], [c.job_id for c in plan.swap_out],
                     [c.job_id for c in plan.swap_in]))
    assert ran == [(["A"], ["B"], []), (["S"], [], [])]
    assert evicted == [(11, "B", "S")]
