"""``fastserve.worker.model.gemm_choice``: the CPU GEMM path per shape and row count, timed, cached, reported.

The timing itself is replaced by fixed figures where a test needs a known answer (no assertion
depends on this machine's speed); one test times the candidates for real and checks only that the
answer is made of paths this CPU runs and is cached and reported.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from fastserve.kernels import cpu_linear
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model import linear as L
from fastserve.worker.model.gemm_choice import GemmChoice, GemmPolicy, GemmRole


@pytest.fixture(autouse=True)
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder of the test's own and no choice remembered from earlier in the process."""
    monkeypatch.setenv(G.CACHE_DIR_ENV, str(tmp_path / "gemm-choice"))
    monkeypatch.setattr(G, "_CHOSEN", {})
    monkeypatch.setattr(G, "_REPORT", G._Report())


def test_a_choice_maps_row_counts_to_ranges() -> None:
    choice = GemmChoice.of_points([(1, G.DPBF16), (2, G.DPBF16), (4, G.AMX), (8, G.AMX), (256, G.ONEDNN)])
    assert choice.ranges == ((2, G.DPBF16), (8, G.AMX), (G.UNBOUNDED, G.ONEDNN))
    assert [choice.path(r) for r in (1, 2, 3, 8, 9, 256, 5000)] == [G.DPBF16, G.DPBF16, G.AMX, G.AMX, G.ONEDNN,
                                                                   G.ONEDNN, G.ONEDNN]
    assert choice.describe() == "1-2 dpbf16, 3-8 amx, 9+ onednn"
    assert choice.paths == {G.DPBF16, G.AMX, G.ONEDNN}
    assert GemmChoice.single(G.TORCH).describe() == "1+ torch"
    with pytest.raises(ValueError, match="ascending"):
        GemmChoice(((8, G.AMX), (4, G.DPBF16)))
    with pytest.raises(ValueError, match="gemm_choice must be one of"):
        GemmPolicy("sometimes")


def _role(shape: tuple[int, int] = (64, 32), layers: int = 3, dtype: torch.dtype = torch.bfloat16) -> GemmRole:
    torch.manual_seed(0)
    return GemmRole("test", tuple(torch.randn(*shape).to(dtype) for _ in range(layers)), max_rows=16)


def _scripted(seconds: dict[str, dict[int, float]], calls: list[tuple[str, int]]) -> G.Candidates:
    """Candidates whose calls take the scripted times per weight (on ``_fake_clock``)."""
    def candidate(path: str) -> Callable[[Sequence[torch.Tensor]], list[G.Call]]:
        def make(weights: Sequence[torch.Tensor]) -> list[G.Call]:
            def run(x: torch.Tensor) -> None:
                calls.append((path, x.shape[0]))
            return [run for _ in weights]
        return make

    return {path: candidate(path) for path in seconds}


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, dict[int, float]],
                calls: list[tuple[str, int]]) -> None:
    """perf_counter advanced by the scripted time of the call just made (the last one)."""
    clock = [0.0]
    seen = [0]

    def perf_counter() -> float:
        if len(calls) > seen[0]:
            path, rows = calls[-1]
            clock[0] += seconds[path][rows] * 1e-6   # scripted in microseconds
            seen[0] = len(calls)
        clock[0] += 1e-9
        return clock[0]

    monkeypatch.setattr(G.time, "perf_counter", perf_counter)


def test_the_fastest_path_per_row_count_is_chosen_cached_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    role = _role()
    assert role.grid() == (1, 2, 4, 8, 16)
    seconds = {G.DPBF16: {1: 1.0, 2: 1.0, 4: 2.0, 8: 9.0, 16: 99.0},
               G.AMX: {1: 1.5, 2: 1.5, 4: 1.5, 8: 2.0, 16: 2.0},
               G.ONEDNN: {1: 3.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 1.0}}
    calls: list[tuple[str, int]] = []
    _fake_clock(monkeypatch, seconds, calls)
    choice = G.choose(role, _scripted(seconds, calls), GemmPolicy(G.CACHED), G.DPBF16)
    assert choice.ranges == ((2, G.DPBF16), (8, G.AMX), (G.UNBOUNDED, G.ONEDNN))
    # dpbf16 fell PRUNE_RATIO behind at 8 rows: not timed at 16.
    assert (G.DPBF16, 16) not in calls and (G.AMX, 16) in calls
    shapes = G.report()["shapes"]
    (entry,) = shapes.values()
    assert entry["choice"] == "1-2 dpbf16, 3-8 amx, 9+ onednn" and entry["source"] == "measured"
    assert entry["shape"] == "64x32" and entry["layers"] == 3
    # The cache file is this CPU's, whole JSON, and a new process (no memory) reads it back untimed.
    data = json.loads(G.cache_file().read_text())
    assert data["cpu"] == G.cpu_name() and len(data["entries"]) == 1
    monkeypatch.setattr(G, "_CHOSEN", {})
    calls.clear()
    assert G.choose(role, _scripted(seconds, calls), GemmPolicy(G.CACHED), G.DPBF16) == choice
    assert calls == [] and next(iter(G.report()["shapes"].values()))["source"] == "cache"
    # measure: timed again in a new process; fixed: never timed.
    monkeypatch.setattr(G, "_CHOSEN", {})
    G.choose(role, _scripted(seconds, calls), GemmPolicy(G.MEASURE), G.DPBF16)
    assert calls
    made = len(calls)   # (the fake clock reads the list as it grows: never cleared from here)
    monkeypatch.setattr(G, "_CHOSEN", {})
    assert G.choose(role, _scripted(seconds, calls), GemmPolicy(G.FIXED), G.AMX) == GemmChoice.single(G.AMX)
    assert len(calls) == made
    # A fixed choice is no measurement: a measured policy after it in the same process times.
    assert G.choose(role, _scripted(seconds, calls), GemmPolicy(G.MEASURE), G.AMX) == choice and len(calls) > made


def test_batch_invariant_mode_takes_one_invariant_path_for_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    role = _role()
    seconds = {G.DPBF16: {r: 0.1 for r in (1, 2, 4, 8, 16)},
               G.UNIFORM: {1: 1.0, 2: 1.0, 4: 2.0, 8: 3.0, 16: 6.0},
               G.AMX: {1: 1.2, 2: 1.2, 4: 1.2, 8: 1.2, 16: 1.2},
               G.ONEDNN: {r: 0.1 for r in (1, 2, 4, 8, 16)}}
    calls: list[tuple[str, int]] = []
    _fake_clock(monkeypatch, seconds, calls)
    choice = G.choose(role, _scripted(seconds, calls), GemmPolicy(G.MEASURE, batch_invariant=True), G.AMX)
    assert choice == GemmChoice.single(G.AMX)
    assert {path for path, _ in calls} == {G.UNIFORM, G.AMX}   # the others are not candidates
    with pytest.raises(ValueError, match="engine.batch_invariant needs a GEMM"):
        G.choose(role, {G.ONEDNN: _scripted(seconds, calls)[G.ONEDNN]}, GemmPolicy(batch_invariant=True), G.ONEDNN)


def test_a_disturbed_timing_is_timed_again_used_and_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the calls (drawn with a fixed seed) take 3x their undisturbed time, in both attempts:
    the choice (each call's fastest) serves the process; nothing is cached."""
    seconds = {G.DPBF16: {r: 1.0 for r in (1, 2, 4, 8, 16)}, G.AMX: {r: 2.0 for r in (1, 2, 4, 8, 16)}}
    calls: list[tuple[str, int]] = []
    clock = [0.0]
    seen = [0]
    draw = random.Random(0)

    def perf_counter() -> float:
        if len(calls) > seen[0]:
            path, rows = calls[-1]
            clock[0] += seconds[path][rows] * 1e-6 * (3 if draw.random() < 0.5 else 1)
            seen[0] = len(calls)
        clock[0] += 1e-9
        return clock[0]

    monkeypatch.setattr(G.time, "perf_counter", perf_counter)
    assert G.choose(_role(), _scripted(seconds, calls), GemmPolicy(G.CACHED), G.AMX) == GemmChoice.single(G.DPBF16)
    (entry,) = G.report()["shapes"].values()
    assert entry["source"] == "measured on a busy machine, not cached" and entry["spread"] > G.BUSY_SPREAD
    # Two attempts: 5 row counts x 2 paths x (a warm call + rounds x 3 weights).
    assert len(calls) == 2 * 5 * 2 * (1 + G.DECODE_ROUNDS * 3)
    assert not G.cache_file().exists()


def test_past_the_timing_budget_shapes_take_the_fixed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    seconds = {G.DPBF16: {r: 1.0 for r in (1, 2, 4, 8, 16)}, G.AMX: {r: 2.0 for r in (1, 2, 4, 8, 16)}}
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(G, "_REPORT", G._Report(measure_s=G.MEASURE_BUDGET_S))
    assert G.choose(_role(), _scripted(seconds, calls), GemmPolicy(G.MEASURE), G.AMX) == GemmChoice.single(G.AMX)
    assert calls == [] and "budget" in next(iter(G.report()["shapes"].values()))["source"]


def test_an_unwritable_cache_leaves_the_choice_standing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(G.CACHE_DIR_ENV, str(blocker / "below"))
    seconds = {G.DPBF16: {r: 1.0 for r in (1, 2, 4, 8, 16)}, G.AMX: {r: 2.0 for r in (1, 2, 4, 8, 16)}}
    calls: list[tuple[str, int]] = []
    _fake_clock(monkeypatch, seconds, calls)
    assert G.choose(_role(), _scripted(seconds, calls), GemmPolicy(G.CACHED), G.AMX) == GemmChoice.single(G.DPBF16)


def test_candidates_are_the_paths_this_cpu_runs() -> None:
    bf16 = torch.randn(64, 64).to(torch.bfloat16)
    paths = L.candidate_paths(bf16)   # none without native bf16: F.linear alone, nothing packed
    assert paths == [] or paths[-1] == G.TORCH
    assert (G.ONEDNN in paths) == L.onednn_linear_available(torch.bfloat16)
    assert (G.DPBF16 in paths) == cpu_linear.available()
    assert (G.AMX in paths) == cpu_linear.amx_available()
    invariant = L.candidate_paths(bf16, batch_invariant=True)
    assert set(invariant) <= set(G.BATCH_INVARIANT_PATHS) and (bool(invariant) == cpu_linear.available())
    assert G.AMX not in L.candidate_paths(torch.randn(64, 48).to(torch.bfloat16))   # in features not 32k
    assert L.candidate_paths(torch.randn(64, 64)) == ([G.ONEDNN, G.TORCH] if L.onednn_linear_available() else [])
    assert L.candidate_paths(torch.randn(64, 64).double()) == []


def test_a_measured_choice_on_this_cpu_is_made_of_its_paths_and_multiplies_right() -> None:
    """The real timing, on a small shape: whatever wins, the packed linear equals ``F.linear``
    to the dtype's rounding at every row count: each rounds an fp32 sum once, so they differ by
    at most one bf16 step (test_cpu_linear's bound)."""
    from tests.unit.test_cpu_linear import one_bf16_step

    torch.manual_seed(3)
    layer = L.ServingLinear(64, 96, bias=False).to(torch.bfloat16).requires_grad_(False)
    assert layer.pack(GemmPolicy(G.MEASURE)) == bool(L.candidate_paths(layer.weight))
    if L.candidate_paths(layer.weight):   # else (no native bf16) nothing is chosen: F.linear
        (entry,) = G.report()["shapes"].values()
        assert entry["source"].startswith("measured") or entry["source"] == G.FIXED   # busy or not
    for rows in (1, 3, 17, 300):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = torch.nn.functional.linear(x, layer.weight)
        assert bool(((layer(x).float() - want.float()).abs() <= one_bf16_step(want)).all())
