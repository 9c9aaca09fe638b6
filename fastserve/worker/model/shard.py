"""``StageShard``: the slice of a model one worker holds, a layer range and a tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass

from fastserve.worker.model.config import ModelConfig


@dataclass(frozen=True)
class StageShard:
    layer_start: int
    layer_end: int
    num_layers_total: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def whole(cls, config: ModelConfig) -> StageShard:
        return cls(0, config.num_hidden_layers, config.num_hidden_layers)

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.num_layers_total

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def check(self, config: ModelConfig) -> None:
        if not 0 <= self.layer_start < self.layer_end <= config.num_hidden_layers:
            raise ValueError(
                f"layer range [{self.layer_start}, {self.layer_end}) is outside the model's "
                f"{config.num_hidden_layers} layers"
            )
        config.check_tensor_parallel(self.tp_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tensor_parallel_size {self.tp_size}")
