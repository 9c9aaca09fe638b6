"""The GPU kinds a config may be sized for (``parallel.gpu_kind``), read from ``config/gpus.yaml``:
each kind's device memory and its usual node's host memory, and the shares of each a model may
take. Owned here so the config's validation and the planner (``fastserve.plan``) read one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from fastserve.config_model import resolve_path

GPU_TABLE = "config/gpus.yaml"
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_bytes: int
    node_host_memory_bytes: int


@dataclass(frozen=True)
class GpuTable:
    kinds: dict[str, GpuKind]
    gpu_memory_utilization: float
    host_memory_utilization: float

    def kind(self, name: str) -> GpuKind:
        if name not in self.kinds:
            raise ValueError(f"unknown gpu_kind {name!r}: {GPU_TABLE} lists {sorted(self.kinds)}")
        return self.kinds[name]


def _fraction(raw: dict, key: str, path: Path) -> float:
    value = float(raw[key])
    if not 0 < value <= 1:
        raise ValueError(f"{path}: planner.{key}={value} must be in (0, 1]")
    return value


@cache
def load_gpu_table(path: str = GPU_TABLE) -> GpuTable:
    file = resolve_path(path)
    raw = yaml.safe_load(file.read_text())
    kinds = {name: GpuKind(name, int(spec["memory_mib"]) * MIB, int(spec["node_host_memory_gib"]) * GIB)
             for name, spec in raw["gpus"].items()}
    planner = raw["planner"]
    return GpuTable(kinds, _fraction(planner, "gpu_memory_utilization", file),
                    _fraction(planner, "host_memory_utilization", file))
