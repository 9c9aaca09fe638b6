"""Scheduler cost benchmark: time of one ``EngineCore`` step's two halves (``schedule()`` +
``update()``, the executor excluded) with N queued jobs.

``python -m fastserve.bench.bench_scheduler`` runs every policy at 100 / 1,000 / 10,000 queued jobs
(batch 16, a device pool big enough for all of them, synthetic outputs from the cost-model
executor on a virtual clock; a finished job is replaced so the queue stays at N) and prints a
table, then, as its last line, one JSON object: milliseconds per iteration by policy and
queued-job count. Issue 3's target: ≤ 1 ms at 10,000 for ``skip_join_mlfq``.

The JSON figure is the mean CPU time of this thread (``time.thread_time``) per iteration: on a
shared machine wall time also counts the time other processes held the core. The table shows
both; wall p50/p99 show the spread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from fastserve.bench.sim.driver import CostModelExecutor, constant_tokens
from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.scheduler.config import POLICIES, KVCacheConfig, PolicyName, SchedulerConfig
from fastserve.scheduler.job import JobRequest
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.messages import SamplingParams, blocks_for

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "config" / "profiles" / "opt-125m-cpu-tp1-pp1.json"
SIZES = (100, 1_000, 10_000)
BATCH = 16
BLOCK = 16
PROMPT_RANGE = (8, 512)      # uniform prompt lengths, tokens
OUTPUT_RANGE = (8, 256)      # uniform output lengths (max_tokens with ignore_eos)
EOS = 2
FILLER_TOKEN = 7


def _profile() -> Profile:
    if PROFILE.exists():
        return Profile.load(PROFILE)
    return Profile.from_dict({"t_init": {"prompt_lens": [1, 1024], "seconds": [0.03, 2.0]},
                              "t_dec": {"batch_sizes": [1, 32], "seconds": [0.03, 0.4]}})


def _request(rng: random.Random, i: int) -> JobRequest:
    prompt = tuple(rng.randrange(3, 50_000) for _ in range(rng.randint(*PROMPT_RANGE)))
    sampling = SamplingParams(max_tokens=rng.randint(*OUTPUT_RANGE), temperature=0.0,
                              ignore_eos=True)
    return JobRequest(f"job-{i}", prompt, sampling)


def bench(policy: PolicyName, queued: int, iters: int, warmup: int, seed: int = 0
          ) -> tuple[list[float], list[float]]:
    """(wall, cpu) seconds of schedule()+update() for each of ``iters`` measured iterations."""
    rng = random.Random(seed)
    profile = _profile()
    per_job = blocks_for(PROMPT_RANGE[1] + OUTPUT_RANGE[1], BLOCK)
    sched = Scheduler(SchedulerConfig(policy=policy, max_batch_size=BATCH),
                      KVCacheConfig(block_size=BLOCK, num_device_blocks=queued * per_job,
                                    num_host_blocks=queued * per_job),
                      profile, eos_token_ids=frozenset({EOS}))
    executor = CostModelExecutor(profile, constant_tokens(FILLER_TOKEN))
    clock = VirtualClock()
    core = EngineCore(sched, clock)
    next_id = 0
    for _ in range(queued):
        core.add(_request(rng, next_id))
        next_id += 1
    wall: list[float] = []
    cpu: list[float] = []
    for it in range(warmup + iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = core.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        if plan is None:
            raise RuntimeError(f"{policy}: nothing scheduled with {queued} queued jobs")
        out = executor.execute(plan)
        clock.advance(out.timings["total"])
        t2, c2 = time.perf_counter(), time.thread_time()
        deltas = core.update(plan, out).deltas
        t3, c3 = time.perf_counter(), time.thread_time()
        if it >= warmup:
            wall.append((t1 - t0) + (t3 - t2))
            cpu.append((c1 - c0) + (c3 - c2))
        for d in deltas:   # keep the queue at `queued` jobs
            if d.finished:
                core.add(_request(rng, next_id))
                next_id += 1
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--policies", nargs="*", default=list(POLICIES))
    args = parser.parse_args()
    result: dict[str, dict[str, float]] = {}
    print(f"{'policy':<16}{'queued':>8}{'cpu mean':>10}{'wall mean':>10}{'wall p50':>10}"
          f"{'wall p99':>10}   (ms per schedule()+update())")
    for policy in args.policies:
        result[policy] = {}
        for n in SIZES:
            wall, cpu = bench(policy, n, args.iters, args.warmup)
            w = sorted(x * 1e3 for x in wall)
            cpu_mean = statistics.fmean(cpu) * 1e3
            result[policy][str(n)] = round(cpu_mean, 4)
            print(f"{policy:<16}{n:>8}{cpu_mean:>10.3f}{statistics.fmean(w):>10.3f}"
                  f"{w[len(w) // 2]:>10.3f}{w[min(len(w) - 1, int(len(w) * 0.99))]:>10.3f}",
                  flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
