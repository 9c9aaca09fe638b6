"""``fastserve.bench.experiments.evictions``: one small point of the 175B two-stage run, its
numbers consistent (every priority eviction under proactive is a swap-out) and its rate the
load times the capacity at the profile's batch (16)."""

from __future__ import annotations

import pytest

from fastserve.bench.experiments import evictions as E
from fastserve.bench.experiments.common import capacity_rate, dataset_pairs
from fastserve.bench.sim import PAPER_PROFILES, CostModel


def test_a_point_is_consistent_and_at_the_asked_load() -> None:
    row = E.point(1.2, 0, requests=60)
    cost = CostModel.from_json(PAPER_PROFILES[E.MODEL])
    assert row["rate"] == pytest.approx(1.2 * capacity_rate(dataset_pairs("sharegpt"), cost, 16), rel=1e-12)
    assert 0 <= row["priority_evictions"] <= row["swaps_out"]
    assert row["per_token_mean"] > 0 and row["per_token_p95"] > 0
    assert set(row) == {"load", "seed", "rate", "priority_evictions", "swaps_out", "per_token_mean", "per_token_p95"}
