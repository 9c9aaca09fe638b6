"""How a model is cut for serving: layer ranges per pipeline stage, the device a worker uses, and
one stage's TP group (gloo on CPU, NCCL on GPU; the process's default group). torch is imported
lazily: the pipeline's driver imports this for ``layer_ranges``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def layer_ranges(num_layers: int, pipeline_parallel_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every stage; the first stages take one more when uneven."""
    if pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
    if num_layers < pipeline_parallel_size:
        raise ValueError(f"cannot split {num_layers} layers over pipeline_parallel_size="
                         f"{pipeline_parallel_size} stages (each stage needs at least one layer)")
    base, extra = divmod(num_layers, pipeline_parallel_size)
    ranges, start = [], 0
    for stage in range(pipeline_parallel_size):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def device_name(kind: str, index: int) -> str:
    """A worker's device: ``cuda:{index}``, never a bare ``cuda`` (Ray runs compiled-graph steps
    on its own thread, where no device is current)."""
    if kind not in BACKENDS:
        raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {kind!r}")
    if index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    return f"cuda:{index}" if kind == "cuda" else "cpu"


def explicit_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes the one current on this thread now."""
    import torch

    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def cuda_device_index(gpu_ids: Sequence[int | str], visible_devices: str | None) -> int:
    """Ray's first assigned GPU's place in ``CUDA_VISIBLE_DEVICES`` (the id itself if unset)."""
    if not gpu_ids:
        raise ValueError("no GPU is assigned to this process (ray.get_gpu_ids() is empty)")
    first = str(gpu_ids[0])
    if visible_devices is None:
        return int(first)
    visible = [d.strip() for d in visible_devices.split(",") if d.strip()]
    if first not in visible:
        raise ValueError(f"GPU {first} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
    return visible.index(first)


class TensorParallelGroup:
    """One stage's tensor-parallel process group, seen from one rank. On CUDA the rank's device is
    set at once and passed as ``device_id``, else NCCL may guess device 0 for every rank."""

    def __init__(self, device: str, device_index: int = 0) -> None:
        if device not in BACKENDS:
            raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {device!r}")
        if device_index < 0:
            raise ValueError(f"device_index must be >= 0, got {device_index}")
        self.backend = BACKENDS[device]
        self.device = device
        self.device_index = device_index
        self.world_size = 1
        self.rank = 0
        if device == "cuda":
            import torch

            torch.cuda.set_device(device_index)

    def process_group_options(self) -> dict[str, Any]:
        if self.device != "cuda":
            return {}
        import torch

        return {"device_id": torch.device("cuda", self.device_index)}

    @property
    def initialized(self) -> bool:
        import torch.distributed as dist

        return self.world_size == 1 or dist.is_initialized()

    def init(self, master_addr: str, port: int, world_size: int, rank: int, timeout_s: float) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"tp rank {rank} outside world_size {world_size}")
        self.world_size, self.rank = world_size, rank
        if world_size == 1:
            return
        # gloo's default timeout is 30 minutes: a rank whose peer died would hang that long.
        dist.init_process_group(self.backend, init_method=f"tcp://{master_addr}:{port}",
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s),
                                **self.process_group_options())

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``part`` (same shape) concatenated along dim 0 in rank order."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return part
        out = torch.empty((self.world_size * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        dist.all_gather_single(out, part)
        return out

    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """For the row-parallel layers: sum in place over the group."""

        def reduce(x: torch.Tensor) -> torch.Tensor:
            import torch.distributed as dist

            if self.world_size > 1:
                dist.all_reduce(x)
            return x

        return reduce
