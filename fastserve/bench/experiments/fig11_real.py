"""Figure 11 for real: skip-join MLFQ vs FCFS over HTTP against our server on this machine.

One ``serve run`` app per policy (or ``--base-url``), ShareGPT and Alpaca with Poisson arrivals at
fractions of the CPU profile's capacity, lengths scaled by ``LENGTH_SCALE`` (full ShareGPT takes
minutes a request on two cores), throughput at an SLO of 10× the profiled decode iteration (the
paper's rule), beside the simulator's prediction.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from fastserve.bench import metrics as M
from fastserve.bench import plots
from fastserve.bench import workloads as W
from fastserve.bench.client import ClientConfig, run_requests
from fastserve.bench.experiments.common import DATASETS, Report, RunOptions, capacity_rate, dataset_pairs
from fastserve.bench.experiments.server import ServeApps
from fastserve.bench.sim import CPU_PROFILE, CostModel, SimSetup, simulate

POLICIES = ("fcfs", "skip_join_mlfq")
EXTERNAL = "external"
SLO_DECODE_MULTIPLE = 10.0
LENGTH_SCALE = {True: 1 / 16, False: 1 / 4}
#: Dense where both policies cross the SLO: the real server runs below the profile's capacity.
LOAD_GRID = {(True, "sharegpt"): (0.6, 1.4), (True, "alpaca"): (0.6, 1.4),
             (False, "sharegpt"): (0.2, 0.35, 0.5, 0.65, 0.8, 1.0), (False, "alpaca"): (0.4, 0.8, 1.2, 1.6, 2.0)}
NUM_REQUESTS = {True: 8, False: 60}
BATCH = 16
#: The paper's setting: every request admitted (the policy decides latency, not a 429), batch 16.
ADMIT_ALL = {"engine": {"max_jobs": 100_000},
             "scheduler": {"admission_queue_limit": 100_000, "max_batch_size": BATCH}}
#: A point may run this much longer than its arrivals span (plus its longest request at
#: ``TIMEOUT_SLO_MULTIPLE`` x the SLO per token) before it is cut short; cut requests count as failed.
POINT_SLACK_S = 60.0
TIMEOUT_SLO_MULTIPLE = 3.0
#: Our server returns the generated ids per chunk: exact token counts per streamed chunk.
EXTRA_BODY = {"return_token_ids": True}
#: The demo config's pools (config/opt125m-dummy.yaml), for the simulator's prediction of each real point.
DEMO_DEVICE_BLOCKS = 256
DEMO_HOST_BLOCKS = 512


def _scaled_pairs(dataset: str, scale: float) -> list[W.LengthPair]:
    return [W.LengthPair(max(1, round(p.prompt_len * scale)), max(1, round(p.output_len * scale)))
            for p in dataset_pairs(dataset)]


def _point(base_url: str, requests: list[W.Request], slo: float, seed: int) -> list[dict[str, Any]]:
    span = requests[-1].arrival_s if requests else 0.0
    longest = max((r.output_len for r in requests), default=0)
    bound = span + POINT_SLACK_S + TIMEOUT_SLO_MULTIPLE * slo * longest
    config = ClientConfig(base_url=base_url, max_total_s=bound, seed=seed, extra_body=EXTRA_BODY, progress=False)
    return asyncio.run(run_requests(requests, config))


def _mean_or_nan(records: list[dict[str, Any]]) -> float:
    """Mean per-token latency; NaN (counts as over the SLO) when any request failed or timed out."""
    recs = [M.RequestRecord.from_dict(r) for r in records]
    if not recs or not all(r.ok for r in recs):
        return math.nan
    return M.summarize(recs).per_token.mean


def _sim_prediction(requests: list[W.Request], policy: str) -> float:
    """What the simulator, with this machine's profile and the demo's pools, predicts for a point."""
    setup = SimSetup(policy=policy, max_batch_size=BATCH, num_device_blocks=DEMO_DEVICE_BLOCKS,  # type: ignore[arg-type]
                     num_host_blocks=DEMO_HOST_BLOCKS)
    return M.summarize(simulate(requests, CostModel.from_json(CPU_PROFILE), setup).records).per_token.mean


def _sweeps(urls: dict[str, str], options: RunOptions, slo: float, log: Path) -> dict[str, Any]:
    cost = CostModel.from_json(CPU_PROFILE)
    scale = LENGTH_SCALE[options.quick]
    n = NUM_REQUESTS[options.quick]
    out: dict[str, Any] = {}
    with log.open("w", encoding="utf-8") as sink:
        for dataset in DATASETS:
            pairs = _scaled_pairs(dataset, scale)
            capacity = capacity_rate(pairs, cost, BATCH)
            rates = [round(f * capacity, 3) for f in LOAD_GRID[(options.quick, dataset)]]
            out[dataset] = {"capacity": capacity, "rates": rates}
            # Policies alternate at each rate, so drift on a shared machine hits both alike.
            series: dict[str, dict[str, list[Any]]] = {
                label: {"per_token_mean": [], "breakdown": [], "sim_per_token_mean": []} for label in urls}
            for rate in rates:
                requests = W.workload(pairs, n, rate, options.seed)
                for label, url in urls.items():
                    records = _point(url, requests, slo, options.seed)
                    row = series[label]
                    if label in POLICIES:
                        row["sim_per_token_mean"].append(_sim_prediction(requests, label))
                    for rec in records:
                        sink.write(json.dumps({"policy": label, "dataset": dataset, "rate": rate, **rec}) + "\n")
                    row["per_token_mean"].append(_mean_or_nan(records))
                    bd = M.latency_breakdown([M.RequestRecord.from_dict(r) for r in records])
                    row["breakdown"].append({"queue": bd.queue_share, "exec": bd.exec_share, "swap": bd.swap_share})
                    print(f"  real {label} {dataset} {rate:.2f} req/s: mean {row['per_token_mean'][-1]:.3f} s/token",
                          flush=True)
            for label, row in series.items():
                out[dataset][label] = {**row, "throughput_at_slo":
                                       M.throughput_at_slo(rates, row["per_token_mean"], slo).to_dict()}
    return out


def run(options: RunOptions) -> dict[str, Any]:
    """Runs the sweeps, writes fig11_real.{md,json} and its plot; returns the headline numbers."""
    report = Report("fig11_real", options)
    slo = SLO_DECODE_MULTIPLE * CostModel.from_json(CPU_PROFILE).profile.q1
    results_dir = options.results_dir
    log = results_dir / "fig11_real_records.jsonl"
    if options.base_url is not None:
        data = _sweeps({EXTERNAL: options.base_url}, options, slo, log)
        labels: tuple[str, ...] = (EXTERNAL,)
    else:
        with ServeApps(POLICIES, results_dir / "fig11_real_serve.log", args_overrides=ADMIT_ALL) as apps:
            data = _sweeps({p: apps.url(p) for p in POLICIES}, options, slo, log)
        labels = POLICIES
    scale, n = LENGTH_SCALE[options.quick], NUM_REQUESTS[options.quick]
    rows, panels, headline = [], {}, {}
    for dataset in DATASETS:
        d = data[dataset]
        tput = {p: d[p]["throughput_at_slo"] for p in labels}
        gain = (tput["skip_join_mlfq"]["rate"] / tput["fcfs"]["rate"]
                if set(POLICIES) <= set(tput) and tput["fcfs"]["rate"] > 0 else math.nan)
        rows.append([dataset, *[f"{tput[p]['rate']:.2f} ({tput[p]['status']})" for p in labels], gain,
                     ", ".join(f"{r:.2f}" for r in d["rates"])])
        panels[f"opt-125m CPU {dataset} (real, lengths x{scale:g})"] = {p: (d["rates"], d[p]["per_token_mean"])
                                                                          for p in labels}
        headline[dataset] = {"throughput": {p: tput[p]["rate"] for p in labels}, "gain": gain}
    if labels == POLICIES:
        report.add_table("Real vs simulated (this machine's profile, demo pools): mean per-token latency (s)",
                         ["dataset", "policy", "rate", "real", "sim"],
                         [[d, p, r, real, sim] for d in DATASETS for p in POLICIES
                          for r, real, sim in zip(data[d]["rates"], data[d][p]["per_token_mean"],
                                                  data[d][p]["sim_per_token_mean"], strict=True)])
    report.add_table(f"Real over HTTP: throughput at SLO {slo:.3f} s/token (10x t_dec(1) = {slo / 10:.3f} s), "
                     f"OPT-125M dummy weights on this CPU, {n} requests per point, lengths scaled x{scale:g}",
                     ["dataset", *[f"{p} req/s" for p in labels], "gain", "rates (req/s)"], rows,
                     "Per-point records: fig11_real_records.jsonl. The machine is shared; timings are noisy.")
    plots.latency_vs_rate(panels, slo, report.plot_path("latency"))
    report.data = {"slo": slo, "length_scale": scale, **data}
    report.headline = {"slo": slo, "length_scale": scale, **headline}
    return report.write()
