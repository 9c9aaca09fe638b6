"""Priority evictions in a two-stage pipeline: simulated OPT-175B (TP 8 × PP 2) with a device
pool shrunk to ``DEVICE_BLOCKS`` so memory binds, skip-join MLFQ, proactive swapping, ShareGPT
at ``LOADS`` × capacity, ``--seeds`` arrival seeds. With two plans in flight a decision comes
before the previous one's swap-outs land, which is where an eviction can be made twice or for
blocks the claimant never needed (docs/scheduler.md, "Memory preemption by priority").

Prints a table per seed (priority evictions, swap-outs, per-token mean and P95), then one JSON
object; ``--out`` also writes it under ``results/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import RESULTS_DIR, capacity_rate, dataset_pairs, run_point
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimSetup

MODEL = "opt-175b"
DEVICE_BLOCKS = 600
LOADS = (0.6, 0.9, 1.2)
NUM_REQUESTS = 400
NUM_SEEDS = 3


def point(load: float, seed: int, requests: int = NUM_REQUESTS) -> dict[str, Any]:
    cost = CostModel.from_json(PAPER_PROFILES[MODEL])
    assert cost.serving.max_batch_size is not None
    rate = load * capacity_rate(dataset_pairs("sharegpt"), cost, cost.serving.max_batch_size)
    result, summary = run_point(W.workload(dataset_pairs("sharegpt"), requests, rate, seed), cost,
                                SimSetup(num_device_blocks=DEVICE_BLOCKS))
    return {"load": load, "seed": seed, "rate": rate,
            "priority_evictions": result.totals.get("preemptions", 0),
            "swaps_out": summary["swaps_out"], "per_token_mean": summary["per_token_mean"],
            "per_token_p95": summary["per_token_p95"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--loads", type=lambda v: [float(x) for x in v.split(",")], default=list(LOADS))
    parser.add_argument("--seeds", type=int, default=NUM_SEEDS)
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--out", type=Path, default=None, help=f"a JSON file (e.g. under {RESULTS_DIR})")
    args = parser.parse_args()
    rows = []
    print(f"{MODEL} (sim), {DEVICE_BLOCKS}-block device pool, {args.requests} ShareGPT requests")
    print(f"{'load':>5}{'seed':>5}{'req/s':>7}{'evictions':>11}{'swap-outs':>11}{'mean s/tok':>12}{'P95 s/tok':>11}")
    for load in args.loads:
        for seed in range(args.seeds):
            row = point(load, seed, args.requests)
            rows.append(row)
            print(f"{load:>5g}{seed:>5}{row['rate']:>7.2f}{row['priority_evictions']:>11}{row['swaps_out']:>11}"
                  f"{row['per_token_mean']:>12.4f}{row['per_token_p95']:>11.4f}", flush=True)
    out = {"model": MODEL, "device_blocks": DEVICE_BLOCKS, "requests": args.requests, "points": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
