"""``fastserve.bench.experiments.fig15_grid``: with no eviction the two swap modes are one run, a
binding pool moves KV over the link, and the grid runs the bound once per load and seed."""

from __future__ import annotations

from fastserve.bench.experiments import fig15
from fastserve.bench.experiments import fig15_grid as G


def test_with_no_eviction_reactive_and_proactive_are_the_same_run() -> None:
    pro = G.simulate((fig15.UNLIMITED_BLOCKS, 1.0, 0.7, 0, 40, "proactive"))
    re = G.simulate((fig15.UNLIMITED_BLOCKS, 1.0, 0.7, 0, 40, "reactive"))
    assert pro["evictions_per_job"] == re["evictions_per_job"] == 0
    assert pro["per_token_mean"] == re["per_token_mean"] and pro["pcie_share"] == 0


def test_a_binding_pool_swaps_and_a_slower_link_is_busier() -> None:
    fast = G.simulate((100, 1.0, 0.7, 0, 60, "reactive"))
    slow = G.simulate((100, 4.0, 0.7, 0, 60, "reactive"))
    assert fast["evictions_per_job"] > 0 and 0 < fast["pcie_share"] < slow["pcie_share"] < 1


def test_the_grid_runs_each_cell_per_mode_and_the_bound_once_per_load_and_seed() -> None:
    tasks = G._tasks((100, 200), (1.0, 2.0), (0.5, 0.9), [0, 1], 10)
    cells = {(pool, link) for pool, link, *_ in tasks if pool}
    assert cells == {(100, 1.0), (200, 1.0), (200, 2.0)}
    assert len(tasks) == len(cells) * 2 * 2 * len(G.MODES) + 2 * 2
    assert sum(1 for t in tasks if t[-1] == G.BOUND) == 4
