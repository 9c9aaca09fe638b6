"""The ``parallel`` section of a config: how one model copy is laid out, and what its replica needs.

``ParallelArgs`` is ``fastserve.worker.spec.ParallelSpec`` (TP ranks per stage × PP stages, the transport,
plans in flight, the stage workers' CPUs — declared once, there) plus what only the replica
needs: the GPUs one copy requests, torch's threads, OpenMP's wait policy and the replica's own
bundle. Pydantic validates it as it stands (bounds as ``Annotated``, an unknown key refused). The
``pipeline`` section, the Ray pipeline's waits and channel size, is ``fastserve.worker.spec.PipelineTimeouts``
itself. Cross-section checks (TP·PP against GPUs, against the model's shapes) are
``fastserve.config.AppArgs``'s.
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
    """How one model copy is split (``ParallelSpec``'s fields), and the replica's own needs."""

    # As every section: a misspelt key is refused naming itself (pydantic reads this attribute).
    __pydantic_config__ = ConfigDict(extra="forbid")

    #: GPUs one model copy requests; must be TP·PP on cuda and 0 on cpu.
    num_gpus: Annotated[int, Ge(0)] = 0
    #: torch intra-op threads of each process that runs the model (the in-process executor, or
    #: each stage worker). None keeps what Ray set: OMP_NUM_THREADS = the CPUs the actor
    #: reserved, i.e. 1 for a replica that reserves none (the demo's), whatever the cores.
    torch_threads: Annotated[int, Ge(1)] | None = None
    #: OpenMP's wait policy (``OMP_WAIT_POLICY``) in the Engine replica and its stage workers,
    #: set through the replica's ``runtime_env``; None leaves libgomp's default (a thread out of
    #: work spins a while, then sleeps). ``passive`` (sleep at once) is for model copies that
    #: share cores: spinning threads take them from each other. Measured on the 2-core AMD EPYC
    #: Zen 4: two dummy OPT-125M replicas of 2 threads streamed 800 tokens in 240–272 s with the
    #: default, 62–76 s passive; but one SmolLM2 replica (the demo) answered ShareGPT chats at
    #: 0.154 against 0.098 s per token passive vs default at 0.5 req/s, 0.201 vs 0.189 at 2
    #: (``results/omp-passive-vs-spin/``): each op's threads then wake from sleep.
    #: ``active`` (spin forever) was no faster there, and an idle replica's threads hold a core.
    omp_wait_policy: Literal["passive", "active"] | None = None
    #: Resources of the Engine replica's own bundle (bundle 0 of each model copy's placement
    #: group); GPUs are added for an in-process model on cuda. It must hold the replica's
    #: ``ray_actor_options`` (``deployments:`` in the YAML). A sliver keeps a 2-core box schedulable.
    replica_bundle: dict[str, float] = field(default_factory=_replica_sliver)
    #: The GPU kind this layout is sized for, a name in ``config/gpus.yaml``: ``python -m
    #: fastserve.plan`` checks that each rank's weights, KV pool and activations fit it (and the
    #: pinned host pools its node). None on a CPU model.
    gpu_kind: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not any(v > 0 for v in self.replica_bundle.values()):
            raise ValueError(f"replica_bundle {self.replica_bundle} must reserve some resource")

    def spec(self) -> ParallelSpec:
        """What the data plane is given: the ``ParallelSpec`` fields alone."""
        return ParallelSpec(**{f.name: getattr(self, f.name) for f in fields(ParallelSpec)})
