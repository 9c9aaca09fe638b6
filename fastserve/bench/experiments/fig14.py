"""Figure 14: scheduling policies across the input/output length ratio, normalized to FCFS.

Simulated OPT-13B on one A100. Per ratio r in 0.25 .. 256, prompt and output lengths are drawn
independently from ShareGPT's and scaled to mean ratio r at its mean total (so input length says
nothing of output length, as in the paper); Poisson arrivals at ``LOADS`` × capacity; ``--seeds``
seeds, each cell the mean [least–most]. The naive MLFQ is the paper's Figure 14 baseline (first
iteration run whole); ablations: no starvation promotion, and the paper's fixed α. Results and the
paper's values: docs/paper.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.experiments.common import (
    Report,
    RunOptions,
    Spread,
    capacity_rate,
    dataset_pairs,
    parallel_map,
    run_point,
)
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimSetup

MODEL = "opt-13b"
#: A stable load and an overload, as fractions of the capacity ``capacity_rate`` measures.
LOADS = (0.9, 1.2)
BATCH = 16
NAIVE = "naive_mlfq"
NO_STARVATION = "skip_join_mlfq (α=∞)"
NO_STARVATION_ALPHA_S = 1e9
FIXED_ALPHA = "skip_join_mlfq (paper's fixed α)"
#: The paper's α: 300 ms, not floored at decode iterations or backlog rounds, no backoff.
PAPER_ALPHA = {"starvation_min_iterations": 0.0, "starvation_backlog_batches": 0.0,
               "starvation_backoff": 1.0}
SETUPS: dict[str, SimSetup] = {
    "fcfs": SimSetup(policy="fcfs", max_batch_size=BATCH),
    NAIVE: SimSetup(policy="naive_mlfq", max_batch_size=BATCH, naive_preempts_first_iteration=False),
    "fixed_priority": SimSetup(policy="fixed_priority", max_batch_size=BATCH),
    "skip_join_mlfq": SimSetup(policy="skip_join_mlfq", max_batch_size=BATCH),
    "srpt_oracle": SimSetup(policy="srpt_oracle", max_batch_size=BATCH),
    NO_STARVATION: SimSetup(policy="skip_join_mlfq", max_batch_size=BATCH, starvation_alpha_s=NO_STARVATION_ALPHA_S),
    FIXED_ALPHA: SimSetup(policy="skip_join_mlfq", max_batch_size=BATCH, starvation_alpha_s=0.3,
                          scheduler_options=PAPER_ALPHA),
}
RATIOS = {True: (0.25, 4.0, 64.0), False: (0.25, 1.0, 4.0, 16.0, 64.0, 256.0)}
NUM_REQUESTS = {True: 150, False: 400}
MAX_TOTAL = W.FASTSERVE_MAX_TOTAL_LEN
PAPER = {"fcfs": "1.0", NAIVE: "≈0.45–0.5 @256", "fixed_priority": "≈0.70 @0.25 → ≈0.10 @256",
         "skip_join_mlfq": "≈0.11 @0.25 → ≈0.07 @256", "srpt_oracle": "–", NO_STARVATION: "–", FIXED_ALPHA: "–"}
#: The per-token statistics each table normalizes to FCFS's.
STATS = {"mean": "per_token_mean", "P99": "per_token_p99", "max": "per_token_max"}


def independent_ratio_pairs(source: list[W.LengthPair], ratio: float, n: int, seed: int) -> list[W.LengthPair]:
    """Clipped to OPT's 2,048-token window, each at least one token."""
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


def simulate_point(task: tuple[float, float, int, int, str]) -> dict[str, Any]:
    load, ratio, seed, n, name = task
    cost = CostModel.from_json(PAPER_PROFILES[MODEL])
    pairs = independent_ratio_pairs(dataset_pairs("sharegpt"), ratio, n, seed)
    rate = load * capacity_rate(pairs, cost, BATCH)
    requests = W.build_requests(pairs, W.poisson_arrivals(n, rate, seed))
    point = run_point(requests, cost, SETUPS[name])[1]
    return {**point, "rate": rate}


def _ratio_rows(points: dict[tuple[float, int, str], dict[str, Any]], ratios: Sequence[float],
                seeds: Sequence[int], key: str, setups: Sequence[str]) -> dict[str, list[Spread]]:
    """Each setup's ``key`` ÷ FCFS's at every ratio, spread over seeds (one load's points)."""
    return {name: [Spread.of([points[(r, s, name)][key] / points[(r, s, "fcfs")][key] for s in seeds])
                   for r in ratios] for name in setups}


def _pair_row(points: dict[tuple[float, int, str], dict[str, Any]], ratios: Sequence[float],
              seeds: Sequence[int], a: str, b: str) -> list[Spread]:
    return [Spread.of([points[(r, s, a)]["per_token_mean"] / points[(r, s, b)]["per_token_mean"]
                       for s in seeds]) for r in ratios]


def run(options: RunOptions) -> dict[str, Any]:
    report = Report("fig14", options)
    n = options.extra.get("requests") or NUM_REQUESTS[options.quick]
    ratios = options.extra.get("points") or RATIOS[options.quick]
    seeds = options.seeds
    setups = [name for name in SETUPS if name not in options.extra.get("skip", ())]
    missing = {"fcfs", "skip_join_mlfq", "srpt_oracle", "fixed_priority"} - set(setups)
    if missing:
        raise ValueError(f"--skip: the tables need {sorted(missing)}")
    tasks = [(load, r, s, n, name) for load in LOADS for r in ratios for s in seeds for name in setups]
    results = dict(zip(tasks, parallel_map(simulate_point, tasks, options.jobs), strict=True))
    headline: dict[str, Any] = {"seeds": seeds,
                                "paper_max_speedup_over": {"fcfs": 8.9, "naive_mlfq": 1.87, "fixed_priority": 13.9}}
    report.data = {"ratios": list(ratios), "seeds": seeds, "loads": {}}
    columns = [f"r={r:g}" for r in ratios]
    for load in LOADS:
        points = {(r, s, name): results[(load, r, s, n, name)] for r in ratios for s in seeds for name in setups}
        tables = {stat: _ratio_rows(points, ratios, seeds, key, setups) for stat, key in STATS.items()}
        vs_srpt = _pair_row(points, ratios, seeds, "skip_join_mlfq", "srpt_oracle")
        fixed_vs_ours = _pair_row(points, ratios, seeds, "fixed_priority", "skip_join_mlfq")
        for stat, rows in tables.items():
            body = [[name, *rows[name], PAPER[name] if stat == "mean" else "–"] for name in setups]
            if stat == "mean":
                body += [["skip-join ÷ SRPT oracle", *vs_srpt, "–"],
                         ["fixed priority ÷ skip-join", *fixed_vs_ours, "–"]]
            report.add_table(f"Load {load}: {stat} per-token latency ÷ FCFS's {stat}, {MODEL} (sim), {n} requests "
                             f"per ratio, mean over seeds {seeds} [least–most]", ["policy", *columns, "paper"], body,
                             "Absolute latencies, rates and swap counts per seed are in fig14.json." if stat == "mean"
                             else "")
        normalized = {name: [x.mean for x in spreads] for name, spreads in tables["mean"].items()}
        plots.normalized_latency(list(ratios), normalized, report.plot_path(f"normalized_load{load:g}"),
                                 f"{MODEL} (sim), load {load}: latency / FCFS (mean of {len(seeds)} seeds)")
        report.data["loads"][str(load)] = {
            "normalized": {stat: {name: [x.to_dict() for x in v] for name, v in rows.items()}
                           for stat, rows in tables.items()},
            "skip_join_over_srpt": [x.to_dict() for x in vs_srpt],
            "fixed_priority_over_skip_join": [x.to_dict() for x in fixed_vs_ours],
            "runs": {f"r={r:g}/seed={s}/{name}": p for (r, s, name), p in points.items()}}
        headline[f"load_{load:g}"] = {
            "normalized_skip_join": [x.to_dict() for x in tables["mean"]["skip_join_mlfq"]],
            "skip_join_over_srpt": [x.to_dict() for x in vs_srpt],
            "fixed_priority_over_skip_join": [x.to_dict() for x in fixed_vs_ours]}
    report.headline = headline
    return report.write()
