"""Prefix caching under random load (hypothesis): arrivals that share prefixes (a few prefixes,
random suffixes), aborts at random moments (queued, running, in transit), swaps, drops and
spills, every policy and swap mode, one or two plans in flight:

* ``check_invariants`` after every event: every block free, cached and evictable, or referenced
  by exactly the tables and in-flight steps that hold it;
* no block an in-flight plan reads or writes (its entries' tables, its copies' both sides) is
  free or evictable before that plan returned;
* when everything finished or was aborted, no reference is left (no leak) and every job that
  was not aborted has all its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastserve.scheduler.config import PolicyName, SwapMode
from fastserve.scheduler.job import JobRequest
from fastserve.worker.messages import BatchPlan, SamplingParams
from tests.harness.engine_driver import CoreDriver, TimedScript
from tests.harness.scheduling import RANDOM_LOAD_PROFILE, every_policy_and_mode, make

PREFIXES = ((5,) * 8, tuple(range(10, 18)), (5, 5, 5, 5, 6, 6, 6, 6))


@dataclass(frozen=True)
class Arrival:
    job_id: str
    prefix: int          # which of PREFIXES
    prefix_len: int
    suffix: tuple[int, ...]
    max_tokens: int
    at_event: int        # arrives before this event
    abort_at: int | None  # aborted before this event (None: runs to the end)


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, int], list[Arrival]]:
    block = draw(st.sampled_from([1, 2, 4]))
    device = draw(st.integers(4, 14))
    setup = {"block": block, "device": device, "host": draw(st.integers(1, 12)),
             "batch": draw(st.integers(1, 4)), "depth": draw(st.sampled_from([1, 2])),
             "chunk": draw(st.sampled_from([0, 2, 4]))}
    arrivals = []
    for i in range(draw(st.integers(1, 10))):
        prefix_len = draw(st.integers(0, 8))
        suffix = tuple(draw(st.lists(st.integers(20, 40), min_size=1, max_size=4)))
        prompt = prefix_len + len(suffix)
        most = device * block - prompt + 1
        if most < 1:
            continue
        at = draw(st.integers(0, 30))
        abort = draw(st.one_of(st.none(), st.integers(at, at + 20)))
        arrivals.append(Arrival(f"j{i}", draw(st.integers(0, len(PREFIXES) - 1)), prefix_len,
                                suffix, draw(st.integers(1, min(6, most))), at, abort))
    return setup, arrivals


def script(job_id: str, index: int) -> int:
    return 50 + (sum(map(ord, job_id)) * 31 + index * 7) % 40


def touched(plan: BatchPlan, mode: SwapMode) -> tuple[set[int], set[int]]:
    """Device and host blocks a plan reads or writes and must hold until it returns. (Under
    ``reactive`` a job preempted by priority is swapped out with its device blocks reusable
    by the very plan that copies them: the data plane orders the copy first.)"""
    device = {b for e in plan.entries for b in e.block_table}
    host: set[int] = set()
    for c in plan.swap_out:
        if mode != "reactive":
            device.update(c.src_blocks)
        host.update(c.dst_blocks)
    for c in plan.swap_in:
        host.update(c.src_blocks)
        device.update(c.dst_blocks)
    return device, host


#: Found by this test (naive MLFQ, proactive): a decision evicted cached device block 1 for a
#: job's new block and spilled its old content to the host; the job was aborted while that copy
#: was in flight, and the block went free under the copy. The spill now holds what it reads.
SPILLED_BLOCK_OWNER_ABORTED = (
    {"block": 1, "device": 12, "host": 2, "batch": 2, "depth": 1, "chunk": 4},
    [Arrival("j0", 1, 2, (20,), 2, 21, None), Arrival("j1", 0, 0, (20,), 1, 0, None),
     Arrival("j2", 0, 0, (20,), 1, 0, None), Arrival("j3", 0, 6, (20, 20, 20), 1, 0, None),
     Arrival("j4", 0, 0, (20,), 5, 0, None), Arrival("j5", 0, 0, (20,), 1, 0, None),
     Arrival("j6", 1, 5, (20, 20, 20, 20), 2, 11, 25)])


@every_policy_and_mode
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
@example(case=SPILLED_BLOCK_OWNER_ABORTED)
def test_shared_prefixes_aborts_and_swaps_keep_every_invariant(
        policy: PolicyName, mode: SwapMode, case: tuple[dict[str, int], list[Arrival]]) -> None:
    setup, arrivals = case
    s = make(policy, batch=setup["batch"], alpha=0.05, device=setup["device"], host=setup["host"],
             block=setup["block"], mode=mode, profile=RANDOM_LOAD_PROFILE,
             chunk_tokens=setup["chunk"] or None, max_num_batched_tokens=16)
    driver = CoreDriver(s, TimedScript(script, 0.01))
    aborted: set[str] = set()

    def check() -> None:
        s.check_invariants()
        for plan in driver.inflight:
            device, host = touched(plan, mode)
            for pool, blocks in ((s.kv.device, device), (s.kv.host, host)):
                loose = {b for b in blocks if b not in pool.refs}
                assert not loose, f"plan {plan.step_id}: {pool.name} blocks {loose} not held"

    last = max((a.at_event for a in arrivals), default=0)
    for event in range(2000):
        for a in arrivals:
            if a.at_event == event:
                prompt = PREFIXES[a.prefix][:a.prefix_len] + a.suffix
                driver.add(JobRequest(a.job_id, prompt, SamplingParams(
                    max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)))
            if a.abort_at == event and a.job_id in s.jobs():
                driver.abort(a.job_id)
                aborted.add(a.job_id)
                check()
        if not s.has_work() and event > last:
            break
        if len(driver.inflight) < setup["depth"] and driver.schedule() is not None:
            check()
        elif driver.inflight:
            driver.complete()
            check()
        else:
            driver.clock.advance(0.01)
    assert not s.has_work(), "work left after 2000 events"
    assert not s.kv.device.refs and not s.kv.host.refs, "references leaked"
    assert s.kv.num_free_device == setup["device"] and s.kv.num_free_host == setup["host"]
    tokens = driver.tokens()
    for a in arrivals:
        if a.job_id not in aborted:
            assert tokens[a.job_id] == [script(a.job_id, i) for i in range(a.max_tokens)]
