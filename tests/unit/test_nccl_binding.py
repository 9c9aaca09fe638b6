"""A GPU pipeline whose compiled graph needs Ray's NCCL channels checks for CuPy's NCCL binding in
each stage worker as it starts (``fastserve.worker.nccl``), after importing torch and before reading
a weight, and fails naming the module; the Engine replica that builds the pipeline, which holds no
GPU and has not loaded torch, does not check. The binding's absence is simulated here (this
machine has no CuPy)."""

from __future__ import annotations

import sys
import types

import pytest

from fastserve.config import AppArgs
from fastserve.worker.nccl import NCCL_BINDING, check_nccl_binding, uses_nccl_channels
from fastserve.worker.pipeline import PipelineExecutor
from fastserve.worker.placement import worker_specs
from fastserve.worker.spec import EngineSpec
from fastserve.worker.worker import StageWorker, WorkerSpec
from tests.harness.app_config import demo_args


def gpu_pipeline_spec(transport: str) -> EngineSpec:
    args = demo_args()
    args["model"]["device"] = "cuda"
    args["parallel"].update(pipeline_parallel_size=2, num_gpus=2, transport=transport, use_ray_pipeline=True)
    args["profile"]["path"] = "config/profiles/opt-125m-gpu-tp1-pp2.json"   # not measured: waived
    args["drain"] = {"tpot_s": 0.01}
    return AppArgs.model_validate(args, context={"require_profile": False}).engine_spec()


def test_only_a_compiled_graph_between_gpu_stages_uses_nccl_channels() -> None:
    assert uses_nccl_channels("compiled", "cuda", 2)
    assert not uses_nccl_channels("compiled", "cuda", 1)
    assert not uses_nccl_channels("compiled", "cpu", 2)
    assert not uses_nccl_channels("actor", "cuda", 2)


def test_a_missing_binding_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, NCCL_BINDING, None)   # import of it fails, as without CuPy
    with pytest.raises(RuntimeError) as failed:
        check_nccl_binding()
    message = str(failed.value)
    assert "need cupy.cuda.nccl (CuPy's NCCL binding); importing it failed" in message
    assert "pip install -e '.[gpu]'" in message and "parallel.transport: actor" in message


def test_a_binding_without_libnccl_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    unloaded = types.ModuleType(NCCL_BINDING)
    unloaded.available = False   # type: ignore[attr-defined]   # what CuPy sets when libnccl fails to load
    monkeypatch.setitem(sys.modules, NCCL_BINDING, unloaded)
    with pytest.raises(RuntimeError, match=r"cupy\.cuda\.nccl is installed but could not load libnccl"):
        check_nccl_binding()
    loaded = types.ModuleType(NCCL_BINDING)
    loaded.available = True   # type: ignore[attr-defined]
    loaded.get_unique_id = lambda: b"id"   # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, NCCL_BINDING, loaded)
    check_nccl_binding()


def test_the_replica_builds_a_gpu_pipeline_without_the_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's constructor makes no Ray call and no check: the replica may lack CuPy."""
    monkeypatch.setitem(sys.modules, NCCL_BINDING, None)
    PipelineExecutor(gpu_pipeline_spec("compiled"), None)


@pytest.mark.parametrize(("transport", "needed"), [("compiled", True), ("actor", False)])
def test_each_worker_of_a_compiled_gpu_pipeline_is_told_to_check(transport: str, needed: bool) -> None:
    spec = gpu_pipeline_spec(transport)
    grid = worker_specs(spec, spec.model.load_config())
    assert [[ws.nccl_channels for ws in stage] for stage in grid] == [[needed], [needed]]


def test_a_worker_without_the_binding_fails_before_reading_a_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check comes first in the worker's constructor: its error, not a later one, names the
    cause (the model build is made to fail loudly here, and is never reached)."""
    monkeypatch.setitem(sys.modules, NCCL_BINDING, None)
    monkeypatch.setattr("fastserve.worker.worker._build_runner", _never)
    spec = gpu_pipeline_spec("compiled")
    first: WorkerSpec = worker_specs(spec, spec.model.load_config())[0][0]
    body = StageWorker.__ray_metadata__.modified_class   # the class Ray runs in the actor
    with pytest.raises(RuntimeError, match=r"need cupy\.cuda\.nccl"):
        body(first)


def _never(*args: object) -> None:
    raise AssertionError("weights were loaded before the NCCL binding was checked")
