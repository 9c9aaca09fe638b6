"""Where an engine step's time goes: running sums per phase, for decode-only and mixed steps.

Owns the engine loop's own accounting (the breakdown the README publishes and the race and
breakdown tools read): for each finished step, the control plane's phases measured by the loop
(``schedule``, ``update``), the executor's phases as it reported them (``build``, ``forward``,
``sample``, ``swap_wait``, ``swap_tail``, ``total``), the step's wall time from submit to result
(``execute``) and the ``cycle``: time from the previous step's result to this one's while the
engine was never idle — so ``cycle − forward − sample`` is everything per-step that is not the
model (``overhead``). Steps are split by kind because a first iteration's prompt changes the cost
by an order of magnitude. Imports no torch and no ray.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

StepKind = Literal["decode", "mixed"]
#: Executor-reported phases the breakdown keeps (``StepOutput.timings`` keys).
EXECUTOR_PHASES = ("build", "forward", "sample", "swap_wait", "swap_tail", "total")


@dataclass
class _Sums:
    steps: int = 0
    entries: int = 0
    tokens: int = 0
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cycles: int = 0


@dataclass
class StepStats:
    """Running sums per step kind; ``summary()`` gives means in milliseconds."""

    _by_kind: dict[str, _Sums] = field(default_factory=lambda: defaultdict(_Sums))

    def record(self, kind: StepKind, entries: int, tokens: int, schedule_s: float, execute_s: float,
               update_s: float, executor: Mapping[str, float], cycle_s: float | None) -> None:
        """One finished step. ``cycle_s`` is None when the engine was idle before it."""
        sums = self._by_kind[kind]
        sums.steps += 1
        sums.entries += entries
        sums.tokens += tokens
        sums.phases["schedule"] += schedule_s
        sums.phases["execute"] += execute_s
        sums.phases["update"] += update_s
        for phase in EXECUTOR_PHASES:
            sums.phases[phase] += executor.get(phase, 0.0)
        if cycle_s is not None:
            sums.cycles += 1
            sums.phases["cycle"] += cycle_s
            sums.phases["cycle_model"] += executor.get("forward", 0.0) + executor.get("sample", 0.0)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: step count, mean entries and tokens per step, mean ms per phase, and the
        share of a busy cycle that is not the model (``overhead_share``)."""
        out: dict[str, dict[str, float]] = {}
        for kind, s in sorted(self._by_kind.items()):
            if not s.steps:
                continue
            row: dict[str, float] = {"steps": s.steps, "entries": s.entries / s.steps, "tokens": s.tokens / s.steps}
            for phase, total in s.phases.items():
                if phase.startswith("cycle"):
                    continue
                row[f"{phase}_ms"] = 1e3 * total / s.steps
            if s.cycles:
                cycle = s.phases["cycle"] / s.cycles
                model = s.phases["cycle_model"] / s.cycles
                row["cycle_ms"] = 1e3 * cycle
                row["overhead_ms"] = 1e3 * (cycle - model)
                row["overhead_share"] = (cycle - model) / cycle if cycle > 0 else 0.0
            out[kind] = row
        return out
