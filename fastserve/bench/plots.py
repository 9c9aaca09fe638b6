"""Plots of the experiments, in the style of the paper's figures (matplotlib, Agg, PNG).

Owns drawing only; every function takes plain numbers and a path:

* ``latency_vs_rate`` — mean per-token latency against arrival rate, one line per system, the SLO
  as a dashed line, one panel per (dataset, model) (Figure 11);
* ``breakdown_bars`` — stacked shares of queueing / execution / swap-blocked time per rate (Fig. 15b);
* ``normalized_latency`` — latency normalized to the slowest policy against the input/output
  ratio, log-x (Figure 14);
* ``kv_over_time`` — KV cache in use (GB) over time, one line per policy (Figure 8);
* ``share_bars`` — grouped bars of one share per workload and load (Figure 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

#: A curve: (x values, y values).
Curve = tuple[Sequence[float], Sequence[float]]
PANEL_SIZE_IN = (4.0, 3.0)
DPI = 120
BREAKDOWN_COLORS = {"queue": "#d62728", "exec": "#1f77b4", "swap": "#2ca02c"}


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def latency_vs_rate(panels: Mapping[str, Mapping[str, Curve]], slo: float | Mapping[str, float], path: Path,
                    ylabel: str = "mean per-token latency (s)") -> Path:
    """``panels``: title -> {system -> (rates, latencies)}; ``slo`` one value or one per panel."""
    n = max(len(panels), 1)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_SIZE_IN[0] * cols, PANEL_SIZE_IN[1] * rows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels.items(), strict=False):
        for label, (xs, ys) in curves.items():
            ax.plot(xs, ys, marker="o", label=label)
        bound = slo if isinstance(slo, int | float) else slo.get(title)
        if bound is not None:
            ax.axhline(bound, color="gray", linestyle="--", label="SLO")
            ax.set_ylim(0, bound * 3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return _save(fig, path)


def breakdown_bars(labels: Sequence[str], shares: Mapping[str, Sequence[float]], path: Path,
                   title: str = "latency breakdown") -> Path:
    """Stacked bars: ``shares`` maps queue/exec/swap to one share per label (fractions of E2E)."""
    fig, ax = plt.subplots(figsize=PANEL_SIZE_IN)
    bottom = [0.0] * len(labels)
    for part, values in shares.items():
        pct = [100.0 * v for v in values]
        ax.bar(labels, pct, bottom=bottom, label=part, color=BREAKDOWN_COLORS.get(part))
        bottom = [b + v for b, v in zip(bottom, pct, strict=True)]
    ax.set_ylabel("% of end-to-end latency")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def normalized_latency(ratios: Sequence[float], curves: Mapping[str, Sequence[float]], path: Path,
                       title: str = "latency normalized to the slowest policy") -> Path:
    fig, ax = plt.subplots(figsize=(PANEL_SIZE_IN[0] * 1.5, PANEL_SIZE_IN[1]))
    for label, values in curves.items():
        ax.plot(ratios, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input / output length ratio")
    ax.set_ylabel("normalized mean per-token latency")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def kv_over_time(curves: Mapping[str, Curve], path: Path, title: str = "KV cache in use") -> Path:
    fig, ax = plt.subplots(figsize=(PANEL_SIZE_IN[0] * 1.5, PANEL_SIZE_IN[1]))
    for label, (xs, ys) in curves.items():
        ax.step(xs, ys, where="post", label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV cache (GB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def share_bars(groups: Sequence[str], series: Mapping[str, Sequence[float]], path: Path,
               title: str = "queueing share of latency") -> Path:
    """Grouped bars: one group per workload, one bar per series (e.g. load), values as fractions."""
    fig, ax = plt.subplots(figsize=(PANEL_SIZE_IN[0] * 1.5, PANEL_SIZE_IN[1]))
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(groups))]
        ax.bar(xs, [100.0 * v for v in values], width=width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax.set_ylabel("% of end-to-end latency")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)
