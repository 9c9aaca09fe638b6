"""Where a pipeline's stage workers go and what they start with: the layout check, each worker's
``WorkerSpec``, the placement group check and failure message, the workers' environment, and their
creation in their stage's bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fastserve.worker.model.config import ModelConfig
from fastserve.worker.nccl import uses_nccl_channels
from fastserve.worker.parallel import BACKENDS, layer_ranges
from fastserve.worker.spec import OMP_WAIT_POLICY_ENV, EngineSpec, PipelineTimeouts
from fastserve.worker.transport import TRANSPORTS
from fastserve.worker.worker import StageWorker, WorkerSpec

CHANNEL_BUFFER_ENV = "RAY_CGRAPH_buffer_size_bytes"


class PlacementError(RuntimeError):
    """The stage workers cannot be placed as asked."""


def check_layout(spec: EngineSpec, config: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first value the pipeline cannot run with."""
    spec.parallel.check(config)
    layer_ranges(config.num_hidden_layers, spec.parallel.pipeline_parallel_size)
    device, par = spec.model.device, spec.parallel
    if device not in BACKENDS:
        raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {device!r}")
    if par.transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {par.transport!r}")
    if device == "cpu" and par.worker_cpus <= 0:
        raise ValueError(f"worker_cpus must be > 0 on CPU (a bundle cannot be empty), got {par.worker_cpus}")
    if par.max_inflight is not None and par.max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {par.max_inflight}")


def worker_specs(spec: EngineSpec, config: ModelConfig) -> list[list[WorkerSpec]]:
    p, t = spec.parallel.pipeline_parallel_size, spec.parallel.tensor_parallel_size
    nccl = uses_nccl_channels(spec.parallel.transport, spec.model.device, p)
    return [[WorkerSpec(spec.model, config, s, p, lo, hi, r, t, nccl) for r in range(t)]
            for s, (lo, hi) in enumerate(layer_ranges(config.num_hidden_layers, p))]


def check_given_group(spec: EngineSpec, pg: PlacementGroup, bundles: list[dict[str, float]],
                      offset: int) -> None:
    """Raise ``PlacementError`` unless ``pg`` holds ``bundles`` (one per stage) from ``offset``."""
    have = pg.bundle_specs
    if len(have) < offset + len(bundles):
        raise PlacementError(
            f"placement group has {len(have)} bundles; the pipeline needs {len(bundles)} stage "
            f"bundles from bundle_offset {offset}, i.e. {offset + len(bundles)} bundles")
    for s, need in enumerate(bundles):
        got = have[offset + s]
        short = {k: v for k, v in need.items() if got.get(k, 0.0) < v}
        if short:
            tp = spec.parallel.tensor_parallel_size
            raise PlacementError(f"placement group bundle {offset + s} (stage {s}) holds {got}; "
                                 f"stage {s} needs {need} for its {tp} TP ranks")


def placement_failure(spec: EngineSpec, bundles: list[dict[str, float]]) -> str:
    """Why the cluster did not place the stage bundles in time, with what it has."""
    par = spec.parallel
    return (f"the cluster cannot place the pipeline (tensor_parallel_size="
            f"{par.tensor_parallel_size} × pipeline_parallel_size={par.pipeline_parallel_size}, "
            f"device {spec.model.device}) within {spec.timeouts.placement_timeout_s}s: it needs "
            f"{len(bundles)} bundles of {bundles[0]} (each stage's TP ranks on one node); the cluster "
            f"has {ray.cluster_resources()} in total, {ray.available_resources()} available")


def worker_runtime_env(timeouts: PipelineTimeouts, environ: Mapping[str, str]) -> dict[str, Any]:
    """The stage workers' ``runtime_env``: the channel size, and the replica's OpenMP wait policy."""
    inherited = {k: environ[k] for k in (OMP_WAIT_POLICY_ENV,) if k in environ}
    return {"env_vars": {**inherited, CHANNEL_BUFFER_ENV: str(timeouts.channel_buffer_bytes)}}


def create_workers(spec: EngineSpec, specs: list[list[WorkerSpec]], pg: PlacementGroup, offset: int,
                   environ: Mapping[str, str]) -> list[list[ActorHandle]]:
    """Start ``specs``' workers, stage s in bundle ``offset + s`` of ``pg``; ``[stage][tp_rank]``."""
    env = worker_runtime_env(spec.timeouts, environ)
    gpus = 1 if spec.model.device == "cuda" else 0
    grid = []
    for s, stage in enumerate(specs):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=offset + s)
        grid.append([StageWorker.options(  # type: ignore[attr-defined]
            num_cpus=spec.parallel.worker_cpus, num_gpus=gpus, scheduling_strategy=strategy,
            runtime_env=env, max_restarts=0).remote(ws) for ws in stage])
    return grid
