"""Figure 11's simulator point for skip-join MLFQ with and without chunked prefill.

The same sweep as ``fig11`` (paper profiles, Poisson rates as fractions of each setting's
capacity, mean per-token latency against the paper's 0.3 s SLO), for skip-join MLFQ with first
iterations run whole (the paper) and split into chunks of ``--chunk-tokens`` tokens
(``scheduler.chunked_prefill``), priced by the same cost model (a chunk costs ``t_init`` of its
tokens). ``--quick`` runs OPT-13B on ShareGPT only, with fig11's quick grid.
"""

from __future__ import annotations

from typing import Any

from fastserve.bench.experiments import fig11
from fastserve.bench.experiments.common import DATASETS, PAPER_SLO_S, Report, RunOptions
from fastserve.bench.sim import PAPER_PROFILES, SimSetup

DEFAULT_CHUNK_TOKENS = 512
WHOLE, CHUNKED = "skip_join", "skip_join_chunked"


def settings(options: RunOptions) -> list[tuple[str, str]]:
    if options.quick:
        return [("opt-13b", "sharegpt")]
    return [(model, dataset) for dataset in DATASETS for model in PAPER_PROFILES]


def run(options: RunOptions) -> dict[str, Any]:
    chunk = int(options.extra.get("chunk_tokens") or DEFAULT_CHUNK_TOKENS)
    setups = {WHOLE: SimSetup(), CHUNKED: SimSetup(chunk_tokens=chunk)}
    report = Report("fig11_chunked", options)
    rows, data, headline = [], {}, {}
    for model, dataset in settings(options):
        res = fig11.sweep(model, dataset, options, setups)
        whole, chunked = (res[k]["throughput_at_slo"] for k in (WHOLE, CHUNKED))
        ratio = chunked["rate"] / whole["rate"] if whole["rate"] > 0 else float("nan")
        key = f"{model}/{dataset}"
        data[key] = res
        headline[key] = {WHOLE: whole["rate"], CHUNKED: chunked["rate"]}
        rows.append([model, dataset, whole["rate"], whole["status"], chunked["rate"],
                     chunked["status"], ratio])
    n = fig11.NUM_REQUESTS[options.quick]
    report.add_table(
        f"Skip-join throughput at the {PAPER_SLO_S} s/token SLO (mean), simulator, {n} requests "
        f"per point: first iterations whole vs chunks of {chunk} tokens",
        ["model", "dataset", "whole req/s", "", f"chunked ({chunk}) req/s", "", "ratio"], rows,
        "Status 'lower_bound': every measured rate met the SLO; 'none_under': none did.")
    report.data = {"sim": data, "chunk_tokens": chunk}
    report.headline = {"chunk_tokens": chunk, "throughput_at_slo": headline}
    return report.write()
