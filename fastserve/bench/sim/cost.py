"""The simulator's cost model: how long a ``BatchPlan`` computes and how long its swaps take.

Owns the mapping from a plan's composition to seconds, read from a profile JSON through the
scheduler's own ``fastserve.scheduler.profile.Profile`` (the same interpolation the scheduler uses):

* compute = Σ (or max, or t_init of the summed tokens) of ``t_init(len)`` over first-iteration
  entries, plus ``t_dec(#decode entries)`` when the plan decodes — see ``PrefillCombine``;
  a chunk of a chunked prefill is priced like a first iteration of its own tokens, ``t_init``
  of the chunk (the price the scheduler charges it as service). The profile has no term for a
  chunk's attention over its cached prefix, so long prompts' later chunks are priced a little
  low; each chunk does pay ``t_init``'s fixed per-iteration part again;
* swaps = blocks × ``swap.seconds_per_block``, on a PCIe resource separate from compute;
* pipeline parallelism: a plan visits ``pp`` stages, each taking compute / pp.

Pure arithmetic; the event loop that schedules these durations is ``fastserve.bench.sim.simulator``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastserve.scheduler.profile import Profile
from fastserve.worker.messages import BatchPlan

#: How first iterations sharing a plan combine. ``sum``: they run back to back (compute-bound
#: work does not overlap; the default, an upper bound). ``max``: perfectly parallel (a lower
#: bound). ``tokens``: one first iteration over all their tokens (one weight pass).
PrefillCombine = Literal["sum", "max", "tokens"]
PREFILL_COMBINES: tuple[PrefillCombine, ...] = ("sum", "max", "tokens")
DEFAULT_PREFILL_COMBINE: PrefillCombine = "sum"


@dataclass(frozen=True)
class ServingDefaults:
    """The ``serving`` section of a paper-scale profile (absent from measured ones)."""

    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    max_batch_size: int | None = None
    max_num_batched_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ServingDefaults:
        def opt(key: str) -> int | None:
            return None if raw.get(key) is None else int(raw[key])

        return cls(opt("num_device_blocks"), opt("num_host_blocks"), opt("max_batch_size"),
                   opt("max_num_batched_tokens"))


@dataclass(frozen=True)
class CostModel:
    profile: Profile
    prefill_combine: PrefillCombine = DEFAULT_PREFILL_COMBINE
    serving: ServingDefaults = ServingDefaults()
    #: Scale every swap time (1 = the profile's PCIe bandwidth); experiments stress it.
    swap_time_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill_combine not in PREFILL_COMBINES:
            raise ValueError(f"prefill_combine must be one of {PREFILL_COMBINES}, got {self.prefill_combine!r}")
        if self.swap_time_factor < 0:
            raise ValueError(f"swap_time_factor must be >= 0, got {self.swap_time_factor}")

    @classmethod
    def from_json(cls, path: str | Path, prefill_combine: PrefillCombine = DEFAULT_PREFILL_COMBINE,
                  swap_time_factor: float = 1.0) -> CostModel:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(Profile.from_dict(raw), prefill_combine,
                   ServingDefaults.from_dict(raw.get("serving", {})), swap_time_factor)

    @property
    def stages(self) -> int:
        return max(self.profile.pp, 1)

    def compute_seconds(self, plan: BatchPlan) -> float:
        """Time the plan's forward occupies the whole pipeline (sum over its stages)."""
        prefill = [len(e.token_ids) for e in plan.entries if e.is_prefill]
        decodes = sum(1 for e in plan.entries if not e.is_prefill)
        total = 0.0
        if prefill:
            if self.prefill_combine == "sum":
                total += sum(self.profile.t_init(n) for n in prefill)
            elif self.prefill_combine == "max":
                total += max(self.profile.t_init(n) for n in prefill)
            else:
                total += self.profile.t_init(sum(prefill))
        if decodes:
            total += self.profile.t_dec(decodes)
        return total

    def swap_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.profile.swap_seconds_per_block * self.swap_time_factor
