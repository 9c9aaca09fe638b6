"""Figure 11: skip-join MLFQ vs FCFS throughput at the SLO, ShareGPT and Alpaca.

Simulated at the paper's three scales (OPT-13B on 1 A100, OPT-66B on 4 as TP 4, OPT-175B on 16 as
TP 8 x PP 2; profiles in config/profiles/, derivation in fastserve/bench/sim/ASSUMPTIONS.md): a Poisson
rate sweep per (model, dataset, policy), mean per-token latency at each rate, and
``throughput_at_slo`` — the highest rate whose mean stays under the paper's 0.3 s SLO,
interpolated. Rates are fractions of each setting's capacity (``capacity_rate``) so one grid
brackets both policies everywhere. Without ``--sim`` the same comparison also runs for real over
HTTP against the demo server on this machine (``fig11_real``).
Paper (FastServe vs FastServe-FCFS): 13B ShareGPT ≈4.0–4.5 vs ≈2.5 req/s; 66B ≈5.0–5.5 (1.4–1.8x);
175B ≈6.0–6.5 vs ≈4.5; Alpaca 13B ≈35–40 vs ≈25.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from fastserve.bench import metrics as M
from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import (
    DATASETS,
    PAPER_SLO_S,
    Report,
    RunOptions,
    capacity_rate,
    dataset_pairs,
    run_point,
)
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimSetup
from fastserve.scheduler.config import PolicyName

POLICIES = ("fcfs", "skip_join_mlfq")
LOAD_GRID = {True: (0.6, 1.2, 2.0, 3.0), False: (0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.7, 2.0, 2.5, 3.0)}
NUM_REQUESTS = {True: 80, False: 500}
PAPER = {  # (FCFS, FastServe) req/s at the SLO, as read from Figure 11 in the paper notes
    ("opt-13b", "sharegpt"): "2.5 / 4.0–4.5", ("opt-66b", "sharegpt"): "– / 5.0–5.5 (1.4–1.8x)",
    ("opt-175b", "sharegpt"): "4.5 / 6.0–6.5", ("opt-13b", "alpaca"): "25 / 35–40",
    ("opt-66b", "alpaca"): "– (1.5–2.0x vs vLLM)", ("opt-175b", "alpaca"): "–",
}


def sweep(model: str, dataset: str, options: RunOptions,
          setups: Mapping[str, SimSetup] | None = None) -> dict[str, Any]:
    """Mean per-token latency over the rate grid and throughput at the SLO, for each of
    ``setups`` (label -> setup; default: FCFS and skip-join, keyed by policy)."""
    setups = setups or {policy: SimSetup(policy=cast(PolicyName, policy)) for policy in POLICIES}
    cost = CostModel.from_json(PAPER_PROFILES[model])
    pairs = dataset_pairs(dataset)
    batch = cost.serving.max_batch_size or SimSetup().max_batch_size or 1
    capacity = capacity_rate(pairs, cost, batch)
    rates = [round(f * capacity, 3) for f in LOAD_GRID[options.quick]]
    n = NUM_REQUESTS[options.quick]
    out: dict[str, Any] = {"capacity": capacity, "rates": rates}
    for policy, setup in setups.items():
        points = [run_point(W.workload(pairs, n, rate, options.seed), cost, setup, PAPER_SLO_S)[1]
                  for rate in rates]
        means = [p["per_token_mean"] for p in points]
        out[policy] = {"per_token_mean": means, "per_token_p95": [p["per_token_p95"] for p in points],
                       "throughput_at_slo": M.throughput_at_slo(rates, means, PAPER_SLO_S).to_dict()}
    return out


def run_sim(options: RunOptions) -> dict[str, Any]:
    report = Report("fig11", options)
    rows, panels, data, gains = [], {}, {}, {}
    for dataset in DATASETS:
        for model in PAPER_PROFILES:
            res = sweep(model, dataset, options)
            fcfs, sj = (res[p]["throughput_at_slo"] for p in POLICIES)
            gain = sj["rate"] / fcfs["rate"] if fcfs["rate"] > 0 else float("nan")
            key = f"{model}/{dataset}"
            data[key], gains[key] = res, gain
            rows.append([model, dataset, fcfs["rate"], fcfs["status"], sj["rate"], sj["status"], gain,
                         PAPER[(model, dataset)]])
            panels[f"{model} {dataset} (sim)"] = {p: (res["rates"], res[p]["per_token_mean"]) for p in POLICIES}
    n = NUM_REQUESTS[options.quick]
    report.add_table(f"Throughput at the {PAPER_SLO_S} s/token SLO (mean), simulator, {n} requests per point",
                     ["model", "dataset", "FCFS req/s", "", "skip-join req/s", "", "gain", "paper FCFS / FastServe"],
                     rows, "Status 'lower_bound': every measured rate met the SLO; 'none_under': none did.")
    plots.latency_vs_rate(panels, PAPER_SLO_S, report.plot_path("sim"))
    report.data = {"sim": data}
    report.headline = {"sim_gain": gains,
                       "sim_throughput": {k: {p: v[p]["throughput_at_slo"]["rate"] for p in POLICIES}
                                          for k, v in data.items()}}
    return report.write()


def run(options: RunOptions) -> dict[str, Any]:
    """The simulator sweep (unless ``real_only``), then the HTTP runs (unless ``sim_only``);
    they write fig11.{md,json} and fig11_real.{md,json} respectively."""
    headline: dict[str, Any] = {"figure": "fig11", "mode": "quick" if options.quick else "full"}
    if not options.real_only:
        headline["sim"] = {k: v for k, v in run_sim(options).items() if k not in headline}
    if not options.sim_only:
        from fastserve.bench.experiments import fig11_real

        headline["real"] = {k: v for k, v in fig11_real.run(options).items() if k not in headline}
    return headline
