"""The ``parallel`` section of a config: ``ParallelSpec`` (declared once, in ``fastserve.worker.spec``)
plus what only the Engine replica needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from annotated_types import Ge
from pydantic import ConfigDict

from fastserve.worker.spec import ParallelSpec


def _replica_sliver() -> dict[str, float]:
    return {"CPU": 0.01}


@dataclass(frozen=True)
class ParallelArgs(ParallelSpec):
    __pydantic_config__ = ConfigDict(extra="forbid")

    #: TP·PP on cuda, 0 on cpu.
    num_gpus: Annotated[int, Ge(0)] = 0
    #: Per model process; None keeps Ray's OMP_NUM_THREADS (the actor's CPUs, 1 for none reserved).
    torch_threads: Annotated[int, Ge(1)] | None = None
    #: ``OMP_WAIT_POLICY`` of model processes; ``passive`` for copies sharing cores (docs/benchmarks.md).
    omp_wait_policy: Literal["passive", "active"] | None = None
    #: Bundle 0: must hold the replica's ``ray_actor_options``; GPUs added for an in-process model.
    replica_bundle: dict[str, float] = field(default_factory=_replica_sliver)
    #: A ``config/gpus.yaml`` name ``fastserve.plan`` checks the layout's memory against.
    gpu_kind: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not any(v > 0 for v in self.replica_bundle.values()):
            raise ValueError(f"replica_bundle {self.replica_bundle} must reserve some resource")

    def spec(self) -> ParallelSpec:
        return ParallelSpec(**{f.name: getattr(self, f.name) for f in fields(ParallelSpec)})
