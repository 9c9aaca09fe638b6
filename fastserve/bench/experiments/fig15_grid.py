"""Figure 15a over a grid: how much proactive swapping buys against reactive, and where.

Figure 15's setting (simulated OPT-13B on one A100, skip-join MLFQ with our α, ShareGPT, Poisson
arrivals at a load × capacity) over device pools ``POOLS`` on the paper's link, and over link speeds
(swap time × ``LINK_FACTORS``) at ``fig15.DEVICE_BLOCKS``. Each cell: reactive ÷ proactive mean
per-token latency, mean [least–most] over the seeds, beside proactive ÷ a pool no job outgrows (how
hard memory binds; ≤ ``fig15.NEAR_BOUND`` is below saturation), evictions a job and the link's busy
share. Reactive can lose only what it waits on, so the ratio follows swap traffic per unit of compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastserve.bench.experiments import fig15
from fastserve.bench.experiments.common import Report, RunOptions, Spread, parallel_map
from fastserve.bench.sim import SimSetup
from fastserve.scheduler.config import SwapMode

POOLS = {True: (200,), False: (100, 150, 200, 300)}
LOADS = {True: (0.5, 0.9), False: (0.3, 0.5, 0.7, 0.9)}
#: Swap time multipliers: the paper's link (one PCIe 4.0 x16 direction), then 2x and 4x slower.
LINK_FACTORS = {True: (1.0,), False: (1.0, 2.0, 4.0)}
NUM_REQUESTS = {True: 120, False: 300}
MODES: tuple[SwapMode, ...] = ("proactive", "reactive")
#: Proactive in a pool no job outgrows: the latency without memory pressure.
BOUND = "bound"

Task = tuple[int, float, float, int, int, str]   # pool, link factor, load, seed, requests, mode


def simulate(task: Task) -> dict[str, Any]:
    pool, link, load, seed, n, mode = task
    if mode == BOUND:
        setup = SimSetup(swap_mode="proactive", num_device_blocks=fig15.UNLIMITED_BLOCKS)
    else:
        assert mode in MODES, mode
        setup = SimSetup(swap_mode=mode, num_device_blocks=pool)
    return fig15.simulate(load, seed, n, setup, swap_time_factor=link)


def _tasks(pools: tuple[int, ...], links: tuple[float, ...], loads: tuple[float, ...],
           seeds: list[int], n: int) -> list[Task]:
    cells = {(pool, 1.0) for pool in pools} | {(fig15.DEVICE_BLOCKS, link) for link in links}
    tasks = [(pool, link, load, s, n, mode) for pool, link in sorted(cells) for load in loads
             for s in seeds for mode in MODES]
    # No swaps in the bound: one run per load and seed serves every pool and link.
    return tasks + [(0, 1.0, load, s, n, BOUND) for load in loads for s in seeds]


def _cell(points: dict[Task, dict[str, Any]], pool: int, link: float, load: float, seeds: list[int],
          n: int) -> dict[str, Spread]:
    def get(mode: str, s: int) -> dict[str, Any]:
        return points[(pool, link, load, s, n, mode)] if mode != BOUND else points[(0, 1.0, load, s, n, BOUND)]

    def over(fn: Callable[[int], float]) -> Spread:
        return Spread.of([fn(s) for s in seeds])

    return {
        "reactive_over_proactive": over(lambda s: get("reactive", s)["per_token_mean"]
                                        / get("proactive", s)["per_token_mean"]),
        "proactive_over_bound": over(lambda s: get("proactive", s)["per_token_mean"]
                                     / get(BOUND, s)["per_token_mean"]),
        "evictions_per_job": over(lambda s: get("proactive", s)["evictions_per_job"]),
        "pcie_share_reactive": over(lambda s: get("reactive", s)["pcie_share"]),
    }


def run(options: RunOptions) -> dict[str, Any]:
    report = Report("fig15_grid", options)
    q = options.quick
    n = options.extra.get("requests") or NUM_REQUESTS[q]
    loads = options.extra.get("points") or LOADS[q]
    pools, links, seeds = POOLS[q], LINK_FACTORS[q], options.seeds
    tasks = _tasks(pools, links, loads, seeds, n)
    points = dict(zip(tasks, parallel_map(simulate, tasks, options.jobs), strict=True))
    cap = fig15.capacity()
    columns = [f"{load:g} ({load * cap:.2f} req/s)" for load in loads]
    cells = {(pool, link, load): _cell(points, pool, link, load, seeds, n)
             for pool, link, load, *_ in tasks if pool}
    what = (("reactive ÷ proactive", "reactive_over_proactive"), ("proactive ÷ bound", "proactive_over_bound"),
            ("evictions a job (proactive)", "evictions_per_job"), ("link busy share (reactive)", "pcie_share_reactive"))
    title = f"{fig15.MODEL} (sim), skip-join MLFQ with our α, {n} ShareGPT requests, seeds {seeds}"
    report.add_table(f"Device pools on the paper's link: {title}", ["pool (blocks)", "what", *columns],
                     [[pool, label, *(cells[(pool, 1.0, load)][key] for load in loads)]
                      for pool in pools for label, key in what])
    report.add_table(f"Link speed at {fig15.DEVICE_BLOCKS} blocks (swap time × factor): {title}",
                     ["link factor", "what", *columns],
                     [[f"×{link:g}", label, *(cells[(fig15.DEVICE_BLOCKS, link, load)][key] for load in loads)]
                      for link in links for label, key in what],
                     f"Below saturation: proactive ÷ bound ≤ {fig15.NEAR_BOUND:g}.")
    below = {k: c for k, c in cells.items() if c["proactive_over_bound"].mean <= fig15.NEAR_BOUND}
    best = {link: max((c["reactive_over_proactive"].mean for (_, lk, _), c in below.items() if lk == link),
                      default=None) for link in links}
    report.data = {"loads": list(loads), "pools": list(pools), "links": list(links), "seeds": seeds,
                   "capacity_req_s": cap,
                   "cells": {f"{pool}/x{link:g}/{load:g}": {k: v.to_dict() for k, v in c.items()}
                             for (pool, link, load), c in cells.items()}}
    report.headline = {"seeds": seeds, "requests": n,
                       "max_reactive_over_proactive_below_saturation": {f"x{k:g}": v for k, v in best.items()},
                       "max_reactive_over_proactive_anywhere_paper_link":
                           max(c["reactive_over_proactive"].mean for (_, lk, _), c in cells.items() if lk == 1.0)}
    return report.write()
