"""Scheduler cost benchmark: CPU time of one ``EngineCore`` step's two halves (``schedule()`` +
``update()``, the executor excluded) with N queued jobs.

Every policy at 100 / 1,000 / 10,000 jobs kept queued, batch 16, in a **binding** pool (~80 jobs'
worth: preemptions, swaps and promotions at every decision; the headline) and a **roomy** one.
Thread CPU time, since wall time on a shared machine counts others' time; the max is mostly a
garbage collection. A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from fastserve.bench.race import cpu_model
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
#: Device blocks of the binding pool: ~80 of these jobs at their mean length.
BINDING_BLOCKS = 2_000
#: Pool name -> device blocks (None: enough for every queued job at its longest).
POOLS: dict[str, int | None] = {"binding": BINDING_BLOCKS, "roomy": None}
HEADLINE = ("binding", "skip_join_mlfq", 10_000)
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


def bench(policy: PolicyName, queued: int, iters: int, warmup: int, seed: int = 0,
          device_blocks: int | None = None) -> tuple[list[float], list[float]]:
    """(wall, cpu) seconds per iteration; ``device_blocks`` None: a pool that holds every job."""
    rng = random.Random(seed)
    profile = _profile()
    per_job = blocks_for(PROMPT_RANGE[1] + OUTPUT_RANGE[1], BLOCK)
    sched = Scheduler(SchedulerConfig(policy=policy, max_batch_size=BATCH),
                      KVCacheConfig(block_size=BLOCK,
                                    num_device_blocks=device_blocks or queued * per_job,
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


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in seconds)
    return {"mean": statistics.fmean(ms), "p50": ms[len(ms) // 2],
            "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))], "max": ms[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--policies", nargs="*", default=list(POLICIES))
    parser.add_argument("--pools", nargs="*", choices=list(POOLS), default=list(POOLS))
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(SIZES))
    args = parser.parse_args()
    result: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    print(f"CPU: {cpu_model()}; batch {BATCH}, binding pool {BINDING_BLOCKS} blocks of {BLOCK}")
    print(f"{'pool':<8}{'policy':<16}{'queued':>8}{'cpu mean':>10}{'cpu p99':>9}{'cpu max':>9}"
          f"{'wall mean':>10}{'wall p99':>10}   (ms per schedule()+update())")
    for pool in args.pools:
        result[pool] = {}
        for policy in args.policies:
            result[pool][policy] = {}
            for n in args.sizes:
                wall, cpu = bench(policy, n, args.iters, args.warmup, device_blocks=POOLS[pool])
                c, w = _stats(cpu), _stats(wall)
                result[pool][policy][str(n)] = {k: round(v, 4) for k, v in c.items()}
                print(f"{pool:<8}{policy:<16}{n:>8}{c['mean']:>10.3f}{c['p99']:>9.3f}{c['max']:>9.2f}"
                      f"{w['mean']:>10.3f}{w['p99']:>10.3f}", flush=True)
    pool, policy, n = HEADLINE
    headline = result.get(pool, {}).get(policy, {}).get(str(n))
    print(json.dumps({"cpu": cpu_model(), "headline": {"pool": pool, "policy": policy, "queued": n,
                                                       "cpu_ms": headline},
                      "cpu_ms": result}))


if __name__ == "__main__":
    main()
