"""Per-iteration time in process vs through the Ray pipeline: ``python -m fastserve.bench.bench_pipeline``.

One fixed mixed iteration of the demo model's shapes (dummy weights, CPU, float32) run in process and by
``PipelineExecutor`` at TP×PP = 1×1, 2×1, 1×2, over the compiled graph and over plain actor calls:
``serial`` (one plan at a time, the step latency) and ``pipelined`` (PP plans in flight, the steady
rate). Each worker gets ``--threads`` torch threads, one core standing in for one GPU. A table, then one
JSON object; starts and stops its own Ray instance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import torch

from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, StepOutput, blocks_for
from fastserve.worker.model.config import ModelConfig, load_model_config
from fastserve.worker.pipeline import PipelineExecutor
from fastserve.worker.spec import EngineSpec, ModelSpec, ParallelSpec
from fastserve.worker.transport import TransportKind

ROOT = Path(__file__).resolve().parents[2]
DECODES = 8
CONTEXT = 64
PREFILL = 16
BLOCK_SIZE = 16
NUM_BATCHES = 2  # disjoint copies of the batch, alternating
REPEATS = 2  # timed runs per figure; the best is kept
LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tensor_parallel_size, pipeline_parallel_size)
TRANSPORTS: tuple[TransportKind, ...] = ("compiled", "actor")
RAY_LOGICAL_CPUS = 8
RAY_OBJECT_STORE_BYTES = 200 * 1024 * 1024
GREEDY = SamplingParams(max_tokens=CONTEXT + 1, temperature=0.0, ignore_eos=True)

Execute = Callable[[BatchPlan], Awaitable[StepOutput]]


def batch_blocks() -> int:
    return DECODES * blocks_for(CONTEXT, BLOCK_SIZE) + blocks_for(PREFILL, BLOCK_SIZE)


def make_plans() -> list[BatchPlan]:
    """``NUM_BATCHES`` plans with disjoint jobs and blocks, each ``DECODES`` decodes + 1 prefill."""
    plans, per_decode = [], blocks_for(CONTEXT, BLOCK_SIZE)
    for b in range(NUM_BATCHES):
        base = b * batch_blocks()
        entries = [BatchEntry(f"b{b}d{j}", (7,), CONTEXT - 1,
                              tuple(range(base + j * per_decode, base + (j + 1) * per_decode)),
                              False, GREEDY, CONTEXT) for j in range(DECODES)]
        first = base + DECODES * per_decode
        entries.append(BatchEntry(f"b{b}p", tuple(range(2, 2 + PREFILL)), 0,
                                  tuple(range(first, first + blocks_for(PREFILL, BLOCK_SIZE))), True, GREEDY))
        plans.append(BatchPlan(b, tuple(entries)))
    return plans


async def time_plans(execute: Execute, plans: list[BatchPlan], window: int, iterations: int,
                     warmup: int) -> float:
    """Seconds per iteration with up to ``window`` plans in flight, after ``warmup`` iterations:
    the best of ``REPEATS`` runs (the machine is shared; the minimum is the least disturbed)."""
    async def run(n: int) -> None:
        inflight: list[asyncio.Future[StepOutput]] = []
        for k in range(n):
            if len(inflight) == window:
                await inflight.pop(0)
            inflight.append(asyncio.ensure_future(execute(plans[k % len(plans)])))
        await asyncio.gather(*inflight)

    await run(warmup)
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        await run(iterations)
        samples.append((time.perf_counter() - start) / iterations)
    return min(samples)


def bench_in_process(config: ModelConfig, seed: int, iterations: int, warmup: int) -> float:
    ex = InProcessExecutor(ModelSpec(config, NUM_BATCHES * batch_blocks(), 0, BLOCK_SIZE, seed=seed))

    async def execute(plan: BatchPlan) -> StepOutput:
        return ex.execute(plan)

    try:
        return asyncio.run(time_plans(execute, make_plans(), 1, iterations, warmup))
    finally:
        ex.close()


async def bench_pipeline(config: ModelConfig, tp: int, pp: int, transport: Literal["compiled", "actor"], seed: int,
                         iterations: int, warmup: int, threads: int) -> dict[str, float]:
    spec = EngineSpec(ModelSpec(config, NUM_BATCHES * batch_blocks(), 0, block_size=BLOCK_SIZE, seed=seed,
                                torch_threads=threads), ParallelSpec(tp, pp, transport))
    ex = PipelineExecutor(spec)
    started = time.perf_counter()
    await ex.start()
    try:
        start_s = time.perf_counter() - started
        serial = await time_plans(ex.execute, make_plans(), 1, iterations, warmup)
        piped = serial if ex.max_inflight == 1 else await time_plans(ex.execute, make_plans(), ex.max_inflight,
                                                                      iterations, warmup)
    finally:
        await ex.shutdown()
    return {"serial_ms": serial * 1e3, "pipelined_ms": piped * 1e3, "start_s": start_s}


def run_pipelines(config: ModelConfig, seed: int, iterations: int, warmup: int,
                  threads: int) -> dict[str, dict[str, Any]]:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, object_store_memory=RAY_OBJECT_STORE_BYTES,
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        results: dict[str, dict[str, Any]] = {}
        for tp, pp in LAYOUTS:
            key = f"tp{tp}_pp{pp}"
            results[key] = {t: asyncio.run(bench_pipeline(config, tp, pp, t, seed, iterations, warmup, threads))
                            for t in TRANSPORTS}
        return results
    finally:
        ray.shutdown()


def report(config: ModelConfig, in_process_ms: float, results: dict[str, dict[str, Any]],
           iterations: int) -> dict[str, Any]:
    print(f"{config.name}: {DECODES} decodes at context {CONTEXT} + 1 prefill of {PREFILL} tokens, "
          f"{iterations} iterations, {torch.get_num_threads()} torch thread(s) per process, {os.cpu_count()} cores")
    print(f"{'layout':>8} {'transport':>9} | {'serial ms':>9} {'x in-proc':>9} | "
          f"{'pipelined ms':>12} {'x in-proc':>9} | {'start s':>7}")
    print(f"{'in-proc':>8} {'-':>9} | {in_process_ms:>9.1f} {1.0:>9.2f} | {in_process_ms:>12.1f} {1.0:>9.2f} |")
    for layout, by_transport in results.items():
        for transport, r in by_transport.items():
            r["serial_ratio"] = r["serial_ms"] / in_process_ms
            r["pipelined_ratio"] = r["pipelined_ms"] / in_process_ms
            print(f"{layout:>8} {transport:>9} | {r['serial_ms']:>9.1f} {r['serial_ratio']:>9.2f} | "
                  f"{r['pipelined_ms']:>12.1f} {r['pipelined_ratio']:>9.2f} | {r['start_s']:>7.1f}")
    rounded = {lay: {t: {k: round(v, 3) for k, v in r.items()} for t, r in bt.items()} for lay, bt in results.items()}
    return {"model": config.name, "device": "cpu", "decodes": DECODES, "context": CONTEXT,
            "prefill_tokens": PREFILL, "iterations": iterations, "cores": os.cpu_count(),
            "in_process_ms": round(in_process_ms, 3), "torch_threads": torch.get_num_threads(),
            "pipeline": rounded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default=str(ROOT / "config/models/opt-125m"))
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker and in process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_model_config(args.model)
    in_process_ms = bench_in_process(config, args.seed, args.iterations, args.warmup) * 1e3
    results = run_pipelines(config, args.seed, args.iterations, args.warmup, args.threads)
    print(json.dumps(report(config, in_process_ms, results, args.iterations)))


if __name__ == "__main__":
    main()
