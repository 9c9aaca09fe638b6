"""Shared set-up for the scheduler's tests: a hand-made profile with binary-exact times, a
``Scheduler`` factory (``make``), one ``EngineCore.step`` with a fake data plane that charges exactly
the ``total`` a test passes, the random-load tests' profile, and ``every_policy_and_mode``.

q1 = t_dec(1) = 1.0, so the quanta are 1, 2, 4, 8 and the largest t_init (7.0) needs 4 levels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.scheduler.config import (
    POLICIES,
    SWAP_MODES,
    ChunkedPrefillConfig,
    KVCacheConfig,
    PolicyName,
    SchedulerConfig,
    SwapMode,
)
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import BatchPlan, SamplingParams, StepOutput

ROOT = Path(__file__).resolve().parents[2]
EOS = 2
TOKEN = 9  # what the fake data plane "generates" (never EOS)

# q1 = t_dec(1) = 1.0, so quanta are 1, 2, 4, 8 and the largest t_init (7.0) needs 4 levels.
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [8, 16, 32, 64], "seconds": [0.5, 1.5, 3.0, 7.0]},
    "t_dec": {"batch_sizes": [1, 16], "seconds": [1.0, 2.0]},
})
#: The random-load (hypothesis) tests' profile: short prompts, cheap swaps (the simulator's cost
#: model charges them; the scheduler does not read them).
RANDOM_LOAD_PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 16, 64], "seconds": [0.01, 0.03, 0.1]},
    "t_dec": {"batch_sizes": [1, 16], "seconds": [0.01, 0.02]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.001},
})

F = TypeVar("F", bound=Callable[..., Any])


def every_policy_and_mode(test: F) -> F:
    """Run ``test(policy, mode, ...)`` for every policy × swap mode (ids ``policy-mode``)."""
    by_mode: F = pytest.mark.parametrize("mode", SWAP_MODES)(pytest.mark.parametrize("policy", POLICIES)(test))
    return by_mode


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def req(job_id: str, prompt_len: int, max_tokens: int = 4) -> JobRequest:
    return JobRequest(job_id, tuple(range(3, 3 + prompt_len)), greedy(max_tokens))


def make(policy: PolicyName = "skip_join_mlfq", *, batch: int = 16, alpha: float = 1000.0,
         device: int = 256, host: int = 256, block: int = 4, mode: SwapMode = "proactive",
         profile: Profile = PROFILE, cache: bool = True, reserved: int = 0,
         chunk_tokens: int | None = None, eos: frozenset[int] = frozenset({EOS}),
         **extra: Any) -> Scheduler:
    """q1 = t_dec(1) = 1, so the quanta are 1, 2, 4, 8 whatever the batch size. ``req`` prompts
    all start 3, 4, 5, ...: a test whose hand-computed times assume every prompt is computed in
    full passes ``cache=False`` (no prefix caching). ``chunk_tokens``: chunked prefill on, with
    chunks of that many tokens; ``extra``: further ``SchedulerConfig`` fields."""
    if chunk_tokens is not None:
        extra["chunked_prefill"] = ChunkedPrefillConfig(enabled=True, chunk_tokens=chunk_tokens)
    return Scheduler(
        SchedulerConfig(policy=policy, max_batch_size=batch, starvation_alpha_s=alpha, **extra),
        KVCacheConfig(block_size=block, num_device_blocks=device, num_host_blocks=host,
                      swap_mode=mode, prefix_caching=cache, reserved_blocks=reserved),
        profile, eos_token_ids=eos)


class ChargedExecutor:
    """The fake data plane: every entry "generates" ``TOKEN`` and the plan takes ``total``
    seconds of the clock."""

    def __init__(self, clock: VirtualClock, total: float) -> None:
        self.clock = clock
        self.total = total

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.clock.advance(self.total)
        return StepOutput(plan.step_id, {e.job_id: TOKEN for e in plan.entries}, {"total": self.total})


def step(s: Scheduler, now: float, total: float) -> tuple[BatchPlan, list[TokenDelta]]:
    """One ``EngineCore.step`` charged ``total`` seconds: scheduled at ``now``, its output applied
    at now+total, the scheduler's invariants checked after each half."""
    clock = VirtualClock(now)
    result = EngineCore(s, clock, check_invariants=True).step(ChargedExecutor(clock, total))
    assert result is not None, f"nothing to run at t={now}"
    assert result.output is not None, f"step {result.plan.step_id} failed"
    return result.plan, result.deltas


def ids(plan: BatchPlan) -> list[str]:
    return [e.job_id for e in plan.entries]
