"""The ``parallel`` and ``pipeline`` sections of a config: how one model copy is laid out.

``ParallelArgs``: TP ranks per stage × PP stages, the GPUs that takes, the stage workers' CPUs and
threads and the replica's own bundle. (The ``pipeline`` section, the Ray pipeline's waits and
channel size, is ``actors.spec.PipelineTimeouts`` itself, validated as it stands.) Cross-section
checks (TP·PP against GPUs, against the model's shapes) are ``app.config.AppArgs``'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from actors.spec import ParallelSpec
from app.config_model import Strict


class ParallelArgs(Strict):
    """How one model copy is split: TP ranks per stage × PP stages, and the GPUs that takes."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    #: Run stage-worker actors (the Ray pipeline) even for TP·PP = 1.
    use_ray_pipeline: bool = False
    #: GPUs one model copy requests; must be TP·PP on cuda and 0 on cpu.
    num_gpus: int = Field(default=0, ge=0)
    #: Plans the pipeline keeps in flight; None = one per stage (paper §4.3).
    max_inflight: int | None = Field(default=None, ge=1)
    #: How plans travel between stage workers: a Ray compiled graph, or plain actor calls.
    transport: Literal["compiled", "actor"] = "compiled"
    #: Logical CPUs each stage worker (one TP rank) reserves; a stage's bundle holds TP of them.
    worker_cpus: float = Field(default=0.01, gt=0)
    #: torch intra-op threads of each process that runs the model (the in-process executor, or
    #: each stage worker). None keeps what Ray set: OMP_NUM_THREADS = the CPUs the actor
    #: reserved, i.e. 1 for a replica that reserves none (the demo's), whatever the cores.
    torch_threads: int | None = Field(default=None, ge=1)
    #: OpenMP's wait policy (``OMP_WAIT_POLICY``) in the Engine replica and its stage workers,
    #: set through the replica's ``runtime_env``; None leaves libgomp's default (a thread out of
    #: work spins a while, then sleeps). ``passive`` (sleep at once) is for model copies that
    #: share cores: spinning threads take them from each other. Measured on the 2-core AMD EPYC
    #: Zen 4: two dummy OPT-125M replicas of 2 threads streamed 800 tokens in 240–272 s with the
    #: default, 62–76 s passive; but one SmolLM2 replica (the demo) answered ShareGPT chats at
    #: 0.154 against 0.098 s per token passive vs default at 0.5 req/s, 0.201 vs 0.189 at 2
    #: (``loadtest/results/omp-passive-vs-spin/``): each op's threads then wake from sleep.
    #: ``active`` (spin forever) was no faster there, and an idle replica's threads hold a core.
    omp_wait_policy: Literal["passive", "active"] | None = None
    #: Resources of the Engine replica's own bundle (bundle 0 of each model copy's placement
    #: group); GPUs are added for an in-process model on cuda. It must hold the replica's
    #: ``ray_actor_options`` (``deployments:`` in the YAML). A sliver keeps a 2-core box schedulable.
    replica_bundle: dict[str, float] = Field(default_factory=lambda: {"CPU": 0.01})

    @field_validator("replica_bundle")
    @classmethod
    def _some_resource(cls, value: dict[str, float]) -> dict[str, float]:
        if not any(v > 0 for v in value.values()):
            raise ValueError(f"replica_bundle {value} must reserve some resource")
        return value

    def spec(self) -> ParallelSpec:
        """What the data plane is given (it answers ``world_size`` and ``uses_pipeline``)."""
        return ParallelSpec(self.tensor_parallel_size, self.pipeline_parallel_size, self.transport,
                            self.max_inflight, self.worker_cpus, self.use_ray_pipeline)

    @property
    def world_size(self) -> int:
        return self.spec().world_size

    @property
    def uses_pipeline(self) -> bool:
        return self.spec().uses_pipeline
