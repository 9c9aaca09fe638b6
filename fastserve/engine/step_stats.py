"""Where an engine step's time goes: running sums per phase, by kind (decode-only or mixed: a prompt
changes the cost by an order of magnitude). The loop's ``schedule``/``update``, the executor's reported phases, the
``execute`` wall time and the ``cycle`` (result to result while never idle), so ``cycle - forward -
sample`` is the per-step ``overhead``. Imports no torch, no ray.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

StepKind = Literal["decode", "mixed"]
#: Executor-reported phases the breakdown keeps (``StepOutput.timings`` keys). ``lm_head`` is the
#: part of ``sample`` spent in the final norm and vocabulary projection (CPU only; 0 elsewhere).
EXECUTOR_PHASES = ("build", "forward", "sample", "lm_head", "swap_wait", "swap_tail", "total")


@dataclass
class StepStats:
    """Running sums per step kind: ``totals()`` to diff two readings, ``summary()`` for mean ms."""

    _totals: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def record(self, kind: StepKind, entries: int, tokens: int, schedule_s: float, execute_s: float,
               update_s: float, executor: Mapping[str, float], cycle_s: float | None) -> None:
        """``cycle_s`` is None when the engine was idle before the step."""
        sums = self._totals[kind]
        sums["steps"] += 1
        sums["entries"] += entries
        sums["tokens"] += tokens
        sums["schedule"] += schedule_s
        sums["execute"] += execute_s
        sums["update"] += update_s
        for phase in EXECUTOR_PHASES:
            sums[phase] += executor.get(phase, 0.0)
        if cycle_s is not None:
            sums["cycles"] += 1
            sums["cycle"] += cycle_s
            sums["cycle_model"] += executor.get("forward", 0.0) + executor.get("sample", 0.0)

    def totals(self) -> dict[str, dict[str, float]]:
        """Counts and seconds per phase, per kind: plain data."""
        return {kind: dict(sums) for kind, sums in self._totals.items()}

    def summary(self) -> dict[str, dict[str, float]]:
        return summarize(self.totals())


def diff_totals(after: Mapping[str, Mapping[str, float]],
                before: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """The steps between two ``totals()`` readings."""
    return {kind: {k: v - before.get(kind, {}).get(k, 0.0) for k, v in sums.items()}
            for kind, sums in after.items()}


def summarize(totals: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per kind: steps, mean entries and tokens, mean ms per phase, and the busy cycle's overhead."""
    out: dict[str, dict[str, float]] = {}
    for kind, s in sorted(totals.items()):
        steps = s.get("steps", 0.0)
        if steps <= 0:
            continue
        row: dict[str, float] = {"steps": steps, "entries": s.get("entries", 0.0) / steps,
                                 "tokens": s.get("tokens", 0.0) / steps}
        for phase in ("schedule", "execute", "update", *EXECUTOR_PHASES):
            row[f"{phase}_ms"] = 1e3 * s.get(phase, 0.0) / steps
        cycles = s.get("cycles", 0.0)
        if cycles > 0:
            cycle = s["cycle"] / cycles
            model = s["cycle_model"] / cycles
            row["cycle_ms"] = 1e3 * cycle
            row["overhead_ms"] = 1e3 * (cycle - model)
            row["overhead_share"] = (cycle - model) / cycle if cycle > 0 else 0.0
        out[kind] = row
    return out
