"""The in-process executor: the whole model, KV store and sampler in this process, one plan at a time
(no pipeline configured, the profiler, the GPU checks, tests). A plan names every block and swap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker.graphs import GraphSettings
from fastserve.worker.kv_store import KVStore
from fastserve.worker.messages import BatchPlan, StepOutput
from fastserve.worker.model.config import ModelConfig
from fastserve.worker.model.gemm_choice import GemmPolicy
from fastserve.worker.model.opt import AllReduce
from fastserve.worker.model.registry import Stage, build_model
from fastserve.worker.model.shard import StageShard
from fastserve.worker.model.weights import load_stage_weights
from fastserve.worker.parallel import device_name
from fastserve.worker.sampler import Sampler
from fastserve.worker.spec import ModelSpec
from fastserve.worker.stage import StageRunner

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: The config's dtype that picks one per machine (``resolve_dtype``).
AUTO_DTYPE = "auto"


def resolve_dtype(name: str, device: str) -> str:
    """``name``, or for ``auto`` the fastest at full quality here: bfloat16 where the CPU or GPU has it
    natively, else float32 on a CPU (emulated bf16 is slower) and float16 on a GPU."""
    if name != AUTO_DTYPE:
        torch_dtype(name)   # refuse an unknown name here, naming it
        return name
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or {AUTO_DTYPE!r}, got {name!r}") from None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype set to ``dtype`` for the block (new parameters take it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_stage(config: ModelConfig, shard: StageShard, dtype: str, device: str,
                load_format: str, model_path: str | None, seed: int,
                all_reduce: AllReduce | None = None, gemm: GemmPolicy | None = None) -> Stage:
    """Build one stage of ``config``'s architecture on ``device`` and load its weights (dummy or
    checkpoint); its CPU linears are packed on the GEMM paths ``gemm`` chooses."""
    target = torch_dtype(resolve_dtype(dtype, device))
    # Built where it runs and in its dtype, never first in fp32 on the CPU.
    with torch.device(device), default_dtype(target):
        stage = build_model(config, shard, all_reduce)
    load_stage_weights(stage, load_format, model_path, seed)
    stage = stage.to(device=device, dtype=target).eval()
    stage.pack_linear_weights(gemm)   # CPU float32, or bfloat16 where native; a no-op elsewhere
    return stage


def build_runner(spec: ModelSpec, config: ModelConfig, shard: StageShard,
                 all_reduce: AllReduce | None = None, device_index: int = 0) -> StageRunner:
    """One worker's ``StageRunner`` (its model shard, KV slice and sampler) on device ``device_index``
    of ``spec.device``, for the in-process executor and the Ray stage workers alike."""
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)   # per process: this worker owns the model's
    device = device_name(spec.device, device_index)
    if spec.device == "cuda":   # what CUDA makes implicitly here (a context, pinned pages) is ours too
        torch.cuda.set_device(device)
    model = build_stage(config, shard, spec.dtype, device, spec.load_format, spec.model_path,
                        spec.seed, all_reduce, GemmPolicy(spec.gemm_choice, spec.batch_invariant))
    kv = KVStore(shard.num_layers, model.num_local_kv_heads, config.head_dim, spec.block_size,
                 spec.num_device_blocks, spec.num_host_blocks, torch_dtype(resolve_dtype(spec.dtype, device)),
                 device)
    graphs = GraphSettings(spec.cuda_graphs, spec.cuda_graph_max_batch, spec.cuda_graph_max_context)
    return StageRunner(model, kv, Sampler(spec.seed), graphs)


class InProcessExecutor:
    """Executes ``BatchPlan``s on one process's model; ``execute`` is synchronous."""

    max_inflight = 1

    def __init__(self, spec: ModelSpec, device_index: int | None = None) -> None:
        """``device_index``: the CUDA device the model lives on (None: the one current on this
        thread as it is built; 0 on a CPU)."""
        self.spec = spec
        self.config = spec.load_config()
        if device_index is None:
            device_index = torch.cuda.current_device() if spec.device == "cuda" else 0
        self.runner = build_runner(spec, self.config, StageShard.whole(self.config), device_index=device_index)
        self.steps = 0

    @property
    def kv(self) -> KVStore:
        return self.runner.kv

    @property
    def model(self) -> Stage:
        return self.runner.model

    def execute(self, plan: BatchPlan) -> StepOutput:
        result = self.runner.run(plan, None, sample=True)
        self.steps += 1
        return StepOutput(plan.step_id, result.tokens, result.timings, result.logprobs, result.prompt_logprobs)

    def close(self) -> None:
        self.kv.close()
