"""Skip-join MLFQ stays stable under overload: starvation promotion does not become the
schedule and does not churn the KV cache when iterations are longer than the configured α.

The demo server's regime, simulated: iterations of 0.6–0.9 s (three times α = 0.3 s), ShareGPT
lengths scaled to ¼ (as the real-HTTP runs do), batch 16, a device pool small enough to bind,
Poisson arrivals at 0.5, 1.0 and 1.5 × the capacity the cost model implies; the prefix cache on,
as the server runs.
"""

from __future__ import annotations

import pytest

from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import capacity_rate
from fastserve.bench.sim import CostModel, SimResult, SimSetup, simulate
from fastserve.scheduler.profile import Profile

ALPHA_S = 0.3
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 128, 512], "seconds": [0.45, 0.9, 2.7]},
    "t_dec": {"batch_sizes": [1, 16], "seconds": [0.6, 0.9]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.004},
})
COST = CostModel(PROFILE)
BATCH = 16
DEVICE_BLOCKS = 96       # ~8 jobs of ¼-ShareGPT at their longest: the pool binds under load
NUM_REQUESTS = 100
LOADS = (0.5, 1.0, 1.5)
SEEDS = (0, 1, 2)


def _pairs() -> list[W.LengthPair]:
    return [W.LengthPair(max(1, round(p.prompt_len / 4)), max(1, round(p.output_len / 4)))
            for p in W.load_sharegpt_lengths()]


def _run(load: float, seed: int) -> SimResult:
    pairs = _pairs()
    rate = load * capacity_rate(pairs, COST, BATCH)
    requests = W.workload(pairs, NUM_REQUESTS, rate, seed)
    setup = SimSetup(max_batch_size=BATCH, num_device_blocks=DEVICE_BLOCKS,
                     num_host_blocks=4 * DEVICE_BLOCKS, starvation_alpha_s=ALPHA_S,
                     prefix_caching=True)
    result = simulate(requests, COST, setup)
    assert all(r.ok for r in result.records)
    return result


def test_the_iterations_are_three_alphas_long() -> None:
    assert PROFILE.t_dec(BATCH) == pytest.approx(3 * ALPHA_S)


@pytest.mark.parametrize("seed", SEEDS)
def test_overload_does_not_turn_promotion_into_churn(seed: int) -> None:
    result = _run(1.5, seed)
    per_job = {k: v / NUM_REQUESTS for k, v in result.totals.items()}
    assert per_job.get("promotions", 0) <= 1.0, per_job
    assert per_job.get("swaps_out", 0) <= 2.0, per_job
    assert result.totals.get("swaps_out", 0) > 0, "the device pool must bind for this test"


@pytest.mark.parametrize("seed", SEEDS)
def test_throughput_does_not_fall_as_load_rises(seed: int) -> None:
    tokens_per_s, steps_per_s = [], []
    for load in LOADS:
        result = _run(load, seed)
        tokens = sum(r.output_tokens for r in result.records)
        tokens_per_s.append(tokens / result.makespan_s)
        steps_per_s.append(result.steps / result.makespan_s)
    assert tokens_per_s == sorted(tokens_per_s), tokens_per_s
    # Steps get longer only as batches fill (t_dec grows with the batch), not from swap tails
    # or promotions: from full load to 1.5x the step rate holds within 10 %.
    assert steps_per_s[2] >= 0.9 * steps_per_s[1], steps_per_s


# ---- sustained overload: twice the capacity, ~500 jobs held -------------------------------------
OVERLOAD_REQUESTS = 1024
OVERLOAD_SEEDS = (0, 1, 2)


def _sustained(load: float, n: int, seed: int = 0,
               **options: float) -> tuple[SimResult, float, int]:
    """One run with a host pool that never binds; returns the result, the P95 per-token latency
    of the jobs with at most 8 output tokens (32 before the ¼ scaling), and the most jobs held
    at once."""
    pairs = _pairs()
    requests = W.workload(pairs, n, load * capacity_rate(pairs, COST, BATCH), seed)
    setup = SimSetup(max_batch_size=BATCH, num_device_blocks=DEVICE_BLOCKS,
                     num_host_blocks=64 * DEVICE_BLOCKS, starvation_alpha_s=ALPHA_S,
                     prefix_caching=True, scheduler_options=options)
    result = simulate(requests, COST, setup)
    assert all(r.ok for r in result.records)
    short = sorted((r.end - r.arrival) / r.output_tokens for r in result.records
                   if r.output_tokens <= 8)
    held = peak = 0
    for _, delta in sorted([(r.arrival, 1) for r in result.records]
                           + [(r.end, -1) for r in result.records]):
        held += delta
        peak = max(peak, held)
    return result, short[int(0.95 * (len(short) - 1))], peak


def test_sustained_overload_does_not_churn_and_short_jobs_stay_ahead() -> None:
    """2× capacity until 470-550 jobs are held, iterations 3× the configured α, over three arrival
    seeds. With α fixed when a wait begins, floored at ten decode iterations and at rounds of
    the backlog ahead (and postponed, never brought forward, when the backlog grew by the time
    it is due), and backed off ×64 per promotion (the defaults), promotions per job stay under
    one; the paper's fixed α promotes every starving job every α. Measured (seeds 0/1/2):
    0.69/0.64/0.66 promotions and 1.97/1.75/1.90 swap-outs per job (mean 1.88), short jobs' P95
    per-token 2.24/2.13/2.29× its value at 0.9 load, where 0.21/0.17/0.17 promotions a job (a
    wait of ten decode iterations is the paper's SLO); fixed α (seed 0) 27.9 promotions per
    job. (With the floor at ten measured steps, which carry first iterations: 0.73/0.66/0.70,
    2.08/1.82/1.95, 2.20/2.65/2.26×, and 0.16/0.14/0.18 at 0.9 load.)"""
    promotions, swap_outs = [], []
    for seed in OVERLOAD_SEEDS:
        light, light_p95, _ = _sustained(0.9, 300, seed)
        ours, ours_p95, peak = _sustained(2.0, OVERLOAD_REQUESTS, seed)
        assert peak >= 450, peak
        assert ours_p95 <= 3 * light_p95, (seed, ours_p95, light_p95)
        assert light.totals.get("promotions", 0) / 300 <= 0.25, seed
        promotions.append(ours.totals["promotions"] / OVERLOAD_REQUESTS)
        swap_outs.append(ours.totals["swaps_out"] / OVERLOAD_REQUESTS)
        if seed == 0:
            fixed, fixed_p95, _ = _sustained(2.0, OVERLOAD_REQUESTS, seed, starvation_backoff=1.0,
                                             starvation_backlog_batches=0.0)
            assert fixed.totals["promotions"] >= 20 * ours.totals["promotions"]
            assert fixed_p95 >= 5 * ours_p95
    assert max(promotions) <= 1.0, promotions
    assert sum(swap_outs) / len(swap_outs) <= 2.0, swap_outs
    assert max(swap_outs) <= 2.25, swap_outs
