"""Figure 8: peak KV-cache use, skip-join MLFQ vs FCFS, when memory is not the limit.

Simulated OPT-2.7B on one A100 (the paper's Figure 8 model) with a device pool large enough for
every job at once, so the curve is the KV the policy *wants* resident. Synthetic workload as the
paper describes it ("maximum output length 20"): ShareGPT prompt lengths, output lengths uniform
in 1..20, Poisson arrivals at load 1.0 (``capacity_rate``). Paper: ≈2 GB (FCFS) vs ≈15 GB (MLFQ),
7x. FCFS holds only the running batch; MLFQ also holds every preempted job's KV.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import Report, RunOptions, capacity_rate, dataset_pairs, run_point
from fastserve.bench.sim import OPT_2_7B_PROFILE, CostModel, SimSetup
from fastserve.scheduler.config import PolicyName
from fastserve.worker.messages import blocks_for

MAX_OUTPUT_LEN = 20
LOAD = 1.0
BATCH = 16
# At load 1.0 the MLFQ peak grows with the run length (the queue of preempted jobs does), so
# quick and full runs replay the same 1,000 jobs.
NUM_REQUESTS = {True: 1000, False: 1000}
POLICIES = ("fcfs", "skip_join_mlfq")
PAPER_GB = {"fcfs": 2.0, "skip_join_mlfq": 15.0}
GB = 1e9


def synthetic_pairs(n: int, seed: int) -> list[W.LengthPair]:
    rng = np.random.default_rng(seed)
    prompts = W.sample_pairs(dataset_pairs("sharegpt"), n, seed)
    outputs = rng.integers(1, MAX_OUTPUT_LEN + 1, size=n)
    return [W.LengthPair(p.prompt_len, int(o)) for p, o in zip(prompts, outputs, strict=True)]


def run(options: RunOptions) -> dict[str, Any]:
    report = Report("fig8", options)
    cost = CostModel.from_json(OPT_2_7B_PROFILE)
    n = NUM_REQUESTS[options.quick]
    pairs = synthetic_pairs(n, options.seed)
    rate = LOAD * capacity_rate(pairs, cost, BATCH)
    requests = W.build_requests(pairs, W.poisson_arrivals(n, rate, options.seed))
    # Room for every job's whole context at once: the pool never binds.
    unbounded = sum(blocks_for(p.prompt_len + p.output_len, cost.profile.block_size) for p in pairs)
    block_gb = cost.profile.swap_bytes_per_block / GB
    rows, curves, peaks = [], {}, {}
    for policy in POLICIES:
        result, point = run_point(requests, cost, SimSetup(policy=cast(PolicyName, policy), max_batch_size=BATCH,
                                                           num_device_blocks=unbounded, num_host_blocks=unbounded))
        peaks[policy] = result.kv.peak_device_blocks * block_gb
        times = [p[0] for p in result.kv.points]
        curves[policy] = (times, [p[1] * block_gb for p in result.kv.points])
        rows.append([policy, peaks[policy], PAPER_GB[policy], point["per_token_mean"], point["completed"]])
    ratio = peaks["skip_join_mlfq"] / peaks["fcfs"]
    report.add_table(f"Peak KV cache, OPT-2.7B (sim), {n} requests at {rate:.1f} req/s (load {LOAD})",
                     ["policy", "peak KV (GB)", "paper (GB)", "mean s/token", "completed"], rows,
                     f"MLFQ / FCFS peak: {ratio:.2f}x (paper ≈7x).")
    plots.kv_over_time(curves, report.plot_path("kv"), "KV cache in use, OPT-2.7B, outputs ≤ 20 tokens")
    report.data = {"rate": rate, "peaks_gb": peaks, "ratio": ratio}
    report.headline = {"peak_gb_fcfs": peaks["fcfs"], "peak_gb_skip_join_mlfq": peaks["skip_join_mlfq"],
                       "ratio": ratio, "paper_ratio": PAPER_GB["skip_join_mlfq"] / PAPER_GB["fcfs"]}
    return report.write()
