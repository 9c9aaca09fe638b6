"""What one model copy runs and how it is cut: ``EngineSpec`` = ``ModelSpec`` + ``ParallelSpec`` +
``PipelineTimeouts``, built once from the config and passed whole to executors and stage workers.
Stdlib only (picklable dataclasses), so ``fastserve.config`` builds it without the data plane.
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

#: libgomp reads it once as torch loads: a model process needs it in its environment from the start.
OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
DERIVED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


@dataclass(frozen=True)
class ModelSpec:
    """The model, its weights, and its KV pools; ``model`` is a config folder or a ``ModelConfig``."""

    model: str | Path | ModelConfig
    num_device_blocks: int
    num_host_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    load_format: str = "dummy"
    model_path: str | None = None
    torch_threads: int | None = None
    #: CUDA only; a step beyond the captured batch or context runs eagerly.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    cuda_graph_max_context: int = 8192
    #: ``fixed`` here so a model built directly (tests, tools) takes the same paths every run.
    gemm_choice: str = "fixed"
    #: A job's greedy tokens independent of what shares its batch (``engine.batch_invariant``).
    batch_invariant: bool = False

    def load_config(self) -> ModelConfig:
        return as_model_config(self.model)


@dataclass(frozen=True)
class ParallelSpec:
    """How one model copy is cut (TP × PP) and how plans travel; also the config's ``parallel:``."""

    tensor_parallel_size: Annotated[int, Ge(1)] = 1
    pipeline_parallel_size: Annotated[int, Ge(1)] = 1
    #: A Ray compiled graph, or plain actor calls.
    transport: Literal["compiled", "actor"] = "compiled"
    #: Plans kept in flight; None = one per stage (paper §4.3).
    max_inflight: Annotated[int, Ge(1)] | None = None
    #: Per TP rank; a bundle must reserve something, and a sliver keeps a small node schedulable.
    worker_cpus: Annotated[float, Gt(0)] = 0.01
    #: Run stage-worker actors (the Ray pipeline) even for TP·PP = 1.
    use_ray_pipeline: bool = False
    #: Custom resources per stage bundle, e.g. ``[{node_a: 0.001}, {node_b: 0.001}]`` to pin stages.
    stage_resources: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
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
        """Raise ``ValueError`` if the model cannot be cut this way."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        if t < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {t}")
        if p < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {p}")
        config.check_tensor_parallel(t)
        if p > config.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={p} exceeds the model's {config.num_hidden_layers} layers")

    def stage_bundles(self, device: str) -> list[dict[str, float]]:
        """One placement-group bundle per stage (one node), holding its TP ranks."""
        t = self.tensor_parallel_size
        bundle: dict[str, float] = {}
        if self.worker_cpus > 0:
            bundle["CPU"] = self.worker_cpus * t
        if device == "cuda":
            bundle["GPU"] = float(t)
        extra = self.stage_resources or [{} for _ in range(self.pipeline_parallel_size)]
        return [{**bundle, **resources} for resources in extra]


#: Above the largest activation message, or Ray resizes the channel and ``teardown`` hangs.
DEFAULT_CHANNEL_BUFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PipelineTimeouts:
    """The Ray pipeline's waits and channel size: the config's ``pipeline:`` section (docs/configs.md)."""

    channel_buffer_bytes: Annotated[int, Ge(1024)] = DEFAULT_CHANNEL_BUFFER_BYTES
    placement_timeout_s: Annotated[float, Gt(0)] = 60.0
    startup_timeout_s: Annotated[float, Gt(0)] = 300.0
    weight_read_bytes_per_s: Annotated[float, Gt(0)] = 200e6
    tp_timeout_s: Annotated[float, Gt(0)] = 120.0
    liveness_interval_s: Annotated[float, Gt(0)] = 1.0
    ping_timeout_s: Annotated[float, Gt(0)] = 5.0
    unresponsive_s: Annotated[float, Gt(0)] = 60.0
    diagnose_s: Annotated[float, Ge(0)] = 5.0
    teardown_timeout_s: Annotated[float, Gt(0)] = 15.0


#: Bytes per element of each served dtype; ``auto`` counts as the widest it may resolve to.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 4}


@dataclass(frozen=True)
class EngineSpec:
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
        """``startup_timeout_s``, or the largest rank's read time if longer."""
        floor = self.timeouts.startup_timeout_s
        if self.model.load_format != "auto":
            return floor
        return max(floor, self.max_rank_weight_bytes() / self.timeouts.weight_read_bytes_per_s)
