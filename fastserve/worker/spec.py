"""What one model copy runs and how it is cut: ``EngineSpec`` = ``ModelSpec`` + ``ParallelSpec`` +
``PipelineTimeouts``.

Built once from the application's config (``fastserve.config.AppArgs.engine_spec``) and passed whole:
to the in-process executor (its ``ModelSpec``), to the pipeline executor, and — with its stage
and rank — to every stage worker (``fastserve.worker.worker.WorkerSpec``). It also owns the two things
every user of a layout needs the same answer to: whether the model can be cut that way
(``ParallelSpec.check``) and what a stage's placement bundle holds (``ParallelSpec.stage_bundles``).

Stdlib only (plain, picklable dataclasses, no torch or ray): ``fastserve.config`` builds it without
pulling the data plane in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge, Gt

from fastserve.worker.messages import DEFAULT_BLOCK_SIZE
from fastserve.worker.model.config import ModelConfig, as_model_config
from fastserve.worker.model.footprint import stage_weight_bytes
from fastserve.worker.model.shard import StageShard
from fastserve.worker.parallel import layer_ranges

#: The variable OpenMP (libgomp, as torch's CPU wheels ship it) reads its wait policy from, once,
#: as torch loads: a process that runs the model must have it in its environment from the start.
OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
#: Resources a stage bundle's size already says (``ParallelSpec.stage_bundles``), or Ray's own.
DERIVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


@dataclass(frozen=True)
class ModelSpec:
    """The model, its weights, and its KV pools. ``model`` is a config path/folder (its
    ``config.json`` says the architecture) or a loaded ``ModelConfig``."""

    model: str | Path | ModelConfig
    num_device_blocks: int
    num_host_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    load_format: str = "dummy"
    model_path: str | None = None
    #: torch intra-op threads of each process that runs the model; None keeps torch's default.
    torch_threads: int | None = None
    #: On a CUDA device, replay decode steps as CUDA graphs (``fastserve.worker.graphs``); no
    #: effect on a CPU, which has none. The largest batch captured (vLLM's capture sizes up to it)
    #: and the longest context a graph serves (vLLM's ``max_seq_len_to_capture``); a step beyond
    #: either runs eagerly.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    cuda_graph_max_context: int = 8192
    #: How each linear shape's CPU GEMM path is chosen (``engine.gemm_choice``, whose default is
    #: ``cached``: ``fastserve.worker.model.gemm_choice``). ``fixed`` here: a model built directly (tests,
    #: tools) takes the same paths on every run unless it asks for a measured choice.
    gemm_choice: str = "fixed"
    #: A job's greedy tokens independent of what shares its batch (``engine.batch_invariant``).
    batch_invariant: bool = False

    def load_config(self) -> ModelConfig:
        return as_model_config(self.model)


@dataclass(frozen=True)
class ParallelSpec:
    """How one model copy is cut: TP ranks per stage × PP stages, and how plans travel. Its
    fields are also the config's ``parallel:`` section's (``fastserve.config_layout.ParallelArgs``
    extends it with what the replica itself needs); pydantic validates the bounds."""

    tensor_parallel_size: Annotated[int, Ge(1)] = 1
    pipeline_parallel_size: Annotated[int, Ge(1)] = 1
    #: How plans travel between stage workers: ``compiled`` (a Ray compiled graph) or ``actor``
    #: (plain actor calls).
    transport: Literal["compiled", "actor"] = "compiled"
    #: Plans kept in flight; None = one per stage (paper §4.3).
    max_inflight: Annotated[int, Ge(1)] | None = None
    #: Logical CPUs each worker (one TP rank) reserves; a stage's bundle holds TP of them. A
    #: bundle must reserve something on a CPU-only node; a sliver keeps a 2-core box schedulable
    #: (torch's threads are ``torch_threads``, not this).
    worker_cpus: Annotated[float, Gt(0)] = 0.01
    #: Run stage-worker actors (the Ray pipeline) even for TP·PP = 1.
    use_ray_pipeline: bool = False
    #: Extra resources each stage's bundle reserves, one mapping per stage (empty: none): a custom
    #: resource a node advertises (``ray start --resources '{"gpu_node_a": 1}'``) pins a stage to
    #: it, e.g. ``[{gpu_node_a: 0.001}, {gpu_node_b: 0.001}]`` for one stage per node. CPUs and
    #: GPUs come from ``worker_cpus`` and the TP size, never from here.
    stage_resources: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse ``stage_resources`` the stage bundles could not honour as written."""
        extra, p = self.stage_resources, self.pipeline_parallel_size
        if extra and len(extra) != p:
            raise ValueError(f"stage_resources has {len(extra)} entries; it needs one per pipeline stage "
                             f"(pipeline_parallel_size={p}), got {extra}")
        if extra and not self.uses_pipeline:
            raise ValueError("stage_resources place stage workers, but with TP·PP = 1 and use_ray_pipeline off "
                             "the model runs inside the Engine replica: pin it with replica_bundle instead")
        for s, resources in enumerate(extra):
            derived = sorted(set(resources) & DERIVED_RESOURCES)
            if derived:
                raise ValueError(f"stage_resources[{s}] names {derived}: a stage's CPUs and GPUs come from "
                                 f"worker_cpus and the TP size; name only custom resources there")
            for name, amount in resources.items():
                if not amount > 0:
                    raise ValueError(f"stage_resources[{s}][{name!r}] must be > 0, got {amount}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_pipeline(self) -> bool:
        return self.use_ray_pipeline or self.world_size > 1

    def check(self, config: ModelConfig) -> None:
        """Raise ``ValueError`` if the model cannot be cut this way (the one place that says)."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        if t < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {t}")
        if p < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {p}")
        config.check_tensor_parallel(t)
        if p > config.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={p} exceeds the model's {config.num_hidden_layers} layers")

    def stage_bundles(self, device: str) -> list[dict[str, float]]:
        """One placement-group bundle per stage, holding that stage's TP ranks (a bundle lives on
        one node): ``worker_cpus`` CPUs and, on cuda, one GPU per rank; plus the stage's
        ``stage_resources``."""
        t = self.tensor_parallel_size
        bundle: dict[str, float] = {}
        if self.worker_cpus > 0:
            bundle["CPU"] = self.worker_cpus * t
        if device == "cuda":
            bundle["GPU"] = float(t)
        extra = self.stage_resources or [{} for _ in range(self.pipeline_parallel_size)]
        return [{**bundle, **resources} for resources in extra]


#: Compiled-graph channel size set in the workers: above the largest activation message, or
#: Ray resizes the channel (slower) and ``teardown`` hangs (measured, RAY-NOTES).
DEFAULT_CHANNEL_BUFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PipelineTimeouts:
    """The Ray pipeline's waits and its compiled-graph channel size: also the config's
    ``pipeline:`` section, which pydantic validates against these very fields and bounds
    (``Annotated``; an unknown key is refused), so each is declared once, here."""

    #: Compiled-graph channel size: above the largest activation message (else Ray resizes it).
    channel_buffer_bytes: Annotated[int, Ge(1024)] = DEFAULT_CHANNEL_BUFFER_BYTES
    #: How long the stage workers' placement group may take to be placed.
    placement_timeout_s: Annotated[float, Gt(0)] = 60.0
    #: How long the stage workers may take to start (weights loaded), at least: a checkpoint is
    #: given longer where its largest rank's bytes need it at ``weight_read_bytes_per_s``.
    startup_timeout_s: Annotated[float, Gt(0)] = 300.0
    #: The rate each worker is assumed to read its checkpoint slices at: a node's storage shared
    #: by its 8 ranks (1.6 GB/s per node, a conservative NVMe or network volume).
    weight_read_bytes_per_s: Annotated[float, Gt(0)] = 200e6
    #: TP rendezvous timeout, also gloo/NCCL's collective timeout (a rank whose peer died).
    tp_timeout_s: Annotated[float, Gt(0)] = 120.0
    #: While a plan is overdue by this much, the workers are pinged to tell slow from dead.
    liveness_interval_s: Annotated[float, Gt(0)] = 1.0
    ping_timeout_s: Annotated[float, Gt(0)] = 5.0
    #: A live worker that answers no ping for this long (wedged) fails the pipeline too. Dead
    #: workers fail it at once; a slow answer on a starved machine must not.
    unresponsive_s: Annotated[float, Gt(0)] = 60.0
    #: After a transport error, how long to keep probing for the worker death behind it.
    diagnose_s: Annotated[float, Ge(0)] = 5.0
    #: How long tearing the graph and the workers down may take.
    teardown_timeout_s: Annotated[float, Gt(0)] = 15.0


#: Bytes per element of each served dtype; ``auto`` counts as the widest it may resolve to.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 4}


@dataclass(frozen=True)
class EngineSpec:
    """One model copy: what runs (``model``), how it is cut (``parallel``), the pipeline's waits."""

    model: ModelSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    timeouts: PipelineTimeouts = field(default_factory=PipelineTimeouts)

    def max_rank_weight_bytes(self) -> int:
        """The weight bytes of the rank that holds the most (every rank reads only its own)."""
        config = self.model.load_config()
        tp, layers = self.parallel.tensor_parallel_size, config.num_hidden_layers
        dtype_bytes = DTYPE_BYTES[self.model.dtype]
        return max(stage_weight_bytes(config, StageShard(start, end, layers, 0, tp), dtype_bytes)
                   for start, end in layer_ranges(layers, self.parallel.pipeline_parallel_size))

    def startup_timeout_s(self) -> float:
        """How long the stage workers may take to start: ``startup_timeout_s``, or longer where
        reading the largest rank's checkpoint slices at ``weight_read_bytes_per_s`` needs it."""
        floor = self.timeouts.startup_timeout_s
        if self.model.load_format != "auto":
            return floor
        return max(floor, self.max_rank_weight_bytes() / self.timeouts.weight_read_bytes_per_s)
