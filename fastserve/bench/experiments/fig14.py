"""Figure 14: scheduling policies across the input/output length ratio, normalized to FCFS.

Simulated OPT-13B on one A100. For each ratio r in 0.25 .. 256 the workload keeps ShareGPT's
job-size distribution but moves its balance: prompt and output lengths are drawn *independently*
from ShareGPT's prompt and output distributions and scaled so that mean prompt / mean output = r
at ShareGPT's mean total length (so input length says nothing about output length, as in the
paper, where fixed priority is not SRPT). Arrivals are Poisson at each of ``LOADS`` x capacity
(``capacity_rate``; the paper does not state its rate): 0.9, a stable load, and 1.2, an overload.
Reported: mean per-token latency of each policy divided by FCFS's at that ratio (the paper's
Figure 14 has FCFS at 1.0; our naive MLFQ, which loses cut first iterations, is slower still),
and skip-join ÷ the SRPT oracle (how close to the optimum). Also skip-join MLFQ without
starvation promotion (α = ∞), which isolates the skip-join rule from α, and naive MLFQ that runs
a first iteration whole (the variant we had; ``naive_mlfq`` itself cuts it at the quantum and
loses the work, the paper's Figure 7(b) baseline). Paper: FCFS 1.0; skip-join 0.11
(r = 0.25) → 0.07 (r = 256); naive MLFQ ≈ 0.45–0.5 at 256; fixed priority ≈ 0.70 at 0.25 → 0.10.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import Report, RunOptions, capacity_rate, dataset_pairs, run_point
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimSetup

MODEL = "opt-13b"
#: A stable load and an overload, as fractions of the capacity ``capacity_rate`` measures.
LOADS = (0.9, 1.2)
BATCH = 16
POLICIES = ("fcfs", "naive_mlfq", "fixed_priority", "skip_join_mlfq", "srpt_oracle")
NO_STARVATION = "skip_join_mlfq (α=∞)"
NO_STARVATION_ALPHA_S = 1e9
NAIVE_WHOLE = "naive_mlfq (first iteration whole)"
SETUPS: dict[str, SimSetup] = {
    **{p: SimSetup(policy=p, max_batch_size=BATCH) for p in POLICIES},
    NO_STARVATION: SimSetup(policy="skip_join_mlfq", max_batch_size=BATCH, starvation_alpha_s=NO_STARVATION_ALPHA_S),
    NAIVE_WHOLE: SimSetup(policy="naive_mlfq", max_batch_size=BATCH, naive_preempts_first_iteration=False),
}
RATIOS = {True: (0.25, 1.0, 4.0, 16.0, 64.0, 256.0), False: W.FIG14_RATIOS}
NUM_REQUESTS = {True: 150, False: 400}
MAX_TOTAL = W.FASTSERVE_MAX_TOTAL_LEN
PAPER = {"fcfs": "1.0", "naive_mlfq": "≈0.45–0.5 @256", "fixed_priority": "≈0.70 @0.25 → ≈0.10 @256",
         "skip_join_mlfq": "≈0.11 @0.25 → ≈0.07 @256", "srpt_oracle": "–", NO_STARVATION: "–", NAIVE_WHOLE: "–"}


def independent_ratio_pairs(source: list[W.LengthPair], ratio: float, n: int, seed: int) -> list[W.LengthPair]:
    """Prompts and outputs sampled independently, rescaled to mean ratio ``ratio`` at the source's
    mean total length; clipped to OPT's 2,048-token window (each at least one token)."""
    prompts = np.array([p.prompt_len for p in W.sample_pairs(source, n, seed)], dtype=float)
    outputs = np.array([p.output_len for p in W.sample_pairs(source, n, seed + 1)], dtype=float)
    total = prompts.mean() + outputs.mean()
    prompts *= total * ratio / (1.0 + ratio) / prompts.mean()
    outputs *= total / (1.0 + ratio) / outputs.mean()
    pairs = []
    for p, o in zip(prompts, outputs, strict=True):
        prompt = int(min(max(round(p), 1), MAX_TOTAL - 1))
        pairs.append(W.LengthPair(prompt, int(min(max(round(o), 1), MAX_TOTAL - prompt))))
    return pairs


def _sweep(load: float, ratios: tuple[float, ...], n: int, cost: CostModel, source: list[W.LengthPair],
           seed: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Mean per-token latency of every setup at every ratio, at ``load`` x capacity."""
    latency: dict[str, list[float]] = {name: [] for name in SETUPS}
    data = {}
    for ratio in ratios:
        pairs = independent_ratio_pairs(source, ratio, n, seed)
        rate = load * capacity_rate(pairs, cost, BATCH)
        requests = W.build_requests(pairs, W.poisson_arrivals(n, rate, seed))
        points = {name: run_point(requests, cost, setup)[1] for name, setup in SETUPS.items()}
        for name, point in points.items():
            latency[name].append(point["per_token_mean"])
        data[str(ratio)] = {"rate": rate, "points": points}
    return latency, data


def run(options: RunOptions) -> dict[str, Any]:
    report = Report("fig14", options)
    cost = CostModel.from_json(PAPER_PROFILES[MODEL])
    source = dataset_pairs("sharegpt")
    n, ratios = NUM_REQUESTS[options.quick], RATIOS[options.quick]
    headline: dict[str, Any] = {"paper_max_speedup_over": {"fcfs": 8.9, "naive_mlfq": 1.87, "fixed_priority": 13.9}}
    report.data = {"ratios": list(ratios), "loads": {}}
    for load in LOADS:
        latency, data = _sweep(load, ratios, n, cost, source, options.seed)
        normalized = {name: [v / latency["fcfs"][i] for i, v in enumerate(vals)] for name, vals in latency.items()}
        vs_srpt = [a / b for a, b in zip(latency["skip_join_mlfq"], latency["srpt_oracle"], strict=True)]
        rows = [[name, *normalized[name], PAPER[name]] for name in SETUPS]
        rows.append(["skip-join ÷ SRPT oracle", *vs_srpt, "–"])
        report.add_table(f"Load {load}: mean per-token latency normalized to FCFS's (the paper's 1.0), "
                         f"{MODEL} (sim), {n} requests per ratio", ["policy", *[f"r={r:g}" for r in ratios], "paper"],
                         rows, "Absolute latencies and rates are in fig14.json.")
        plots.normalized_latency(list(ratios), normalized, report.plot_path(f"normalized_load{load:g}"),
                                 f"{MODEL} (sim), load {load}: latency / FCFS")
        report.data["loads"][str(load)] = {"normalized": normalized, "mean_per_token": latency, "runs": data}
        speedup = {m: max(a / b for a, b in zip(latency[m], latency["skip_join_mlfq"], strict=True))
                   for m in ("fcfs", "naive_mlfq", "fixed_priority", NAIVE_WHOLE)}
        headline[f"load_{load:g}"] = {"normalized_skip_join": normalized["skip_join_mlfq"],
                                      "skip_join_over_srpt": vs_srpt,
                                      "max_speedup_of_skip_join_over": speedup}
    report.headline = headline
    return report.write()
