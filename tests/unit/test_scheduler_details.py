"""The smaller rules of the scheduler's round 3 (issue: "Skip-join MLFQ as the paper means it",
item 6), each with hand-computed expectations: swap-blocked time ends when the swap lands or
no batch wants the job any more, a
swap-in's pin counts from when it lands, a chunked first iteration is not demoted before its
first token, the batch walk leaves the queues whole when it raises, and the adaptive reserve
never takes the whole pool.
"""

from __future__ import annotations

import pytest

from fastserve.kv.manager import Residency
from fastserve.kv.swap_planner import SwapDecision
from fastserve.scheduler.apply import Applied
from fastserve.scheduler.config import ChunkedPrefillConfig, KVCacheConfig
from fastserve.scheduler.decision import BatchDecision, Decision
from fastserve.scheduler.reserve import ArrivalReserve
from fastserve.worker.messages import StepOutput
from tests.harness.scheduling import ids, make, req, step


def test_swap_blocked_time_ends_when_the_swap_in_lands() -> None:
    # Batch 1. a (level 1) and b (level 3) both ran their first iteration; b was swapped out.
    # From t = 10 the batch wants b (a is gone) but b's KV is on the host: wanted at decision 10,
    # swapped in by that plan (it lands at 11), then a newcomer c (level 1) runs first at 11
    # and 12. b waited for the swap 10 → 11 only; 11 → 13 is queueing.
    s = make(batch=1)
    b = s.add(req("b", 32, max_tokens=8), 0.0)
    step(s, 0.0, 1.0)                                    # b's first iteration
    s.applier.apply(Decision(1, BatchDecision(), SwapDecision(swap_out=["b"])), 1.0, Applied())
    s.state.next_step = 2
    s.applier.settle(s.kv.complete(1), 1.0)
    assert s.kv.residency("b") is Residency.HOST
    plan = s.schedule(10.0)                              # swap-in only: b is wanted
    assert plan is not None and not plan.entries and [c.job_id for c in plan.swap_in] == ["b"]
    s.update(plan, StepOutput(plan.step_id, {}, {"total": 1.0}), 11.0)
    s.add(req("c", 8, max_tokens=2), 11.0)
    assert [ids(step(s, 11.0 + k, 1.0)[0]) for k in range(3)] == [["c"], ["c"], ["b"]]
    assert b.stats.swap_blocked_s == b.stats.longest_swap_blocked_s == 1.0
    assert b.stats.queueing_s == (10.0 - 1.0) + (13.0 - 11.0)


def test_swap_blocked_time_ends_when_no_batch_wants_the_job_any_more() -> None:
    # b's KV is on the host. Decision 2 (t = 5) wants b but brings it in with no swap (no room
    # kept for it); decision 3 (t = 7) no longer wants it (outranked). b waited for device space
    # 5 → 7 only: what follows until it is wanted again is queueing. Wanted again at t = 20, it
    # is swapped in by that plan (landing at 21): a second wait of 1 s.
    s = make(batch=1)
    b = s.add(req("b", 32, max_tokens=8), 0.0)
    step(s, 0.0, 1.0)
    s.applier.apply(Decision(1, BatchDecision(), SwapDecision(swap_out=["b"])), 1.0, Applied())
    s.state.next_step = 2
    s.applier.settle(s.kv.complete(1), 1.0)
    wanted = BatchDecision(wanted_host={"b": 3})
    s.applier.apply(Decision(2, wanted, SwapDecision()), 5.0, Applied())
    assert b.blocked_since == 5.0
    s.applier.apply(Decision(3, BatchDecision(), SwapDecision()), 7.0, Applied())
    assert b.blocked_since is None and b.stats.longest_swap_blocked_s == 2.0
    s.applier.apply(Decision(4, BatchDecision(wanted_host={"b": 3}), SwapDecision(swap_in=["b"])), 20.0,
                    Applied())
    s.applier.apply(Decision(5, BatchDecision(), SwapDecision()), 20.5, Applied())
    assert b.blocked_since == 20.0                       # its copy is under way: still waiting
    s.state.next_step = 6
    s.applier.settle(s.kv.complete(4), 21.0)
    s.check_invariants()
    assert b.blocked_since is None and b.blocked_s == 2.0 + 1.0
    assert b.stats.longest_swap_blocked_s == 2.0


def test_a_swap_in_pin_counts_from_when_it_lands() -> None:
    # With 3 plans in flight the swap-in of step 2 lands after steps 3 and 4 were planned: the
    # pin protects decisions 5 and 6 (the next swap_pin_plans = 2 decisions), not 3 and 4 when
    # the job was in transit anyway.
    s = make(device=16, host=16)
    s.add(req("a", 8), 0.0)
    step(s, 0.0, 0.5)
    a = s.jobs()["a"]
    s.applier.apply(Decision(1, BatchDecision(), SwapDecision(swap_out=["a"])), 0.5, Applied())
    s.applier.settle(s.kv.complete(1), 0.5)
    s.applier.apply(Decision(2, BatchDecision(), SwapDecision(swap_in=["a"])), 0.5, Applied())
    s.state.next_step = 5                                # plans 3 and 4 went out meanwhile
    s.applier.settle(s.kv.complete(2), 0.6)
    s.check_invariants()
    assert [s.view.pinned("a", k) for k in (5, 6, 7)] == [True, True, False]
    assert a.pinned_until == 6


def test_a_chunked_first_iteration_is_not_demoted_before_its_first_token() -> None:
    # A 40-token prompt (t_init 4.0 = q3: level 3 of 4) in chunks of 4 tokens, each charged
    # t_init(4) = 0.5 (the profile's floor): after the 9th chunk its service (4.5) exceeds q3,
    # but only the 10th, which samples its first token, may demote it — and does (5.0 > 4).
    s = make(batch=1, max_num_batched_tokens=4,
             chunked_prefill=ChunkedPrefillConfig(enabled=True, chunk_tokens=4))
    job = s.add(req("long", 40, max_tokens=4), 0.0)
    assert job.level == 3
    levels = []
    for k in range(10):
        plan, _ = step(s, float(k), 1.0)
        assert plan.entries[0].is_prefill and len(plan.entries[0].token_ids) == 4
        levels.append(job.level)
    assert levels == [3] * 9 + [4]
    assert job.num_generated == 1 and job.stats.demotions == 1


def test_the_batch_walk_leaves_the_queues_whole_when_it_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = make(batch=4)
    for name, prompt in (("a", 8), ("b", 16), ("c", 32)):
        s.add(req(name, prompt), 0.0)
    sizes = [len(lv.pending) for lv in s.queues.levels]

    def broken(num_tokens: int) -> int:
        raise RuntimeError("planner bug")

    monkeypatch.setattr(s.kv, "blocks_for", broken)
    with pytest.raises(RuntimeError, match="planner bug"):
        s.batcher.plan(0)
    assert [len(lv.pending) for lv in s.queues.levels] == sizes == [1, 1, 1, 0]


def test_the_adaptive_reserve_never_takes_the_whole_pool() -> None:
    cfg = KVCacheConfig(num_device_blocks=8, num_host_blocks=8, reserved_blocks=7,
                        adaptive_reserve=True, adaptive_max_fraction=1.0)
    reserve = ArrivalReserve(cfg)
    reserve.note_arrival(0.0, 100)
    assert reserve.blocks(0.5) == 7          # 7 + min(100, 8) capped at the pool less one
