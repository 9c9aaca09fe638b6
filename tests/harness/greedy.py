"""Greedy generation through ``tests.harness.engine_driver.Driver``, stopping at EOS or a token limit.

One loop for every data-plane parity test that drives plans by hand: each step runs every job
that has not finished, optionally swapping one job to the host pool at a chosen step and back in
a later one (``SwapMidway``). A job finishes when it emits ``eos_token_id`` (kept, as ``generate``
keeps it) or reaches ``max_tokens``. Picklable arguments only, so a TP rank in a spawned process
can run it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastserve.worker.messages import SamplingParams, SwapCommand
from tests.harness.engine_driver import Driver


@dataclass(frozen=True)
class SwapMidway:
    """Job ``job_id`` leaves for the host pool at step ``out_step`` (it does not run there or
    after) and comes back at ``in_step``, in the same step it runs again (the forward waits for
    the copy)."""

    job_id: str
    out_step: int
    in_step: int


def greedy_until_stop(driver: Driver, prompts: Sequence[Sequence[int]], max_tokens: int,
                      eos_token_id: int | None, swap: SwapMidway | None = None) -> dict[str, list[int]]:
    """Tokens of each prompt (keyed ``"0"``, ``"1"``, …): all jobs start in one batch."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        driver.add(str(i), list(prompt), sampling)

    def finished(job_id: str) -> bool:
        out = driver.jobs[job_id].generated
        return len(out) >= max_tokens or (bool(out) and out[-1] == eos_token_id)

    step = 0
    while running := [j for j in driver.jobs if not finished(j)]:
        swap_out: tuple[SwapCommand, ...] = ()
        swap_in: tuple[SwapCommand, ...] = ()
        if swap is not None and swap.out_step <= step < swap.in_step:
            assert swap.job_id in running, f"job {swap.job_id} finished before its swap at step {step}"
            running.remove(swap.job_id)
            if step == swap.out_step:
                swap_out = (driver.swap_out(swap.job_id),)
        elif swap is not None and step == swap.in_step:
            swap_in = (driver.swap_in(swap.job_id),)
        driver.step(running, swap_out, swap_in)
        step += 1
    return {j: job.generated for j, job in driver.jobs.items()}
