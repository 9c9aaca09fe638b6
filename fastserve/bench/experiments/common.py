"""Shared machinery of the experiments: workloads, one simulated point, capacity probes, output.

Owns what every figure module repeats: building a seeded workload from a dataset name, running
one simulated point and reducing it to the numbers the tables show (via ``fastserve.bench.metrics``),
estimating a setting's saturation throughput (all jobs at t = 0), and writing a figure's results
(JSON + Markdown under ``results/``, ``quick/`` for ``--quick``) with a readable table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastserve.bench import metrics as M
from fastserve.bench import workloads as W
from fastserve.bench.sim import CostModel, SimOptions, SimResult, SimSetup, simulate

ROOT = Path(__file__).resolve().parents[3]
RESULTS_DIR = ROOT / "results"
QUICK_SUBDIR = "quick"
#: The paper's per-token latency SLO for Figures 11-13 (10x a decode iteration, "0.3 s").
PAPER_SLO_S = 0.3
DEFAULT_SEED = 0
#: A figure that one seed could mislead reads three (Figure 14's overload ranking moved with it).
DEFAULT_NUM_SEEDS = 3
DATASETS = ("sharegpt", "alpaca")
T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class RunOptions:
    """What the CLI passes every experiment."""

    quick: bool = False
    sim_only: bool = False
    real_only: bool = False
    seed: int = DEFAULT_SEED
    out_dir: Path = RESULTS_DIR
    base_url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Arrival seeds a multi-seed figure runs: ``seed`` .. ``seed + num_seeds - 1``.
    num_seeds: int = DEFAULT_NUM_SEEDS
    #: Simulations run at once (processes); 1 = in this process.
    jobs: int = 1

    @property
    def results_dir(self) -> Path:
        return self.out_dir / QUICK_SUBDIR if self.quick else self.out_dir

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.num_seeds))


def dataset_pairs(name: str) -> list[W.LengthPair]:
    if name == "sharegpt":
        return W.load_sharegpt_lengths()
    if name == "alpaca":
        return W.load_alpaca_lengths()
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")


def mean_lengths(pairs: Sequence[W.LengthPair]) -> tuple[float, float]:
    return (sum(p.prompt_len for p in pairs) / len(pairs), sum(p.output_len for p in pairs) / len(pairs))


def point_summary(result: SimResult, slo: float | None = None) -> dict[str, Any]:
    """The numbers a table row needs from one simulated run."""
    s = M.summarize(result.records, slo=slo)
    bd = s.breakdown
    return {
        "completed": s.num_completed, "requests": s.num_requests,
        "per_token_mean": s.per_token.mean, "per_token_p95": s.per_token.p95,
        "per_token_p99": s.per_token.p99, "per_token_max": s.per_token.max,
        "ttft_mean": s.ttft.mean, "e2e_mean": s.e2e.mean,
        "queue_share": bd.queue_share, "exec_share": bd.exec_share, "swap_share": bd.swap_share,
        "slo_attainment": s.slo_attainment,
        "peak_device_blocks": result.kv.peak_device_blocks, "peak_host_blocks": result.kv.peak_host_blocks,
        "swaps_out": result.totals.get("swaps_out", 0), "swaps_in": result.totals.get("swaps_in", 0),
        "recomputes": result.totals.get("recomputes", 0), "steps": result.steps,
        "preemptions": result.totals.get("preemptions", 0),
        "promotions": result.totals.get("promotions", 0),
        "pcie_busy_s": result.busy_pcie_s,
        "makespan_s": result.makespan_s, "wall_s": result.wall_s,
    }


def run_point(requests: Sequence[W.Request], cost: CostModel, setup: SimSetup,
              slo: float | None = None, options: SimOptions | None = None) -> tuple[SimResult, dict[str, Any]]:
    result = simulate(requests, cost, setup, options)
    return result, point_summary(result, slo)


def parallel_map(fn: Callable[[T], U], items: Sequence[T], jobs: int) -> list[U]:
    """``[fn(x) for x in items]``, in ``jobs`` processes when more than one (``fn`` and the
    items must pickle: module-level functions, plain data)."""
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, items))


@dataclass(frozen=True)
class Spread:
    """One figure over several seeds: the mean of the per-seed values, their least and most."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan)
        return cls(sum(finite) / len(finite), min(finite), max(finite))

    def __str__(self) -> str:
        if math.isnan(self.mean):
            return "–"
        if self.low == self.high:
            return fmt(self.mean)
        return f"{fmt(self.mean)} [{fmt(self.low)}–{fmt(self.high)}]"

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "min": self.low, "max": self.high}


def capacity_rate(pairs: Sequence[W.LengthPair], cost: CostModel, batch: int) -> float:
    """Arrival rate at which the accelerator is busy 100 % of the time (load 1.0).

    A job's work is its first iteration plus its share of full decode batches:
    t_init(prompt) + (output − 1) · t_dec(B) / B, in pipeline-stage seconds (÷ PP, as PP stages
    work on different plans at once); capacity = 1 / mean work. Load = rate / capacity.
    """
    profile = cost.profile
    per_token = profile.t_dec(batch) / batch
    work = [profile.t_init(p.prompt_len) + (p.output_len - 1) * per_token for p in pairs]
    return cost.stages * len(work) / sum(work)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, Spread):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Report:
    """One figure's output: Markdown sections, a JSON payload, plots, and the headline numbers."""

    name: str
    options: RunOptions
    sections: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    headline: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)

    def add_table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], note: str = "") -> None:
        text = f"### {title}\n\n{markdown_table(headers, rows)}\n"
        if note:
            text += f"\n{note}\n"
        self.sections.append(text)
        print(f"\n{title}\n{markdown_table(headers, rows)}")
        if note:
            print(note)

    def plot_path(self, suffix: str) -> Path:
        path = self.options.results_dir / f"{self.name}_{suffix}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.plots.append(path.name)
        return path

    def write(self) -> dict[str, Any]:
        out = self.options.results_dir
        out.mkdir(parents=True, exist_ok=True)
        mode = "quick" if self.options.quick else "full"
        md = [f"# {self.name} ({mode} run)\n", *self.sections]
        if self.plots:
            md.append("Plots: " + ", ".join(f"[{p}]({p})" for p in self.plots) + "\n")
        (out / f"{self.name}.md").write_text("\n".join(md), encoding="utf-8")
        payload = {"figure": self.name, "mode": mode, "seed": self.options.seed, "headline": self.headline,
                   "data": self.data, "plots": self.plots}
        (out / f"{self.name}.json").write_text(json.dumps(_jsonable(payload), indent=2) + "\n", encoding="utf-8")
        return {"figure": self.name, "mode": mode, **self.headline}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def jsonable(value: Any) -> Any:
    """NaN/inf to null, keys to strings: what ``json.dumps`` of a headline needs."""
    return _jsonable(value)
