"""The in-process executor: the whole model in this process, one plan at a time.

Used by the scheduler's engine loop when no pipeline is configured, by the profiler, by the GPU
checks (which run without Ray) and by tests. It owns the model, the KV store and the sampler; a
plan names every block and swap, so the executor never decides anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from actors.kv_store import KVStore
from actors.messages import BatchPlan, SamplingParams, StepOutput, validate_request
from actors.model.config import ModelConfig, as_model_config
from actors.model.opt import AllReduce
from actors.model.registry import Stage, build_model
from actors.model.shard import StageShard
from actors.model.weights import load_stage_weights
from actors.sampler import Sampler
from actors.stage import StageRunner

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def build_stage(config: ModelConfig, shard: StageShard, dtype: str, device: str,
                load_format: str, model_path: str | None, seed: int,
                all_reduce: AllReduce | None = None) -> Stage:
    """Build one stage of ``config``'s architecture on ``device`` and load its weights (dummy or
    checkpoint)."""
    stage = build_model(config, shard, all_reduce)
    load_stage_weights(stage, load_format, model_path, seed)
    stage = stage.to(device=device, dtype=torch_dtype(dtype)).eval()
    stage.pack_linear_weights()   # CPU float32 only; a no-op elsewhere
    return stage


class InProcessExecutor:
    """Executes ``BatchPlan``s on one process's model; ``execute`` is synchronous."""

    max_inflight = 1

    def __init__(
        self,
        model: str | Path | ModelConfig,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int = 16,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        load_format: str = "dummy",
        model_path: str | None = None,
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)   # per process: this executor owns the model's
        self.config = as_model_config(model)
        shard = StageShard.whole(self.config)
        stage = build_stage(self.config, shard, dtype, device, load_format, model_path, seed)
        kv = KVStore(self.config.num_hidden_layers, stage.num_local_kv_heads,
                     self.config.head_dim, block_size, num_device_blocks, num_host_blocks,
                     torch_dtype(dtype), device)
        self.runner = StageRunner(stage, kv, Sampler(seed))
        self.steps = 0

    @property
    def kv(self) -> KVStore:
        return self.runner.kv

    @property
    def model(self) -> Stage:
        return self.runner.model

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        validate_request(prompt_ids, sampling, self.config.vocab_size,
                         self.config.max_position_embeddings)

    def execute(self, plan: BatchPlan) -> StepOutput:
        result = self.runner.run(plan, None, sample=True)
        self.steps += 1
        return StepOutput(plan.step_id, result.tokens, result.timings)

    def close(self) -> None:
        self.kv.close()
