"""Figure 1: under FCFS (run to completion), how much of end-to-end latency is queueing.

Simulated OPT-13B on one A100; workloads Fix-Len (every job at ShareGPT's mean lengths),
ShareGPT and Alpaca, at 90 % and 100 % of FCFS's saturation throughput (measured with every job
busy all the time, ``capacity_rate``). Queueing share = Σ queueing seconds / Σ E2E over the run, from the scheduler's
per-job accounting. Paper: Fix-Len ≈ 20 %; ShareGPT and Alpaca 87.6–98.0 %.
"""

from __future__ import annotations

from typing import Any

from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import Report, RunOptions, capacity_rate, dataset_pairs, mean_lengths, run_point
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimSetup

MODEL = "opt-13b"
DEFAULT_BATCH = 16
LOADS = (0.9, 1.0)
NUM_REQUESTS = {True: 200, False: 1000}
FIX_LEN = "fix-len"
WORKLOADS = (FIX_LEN, "sharegpt", "alpaca")
PAPER = {FIX_LEN: "≈20 %", "sharegpt": "87.6–98.0 %", "alpaca": "87.6–98.0 %"}


def _pairs(name: str) -> list[W.LengthPair]:
    if name != FIX_LEN:
        return dataset_pairs(name)
    prompt, output = mean_lengths(dataset_pairs("sharegpt"))
    return W.fixed_length_pairs(1, round(prompt), round(output))


def run(options: RunOptions) -> dict[str, Any]:
    report = Report("fig1", options)
    cost = CostModel.from_json(PAPER_PROFILES[MODEL])
    setup = SimSetup(policy="fcfs")
    n = NUM_REQUESTS[options.quick]
    shares: dict[str, list[float]] = {f"{int(load * 100)}% load": [] for load in LOADS}
    rows, data = [], {}
    for name in WORKLOADS:
        pairs = _pairs(name)
        capacity = capacity_rate(pairs, cost, cost.serving.max_batch_size or DEFAULT_BATCH)
        for load in LOADS:
            rate = load * capacity
            _, point = run_point(W.workload(pairs, n, rate, options.seed), cost, setup)
            shares[f"{int(load * 100)}% load"].append(point["queue_share"])
            data[f"{name}@{load}"] = {"rate": rate, "capacity": capacity, **point}
            rows.append([name, f"{int(load * 100)}%", rate, point["queue_share"] * 100, point["exec_share"] * 100,
                         point["per_token_mean"], PAPER[name]])
    report.add_table(f"FCFS latency breakdown, {MODEL} (sim), {n} requests",
                     ["workload", "load", "rate (req/s)", "queueing %", "execution %", "mean s/token", "paper"], rows,
                     "Load = arrival rate / capacity, capacity = 1 / mean(t_init(prompt) + (output-1)·t_dec(B)/B).")
    plots.share_bars(list(WORKLOADS), shares, report.plot_path("queue_share"), "FCFS: queueing share of E2E")
    report.data = data
    report.headline = {f"queue_share_{name}_{int(load * 100)}": data[f"{name}@{load}"]["queue_share"]
                       for name in WORKLOADS for load in LOADS}
    return report.write()
