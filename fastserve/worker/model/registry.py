"""``build_model``: the one place that maps a model config's architecture to its stage class."""

from __future__ import annotations

from fastserve.worker.model.config import ModelConfig, OPTConfig
from fastserve.worker.model.gemma3 import Gemma3Stage
from fastserve.worker.model.gemma3_config import Gemma3Config
from fastserve.worker.model.llama import LlamaStage
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.model.opt import AllReduce, OPTStage
from fastserve.worker.model.shard import StageShard

#: A served stage module of any architecture (what ``StageRunner`` runs).
Stage = OPTStage | LlamaStage | Gemma3Stage


def build_model(config: ModelConfig, shard: StageShard, all_reduce: AllReduce | None = None) -> Stage:
    """An unloaded stage module of ``config``'s architecture for ``shard``."""
    if isinstance(config, OPTConfig):
        return OPTStage(config, shard) if all_reduce is None else OPTStage(config, shard, all_reduce)
    if isinstance(config, LlamaConfig):
        return LlamaStage(config, shard) if all_reduce is None else LlamaStage(config, shard, all_reduce)
    if isinstance(config, Gemma3Config):
        return Gemma3Stage(config, shard) if all_reduce is None else Gemma3Stage(config, shard, all_reduce)
    raise TypeError(f"no model code for architecture {config.architecture!r} ({type(config).__name__})")
