"""Metrics (``scheduler_stats``) and the integrity check tests run after every step
(``check_scheduler``) over a ``SchedulerState``; O(jobs + blocks), not for the hot path."""

from __future__ import annotations

from typing import Any

from fastserve.kv.manager import Residency, Tier
from fastserve.scheduler.job import Job, JobState
from fastserve.scheduler.state import InFlight, SchedulerState


def scheduler_stats(s: SchedulerState) -> dict[str, Any]:
    kv = s.kv
    return {
        "policy": s.policy.name,
        "swap_mode": s.kv_config.swap_mode,
        "jobs": len(s.jobs),
        "running": sum(len(r.job_ids) for r in s.inflight.values()),
        "admission_queue": s.num_unadmitted,
        "inflight_plans": len(s.inflight),
        "level_counts": list(s.queues.counts),
        "device_blocks": {"total": kv.device.capacity, "free": kv.num_free_device,
                          "releasing": kv.device_releasing},
        "host_blocks": {"total": kv.host.capacity, "free": kv.num_free_host},
        "swapped_out_blocks": kv.swapped_out_blocks,
        "swapped_in_blocks": kv.swapped_in_blocks,
        "starvation_alpha_s": s.alpha(),
        "step_time_s": s.step_time_s,
        "prefix_cache": kv.cache_stats(),
        **dict(s.totals),
    }


def check_scheduler(s: SchedulerState) -> None:
    """Every active job counted once in its level and placed where its state says; no job in
    two in-flight plans; running jobs resident; KV tables match each job's positions."""
    in_plan = _plan_of_each_job(s)
    counts = [0] * s.queues.num_levels
    expected: dict[str, int] = {}
    unadmitted = 0
    for job_id, job in s.jobs.items():
        assert job.job_id == job_id, f"job {job.job_id} filed under {job_id}"
        if job.state is JobState.ABORTED:
            assert job_id in in_plan, f"aborted job {job_id} kept but in no in-flight plan"
            assert s.kv.tier(job_id) is Tier.NONE, f"aborted job {job_id} still owns KV"
            continue
        assert job.active, f"job {job_id} is {job.state.value} but still held"
        counts[job.level - 1] += 1
        unadmitted += not job.admitted
        positions = _check_placed(s, job, in_plan)
        if positions is not None:
            expected[job_id] = positions
    assert counts == s.queues.counts, f"level counts {s.queues.counts}, jobs say {counts}"
    assert unadmitted == s.num_unadmitted, (
        f"admission queue says {s.num_unadmitted}, jobs say {unadmitted}")
    for lv in s.queues.levels:
        for name in ("ready", "pending", "evictable", "onhost"):
            for job_id in getattr(lv, name):
                assert job_id in s.jobs, f"{name} holds unknown job {job_id}"
    s.kv.check_invariants(expected)


def _plan_of_each_job(s: SchedulerState) -> dict[str, int]:
    in_plan: dict[str, int] = {}
    for step, rec in s.inflight.items():
        for job_id in rec.job_ids:
            assert job_id not in in_plan, (
                f"job {job_id} is in in-flight plans {in_plan[job_id]} and {step}")
            in_plan[job_id] = step
    return in_plan


def _check_placed(s: SchedulerState, job: Job, in_plan: dict[str, int]) -> int | None:
    """An active job is filed where its state says; returns the positions its table must cover."""
    kv, job_id = s.kv, job.job_id
    lv = s.queues.level(job.level)
    where = kv.residency(job_id)
    placed = {name for name in ("ready", "pending", "evictable", "onhost") if job_id in getattr(lv, name)}
    expected: int | None = None
    if job.state is JobState.WAITING:
        assert where is Residency.NONE, f"waiting job {job_id} has KV ({where.value})"
        assert not job.num_computed_tokens, (
            f"waiting job {job_id} has {job.num_computed_tokens} computed tokens")
        want: set[str] = {"pending"}
    elif job.state is JobState.RUNNABLE:
        assert where is not Residency.NONE, f"runnable job {job_id} has no KV"
        expected = job.table_len
        if job.decoding and kv.num_tokens(job_id) == job.num_tokens:
            # A recompute's chunks took the decode's position with the first one.
            expected = job.num_tokens
        want = {Residency.RESIDENT: {"ready", "evictable"}, Residency.HOST:
                {"pending", "onhost"}}.get(where, set())
    else:
        assert job_id in in_plan, f"running job {job_id} is in no in-flight plan"
        expected = _check_running(s, job, s.inflight[in_plan[job_id]])
        want = set()
    assert placed == want, (
        f"job {job_id} ({job.state.value}, KV {where.value}) is in {sorted(placed)}, "
        f"expected {sorted(want)}")
    starving = job.state is not JobState.RUNNING and s.policy.may_be_promoted(job)
    assert (job_id in s.queues.starving) == starving, (
        f"job {job_id}: starvation tracking is {job_id in s.queues.starving}, "
        f"expected {starving}")
    return expected


def _check_running(s: SchedulerState, job: Job, rec: InFlight) -> int:
    job_id = job.job_id
    assert s.kv.tier(job_id) is Tier.DEVICE, f"running job {job_id} is not on the device"
    chunk_end = rec.chunks.get(job_id)
    if chunk_end is not None:   # a prefill chunk short of the last
        assert job.num_computed_tokens < chunk_end < job.num_tokens, (
            f"chunk of {job_id} ends at {chunk_end} after {job.num_computed_tokens} "
            f"of {job.num_tokens} positions")
    if job_id not in rec.wasted:
        return job.num_tokens
    assert not job.generated, f"job {job_id}: a cut first iteration after tokens"
    covered = s.kv.num_tokens(job_id)
    assert 0 < covered < job.num_tokens, f"cut first iteration of {job_id} covers {covered} positions"
    return covered
