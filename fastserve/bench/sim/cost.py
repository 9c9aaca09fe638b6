"""The simulator's cost model: seconds a ``BatchPlan`` computes and its swaps take, from a profile
through the scheduler's own ``Profile``. Compute: first iterations and chunks at ``t_init`` of their
tokens (combined per ``PrefillCombine``; a chunk's attention over its prefix is not priced), plus
``t_dec(decodes)``; each of ``pp`` stages takes compute / pp. Swaps: blocks × seconds per block,
on a link apart from compute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastserve.scheduler.profile import Profile
from fastserve.worker.messages import BatchPlan

#: First iterations in one plan: back to back (``sum``, an upper bound), perfectly parallel (``max``,
#: a lower bound), or one pass over all their tokens (``tokens``).
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
