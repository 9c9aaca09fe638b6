"""Properties of scheduler + KV manager under random load (hypothesis), for every policy and
every swap mode, with one and with two plans in flight:

* block integrity holds after every schedule and every update (``check_invariants``);
* every job finishes with all its tokens (no deadlock: the simulator's loop raises ``SimStalled`` if work
  remains with nothing runnable; no livelock: a bound on the number of plans);
* a job that has waited past α (the α in effect: floored at k measured iterations) is
  promoted at the next decision (MLFQ policies);
* no job runs while its KV is not resident (a reactive swap-in in the same plan excepted);
* no job is in two in-flight plans; no job that never had KV is admitted while both tiers are
  full (swap modes);
* a job claims room at most once while the swap-outs made for it are in flight: no decision
  evicts for a job while an eviction an earlier decision made for it is still being copied
  (proactive preemption with two plans in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastserve.bench.sim.driver import CostModelExecutor, drive
from fastserve.kv.manager import Residency
from fastserve.scheduler.apply import Applied
from fastserve.scheduler.config import SWAP_MODES, PolicyName, SwapMode
from fastserve.scheduler.decision import Decision, Evict
from fastserve.scheduler.job import JobRequest, JobState
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchPlan, SamplingParams
from tests.harness.scheduling import RANDOM_LOAD_PROFILE as PROFILE
from tests.harness.scheduling import every_policy_and_mode, make


@dataclass(frozen=True)
class Setup:
    block: int
    device: int
    host: int
    batch: int
    depth: int          # plans in flight (pipeline stages)
    alpha: float
    budget: int         # max_num_batched_tokens
    reserved: int


Workload = tuple[Setup, list[tuple[float, JobRequest]]]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block = draw(st.sampled_from([1, 2, 4]))
    device = draw(st.integers(3, 16))
    setup = Setup(block=block, device=device, host=draw(st.integers(1, 16)),
                  batch=draw(st.integers(1, 4)), depth=draw(st.sampled_from([1, 2])),
                  alpha=draw(st.sampled_from([0.02, 0.05, 0.3])),
                  budget=draw(st.sampled_from([8, 64])),
                  reserved=draw(st.integers(0, min(2, device - 1))))
    jobs = []
    for i in range(draw(st.integers(1, 12))):
        prompt = draw(st.integers(1, 10))
        # Jobs must fit the device pool on their own at their longest (else add() refuses).
        most = device * block - prompt + 1
        if most < 1:
            continue
        out = draw(st.integers(1, min(8, most)))
        token = draw(st.integers(3, 99))
        jobs.append((draw(st.floats(0.0, 0.2)),
                     JobRequest(f"j{i}", (token,) * prompt,
                                SamplingParams(max_tokens=out, temperature=0.0,
                                               ignore_eos=True))))
    return setup, jobs


def script(job_id: str, index: int) -> int:
    """Tokens depend on the job and the position only, like greedy decoding does."""
    return 3 + (sum(map(ord, job_id)) * 31 + index * 7) % 90


@every_policy_and_mode
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads())
def test_random_load_keeps_every_invariant(policy: PolicyName, mode: SwapMode,
                                           case: Workload) -> None:
    check_random_load(policy, mode, case, chunk_tokens=None)


@every_policy_and_mode
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads(), chunk_tokens=st.integers(1, 4))
def test_random_load_with_chunked_prefill_keeps_every_invariant(
        policy: PolicyName, mode: SwapMode, case: Workload, chunk_tokens: int) -> None:
    """The same properties with prompts (1..10 tokens) split into chunks of 1..4 tokens: jobs
    part-way through their prompt are swapped, dropped, preempted and resumed like any other;
    a chunk never emits a token (the token check below would see it)."""
    check_random_load(policy, mode, case, chunk_tokens=chunk_tokens)


def check_random_load(policy: PolicyName, mode: SwapMode, case: Workload,
                      chunk_tokens: int | None) -> None:
    setup, jobs = case
    s = make(policy, batch=setup.batch, alpha=setup.alpha, device=setup.device, host=setup.host,
             block=setup.block, mode=mode, profile=PROFILE, reserved=setup.reserved,
             chunk_tokens=chunk_tokens, max_num_batched_tokens=setup.budget)
    ever_admitted: set[str] = set()
    inflight: dict[int, BatchPlan] = {}
    full_before: list[bool] = [False]   # both tiers full when the next decision starts

    def observe(sched: Scheduler, plan: BatchPlan | None, now: float) -> None:
        sched.check_invariants()
        if plan is not None:
            check_plan(sched, plan, now)
        else:              # an update: the oldest plan in flight came back
            inflight.pop(min(inflight))
        # Nothing else frees or takes blocks before the next decision (arrivals do not).
        full_before[0] = sched.kv.num_free_device == 0 and sched.kv.num_free_host == 0

    def check_plan(sched: Scheduler, plan: BatchPlan, now: float) -> None:
        swapped_in = {c.job_id for c in plan.swap_in}
        if chunk_tokens is not None:
            check_chunks(sched, plan, chunk_tokens, setup.budget)
        for e in plan.entries:
            where = sched.kv.residency(e.job_id)
            assert where is Residency.RESIDENT or (
                where is Residency.TRANSIT and e.job_id in swapped_in and mode == "reactive"
            ), f"{e.job_id} runs with its KV {where.value}"
            assert all(e.job_id not in {x.job_id for x in p.entries}
                       for p in inflight.values()), f"{e.job_id} in two in-flight plans"
        # (A job whose cached prefix is fetched from the host is admitted by the fetch.)
        given_kv = {e.job_id for e in plan.entries} | {c.job_id for c in plan.swap_in}
        new = given_kv - ever_admitted
        if mode != "recompute" and full_before[0]:
            assert not new, f"admitted {new} while both tiers were full"
        ever_admitted.update(given_kv)
        inflight[plan.step_id] = plan
        if sched.policy.starvation:
            for job in sched.jobs().values():
                # Naive MLFQ does not boost a job whose first iteration is being cut at the
                # quantum (in level 1 it would be cut again): see NaiveMLFQ.may_be_promoted.
                cut = policy == "naive_mlfq" and not job.generated and chunk_tokens is None
                if job.state in (JobState.WAITING, JobState.RUNNABLE) and job.level > 1 \
                        and not cut:
                    assert job.starve_due is not None, f"{job.job_id} waits unwatched"
                    assert now <= job.starve_due, (
                        f"{job.job_id} was due for promotion at {job.starve_due} and is still "
                        f"in level {job.level} at {now}")

    watch_claims(s)
    total_tokens = sum(r.sampling.max_tokens for _, r in jobs)
    if chunk_tokens is not None:   # every first iteration may take one plan per chunk
        total_tokens += sum(-(-len(r.prompt_ids) // chunk_tokens) for _, r in jobs)
    # Every plan either runs a job or moves memory for one; a generous bound on plans per
    # token catches a livelock (plans that only swap, forever).
    result = drive(s, CostModelExecutor(PROFILE, script), jobs,
                   pipeline_depth=setup.depth,
                   max_plans=20 * total_tokens + 20, observe=observe)
    assert set(result.finish_times) == {r.job_id for _, r in jobs}
    for _, r in jobs:
        assert result.tokens[r.job_id] == [script(r.job_id, i)
                                           for i in range(r.sampling.max_tokens)]
        assert result.reasons[r.job_id] == "length"
    assert not s.has_work()
    assert s.kv.num_free_device == setup.device and s.kv.num_free_host == setup.host


def watch_claims(sched: Scheduler) -> None:
    """Check every applied decision: a deferred eviction (proactive: the victim's blocks are
    free once its plan returns) is made for a job only when no earlier one made for it is
    still in flight."""
    apply = sched.applier.apply
    made_at: dict[str, list[int]] = {}    # job -> steps of the plans that evicted for it

    def checked(decision: Decision, now: float, out: Applied) -> None:
        for a in decision.batch.actions:
            if not isinstance(a, Evict) or a.for_job is None or a.drop or a.reuse_now:
                continue
            pending = [k for k in made_at.get(a.for_job, ()) if k in sched.state.inflight]
            assert not pending, (f"decision {decision.step} evicts {a.job_id} for {a.for_job}, "
                                 f"whose evictions of plans {pending} are still in flight")
            made_at.setdefault(a.for_job, []).append(decision.step)
        apply(decision, now, out)

    sched.applier.apply = checked  # type: ignore[method-assign]


def check_chunks(sched: Scheduler, plan: BatchPlan, chunk_tokens: int, budget: int) -> None:
    """Chunked prefill: a plan stays within the token budget, no first-iteration entry feeds
    more than a chunk, a chunk starts where the job's KV ends and samples only at the end."""
    assert plan.num_tokens <= budget, f"plan feeds {plan.num_tokens} tokens > budget {budget}"
    for e in plan.entries:
        if not e.is_prefill:
            assert e.samples
            continue
        job = sched.jobs()[e.job_id]
        assert len(e.token_ids) <= chunk_tokens, f"{e.job_id}: chunk of {len(e.token_ids)}"
        assert e.start_pos == job.num_computed_tokens
        # The blocks of the whole first iteration are taken with its first chunk.
        assert sched.kv.num_tokens(e.job_id) == len(job.prompt_ids) + len(job.generated)
        full = job.prompt_ids + tuple(job.generated)
        assert e.token_ids == full[e.start_pos:e.context_len]
        assert e.samples == (e.context_len == len(full))


def _job(i: int, prompt: int, out: int) -> JobRequest:
    return JobRequest(f"j{i}", (3,) * prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))


#: Found by the property test: FCFS preempted the latest job (dropped: the host was full) to let
#: an older one grow, and admitted a new job into the freed blocks in the same batch.
PREEMPT_THEN_ADMIT: Workload = (
    Setup(block=2, device=13, host=5, batch=2, depth=2, alpha=0.02, budget=8, reserved=0),
    [(0.1875, _job(0, 9, 2)), (0.0, _job(1, 1, 1)), (0.0625, _job(2, 1, 7)), (0.0, _job(3, 1, 1)),
     (0.0, _job(4, 1, 1)), (0.109375, _job(5, 6, 6)), (0.0, _job(6, 1, 1)), (0.125, _job(7, 1, 7)),
     (0.1875, _job(8, 1, 1)), (0.125, _job(9, 8, 4))])


@pytest.mark.parametrize("mode", SWAP_MODES)
def test_fcfs_admits_nothing_into_blocks_a_preemption_freed(mode: SwapMode) -> None:
    check_random_load("fcfs", mode, PREEMPT_THEN_ADMIT, chunk_tokens=None)
