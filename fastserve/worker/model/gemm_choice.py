"""Which GEMM runs each of a model's linear shapes on this CPU, chosen by timing, never by vendor:
``choose`` times the caller's candidates on the model's own weights per row count, keeps the fastest
per count and caches it per CPU. Method and figures: docs/engine.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastserve.kernels.cpu_features import cpu_flags, cpu_name
from fastserve.kernels.cpu_linear import LINEAR_SOURCE

#: Paths by name: our kernel's three, oneDNN's prepacked GEMM, torch's.
DPBF16 = "dpbf16"
UNIFORM = "dpbf16_uniform"
AMX = "amx"
ONEDNN = "onednn"
TORCH = "torch"
#: Paths whose per-row sums do not depend on how many rows share the call.
BATCH_INVARIANT_PATHS = (UNIFORM, AMX)
CACHED, MEASURE, FIXED = "cached", "measure", "fixed"
MODES = (CACHED, MEASURE, FIXED)
#: Row counts timed over all the layers' weights (decode: bound by reading them).
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
#: Row counts timed over ``PREFILL_LAYERS`` weights (compute-bound); larger counts take the last's.
PREFILL_ROWS = (128, 256, 512)
PREFILL_LAYERS = 2
#: Interleaved rounds per row count; each call's fastest is kept (the least disturbed).
DECODE_ROUNDS = 5
PREFILL_ROUNDS = 3
#: A candidate this many times slower than the best at a row count is not timed at larger ones.
PRUNE_RATIO = 4.0
#: Median pass over its fastest calls' sum above this: disturbed, timed again, else not cached.
BUSY_SPREAD = 1.5
#: Seconds of timing one process spends at most; shapes left after it take the ``FIXED`` path.
MEASURE_BUDGET_S = 180.0
#: Bytes of a shape's weights timed at most (the first layers'): bounds the candidates' copies.
MEASURE_BYTES = 256 << 20
CACHE_DIR_ENV = "FASTSERVE_GEMM_CHOICE_CACHE"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "fastserve" / "gemm-choice"
#: Rows beyond every range: what the last range covers.
UNBOUNDED = 1 << 62

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmPolicy:
    """``engine.gemm_choice`` and ``engine.batch_invariant``. ``FIXED`` unless asked, so a model built
    directly (tests, tools) takes the same paths every run."""

    mode: str = FIXED
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"gemm_choice must be one of {MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class GemmChoice:
    """The path per row count: ``((max_rows, path), ...)`` ascending, the last covering all larger."""

    ranges: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not self.ranges or any(a[0] >= b[0] for a, b in zip(self.ranges, self.ranges[1:], strict=False)):
            raise ValueError(f"GemmChoice ranges must be non-empty and ascending, got {self.ranges}")

    @classmethod
    def single(cls, path: str) -> GemmChoice:
        return cls(((UNBOUNDED, path),))

    @classmethod
    def of_points(cls, points: Sequence[tuple[int, str]]) -> GemmChoice:
        """From the fastest path per measured row count (ascending): a count between two takes the
        larger's."""
        ranges: list[tuple[int, str]] = []
        for rows, path in points:
            if ranges and ranges[-1][1] == path:
                ranges[-1] = (rows, path)
            else:
                ranges.append((rows, path))
        ranges[-1] = (UNBOUNDED, ranges[-1][1])
        return cls(tuple(ranges))

    def path(self, rows: int) -> str:
        for max_rows, path in self.ranges:
            if rows <= max_rows:
                return path
        return self.ranges[-1][1]

    @property
    def paths(self) -> frozenset[str]:
        return frozenset(p for _, p in self.ranges)

    def describe(self) -> str:
        parts, low = [], 1
        for max_rows, path in self.ranges:
            parts.append(f"{low}+ {path}" if max_rows == UNBOUNDED else f"{low}-{max_rows} {path}")
            low = max_rows + 1
        return ", ".join(parts)


@dataclass(frozen=True)
class GemmRole:
    """One shape of a model's GEMMs: its weights (one per layer, ``[out, in]``), a label for the
    report, and the most rows it is called with (the LM head: a decode batch)."""

    label: str
    weights: tuple[torch.Tensor, ...]
    max_rows: int = UNBOUNDED

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weights[0].shape)  # type: ignore[return-value]

    @property
    def dtype(self) -> torch.dtype:
        return self.weights[0].dtype

    def grid(self) -> tuple[int, ...]:
        rows = tuple(r for r in (*DECODE_ROWS, *PREFILL_ROWS) if r <= self.max_rows)
        return rows or (DECODE_ROWS[0],)


#: One GEMM of a candidate on one weight (packed for it once): x -> x W^T.
Call = Callable[[torch.Tensor], object]
#: path -> (weights -> one Call per weight): a pass over the weights, call by call.
Candidates = dict[str, Callable[[Sequence[torch.Tensor]], list[Call]]]


@dataclass
class _Report:
    mode: str = FIXED
    batch_invariant: bool = False
    measure_s: float = 0.0
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)


_REPORT = _Report()
#: Choices timed or read in this process, so every stage built here agrees.
_CHOSEN: dict[str, GemmChoice] = {}


def report() -> dict[str, Any]:
    """What this process chose, per shape (``/debug/engine``'s ``gemm_choice``)."""
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "mode": _REPORT.mode,
            "batch_invariant": _REPORT.batch_invariant, "measure_s": round(_REPORT.measure_s, 2),
            "shapes": dict(_REPORT.roles)}


def choose(role: GemmRole, candidates: Candidates, policy: GemmPolicy, fixed: str) -> GemmChoice:
    """The path per row count for ``role`` among ``candidates``; ``fixed`` is ``FIXED`` mode's."""
    _REPORT.mode, _REPORT.batch_invariant = policy.mode, policy.batch_invariant
    if policy.batch_invariant:
        candidates = {p: c for p, c in candidates.items() if p in BATCH_INVARIANT_PATHS}
        if not candidates:
            raise ValueError(f"engine.batch_invariant needs a GEMM whose rows do not depend on the row count "
                             f"({' or '.join(BATCH_INVARIANT_PATHS)}: our bf16 kernel, built with AVX-512 BF16), "
                             f"and none runs a {role.dtype} {role.shape[0]}x{role.shape[1]} weight here")
    if fixed not in candidates:
        fixed = next(iter(candidates))
    key = _key(role, sorted(candidates), policy.batch_invariant)
    entry: dict[str, Any] = {"shape": f"{role.shape[0]}x{role.shape[1]}", "dtype": str(role.dtype).split(".")[-1],
                             "used_by": role.label, "layers": len(role.weights)}
    if len(candidates) == 1 or policy.mode == FIXED:
        choice, entry["source"] = GemmChoice.single(fixed), FIXED
    elif key in _CHOSEN:
        choice, entry["source"] = _CHOSEN[key], "this process"
    elif policy.mode == CACHED and (cached := _read_cache(key)) is not None:
        choice = GemmChoice(tuple((int(r), str(p)) for r, p in cached["ranges"]))
        entry["source"], entry["timings_us"] = "cache", cached.get("timings_us")
    elif _REPORT.measure_s >= MEASURE_BUDGET_S:
        choice = GemmChoice.single(fixed)
        entry["source"] = f"{FIXED}: the {MEASURE_BUDGET_S:.0f} s timing budget is spent"
    else:
        start = time.perf_counter()
        timings, spread = time_candidates(role, candidates)
        if spread > BUSY_SPREAD:
            again, spread_again = time_candidates(role, candidates)
            if spread_again < spread:
                timings, spread = again, spread_again
        choice = _pick(timings, policy.batch_invariant)
        took = time.perf_counter() - start
        _REPORT.measure_s += took
        entry["source"], entry["measure_s"] = "measured", round(took, 2)
        entry["spread"] = round(spread, 2)
        entry["timings_us"] = {str(r): {p: round(t * 1e6, 1) for p, t in ts.items()} for r, ts in timings.items()}
        if spread <= BUSY_SPREAD:
            _write_cache(key, {"ranges": [list(r) for r in choice.ranges], "timings_us": entry["timings_us"],
                               "shape": entry["shape"], "dtype": entry["dtype"], "used_by": role.label})
        else:
            entry["source"] = "measured on a busy machine, not cached"
            _log.warning("GEMM timing for %s %s was disturbed (passes %.1fx their fastest calls): its choice "
                         "serves this process and is not cached", entry["dtype"], entry["shape"], spread)
    if entry["source"] != FIXED and "budget" not in entry["source"]:
        _CHOSEN[key] = choice
    entry["choice"] = choice.describe()
    _REPORT.roles[key] = entry
    _log.info("GEMM %s %s (%s, %d layers) on %s, %d threads: %s [%s%s]", entry["dtype"], entry["shape"], role.label,
              len(role.weights), cpu_name(), torch.get_num_threads(), entry["choice"], entry["source"],
              f" in {entry['measure_s']} s" if "measure_s" in entry else "")
    return choice


def time_candidates(role: GemmRole, candidates: Candidates, grid: Sequence[int] | None = None,
                    prune_ratio: float = PRUNE_RATIO) -> tuple[dict[int, dict[str, float]], float]:
    """Seconds of one pass over the weights per row count and candidate (the sum of each call's
    fastest over the rounds), and the spread: median over row counts of the winner's median pass
    over that sum."""
    decode_layers = _decode_layers(role)
    calls: dict[tuple[str, int], list[Call]] = {}
    spreads: list[float] = []
    live = list(candidates)
    timings: dict[int, dict[str, float]] = {}
    in_features = role.shape[1]
    generator = torch.Generator().manual_seed(0)
    clock = time.perf_counter
    with torch.inference_mode():
        for rows in grid or role.grid():
            layers = decode_layers if rows <= DECODE_ROWS[-1] else min(PREFILL_LAYERS, len(role.weights))
            rounds = DECODE_ROUNDS if rows <= DECODE_ROWS[-1] else PREFILL_ROUNDS
            x = torch.randn(rows, in_features, generator=generator).to(role.dtype)
            for path in live:
                if (path, layers) not in calls:
                    calls[(path, layers)] = candidates[path](role.weights[:layers])
                calls[(path, layers)][0](x)   # first-call setup (oneDNN's primitive cache)
            best = {p: [math.inf] * layers for p in live}
            passes: dict[str, list[float]] = {p: [] for p in live}
            for _ in range(rounds):
                for path in live:
                    fastest, total = best[path], 0.0
                    for i, call in enumerate(calls[(path, layers)]):
                        start = clock()
                        call(x)
                        took = clock() - start
                        fastest[i], total = min(fastest[i], took), total + took
                    passes[path].append(total)
            timings[rows] = {p: sum(ts) for p, ts in best.items()}
            least = min(timings[rows].values())
            winner = min(timings[rows], key=timings[rows].__getitem__)
            spreads.append(statistics.median(passes[winner]) / max(least, 1e-12))
            live = [p for p in live if timings[rows][p] <= prune_ratio * least]
    return timings, statistics.median(spreads)


def _decode_layers(role: GemmRole) -> int:
    per_weight = role.weights[0].numel() * role.weights[0].element_size()
    return max(1, min(len(role.weights), MEASURE_BYTES // max(per_weight, 1)))


def _pick(timings: dict[int, dict[str, float]], single: bool) -> GemmChoice:
    """The fastest path per row count; with ``single``, the one path of least summed log ratio to
    the fastest (each row count weighs alike)."""
    if single:
        paths = set.intersection(*(set(ts) for ts in timings.values()))

        def cost(path: str) -> float:
            return sum(math.log(ts[path] / min(ts.values())) for ts in timings.values())

        return GemmChoice.single(min(sorted(paths), key=cost))
    return GemmChoice.of_points([(rows, min(ts, key=ts.__getitem__)) for rows, ts in sorted(timings.items())])


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def cache_file() -> Path:
    """This CPU's cache file: model string plus a flags hash (a VM may name different CPUs alike)."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", cpu_name()).strip("-")[:80]
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return _cache_dir() / f"{name}-{flags}.json"


def _key(role: GemmRole, candidates: list[str], invariant: bool) -> str:
    source = hashlib.sha256(LINEAR_SOURCE.read_bytes()).hexdigest()[:12] if LINEAR_SOURCE.exists() else ""
    parts = {"shape": list(role.shape), "dtype": str(role.dtype), "layers": _decode_layers(role),
             "grid": list(role.grid()), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "kernel": source,
             "candidates": candidates, "invariant": invariant}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _read_all(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) else {}


def _read_cache(key: str) -> dict[str, Any] | None:
    entry = _read_all(cache_file()).get(key)
    return entry if isinstance(entry, dict) and entry.get("ranges") else None


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` to this CPU's file atomically; a failure is logged, never raised."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_all(path)
        entries[key] = entry
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"cpu": cpu_name(), "entries": entries}, out, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        _log.warning("could not write the GEMM choice cache %s: %s", path, exc)
