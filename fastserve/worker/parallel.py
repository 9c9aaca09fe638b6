"""How a model is cut for serving: layer ranges per pipeline stage, and one stage's TP group.

``layer_ranges`` splits the decoder layers evenly over the pipeline stages (the first stages take
one more layer when the split is uneven); ``device_name``, ``explicit_device`` and
``cuda_device_index`` say which device a worker's tensors, streams and pools live on.
``TensorParallelGroup`` wraps the ``torch.distributed`` process group that the tensor-parallel
ranks of one stage share — gloo on CPU, NCCL on GPU — and hands the model the all-reduce its
row-parallel layers need, and the stage worker the all-gather that rebuilds the hidden states it
receives in 1/TP parts. Each stage worker is its own process, so a stage's group is that
process's default group.

torch is imported lazily: the pipeline's driver side imports this module for ``layer_ranges`` and
must not pay for torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def layer_ranges(num_layers: int, pipeline_parallel_size: int) -> list[tuple[int, int]]:
    """``[layer_start, layer_end)`` of every stage, in order, covering all ``num_layers`` layers."""
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
    """The torch device a worker makes its tensors, streams and pools on: ``cuda:{index}`` on a
    GPU, never the bare ``cuda``, which means whichever device is current on the calling thread
    (Ray runs compiled-graph steps on a thread of its own, where none was set); ``cpu`` on a CPU."""
    if kind not in BACKENDS:
        raise ValueError(f"device must be one of {sorted(BACKENDS)}, got {kind!r}")
    if index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    return f"cuda:{index}" if kind == "cuda" else "cpu"


def explicit_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes the device current on this thread now,
    so that what is made for it later (streams, buffers) stays there, whichever thread makes it."""
    import torch

    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def cuda_device_index(gpu_ids: Sequence[int | str], visible_devices: str | None) -> int:
    """This process's CUDA device index for the first GPU Ray assigned it (``ray.get_gpu_ids()``).

    Ray normally hides the other GPUs (``CUDA_VISIBLE_DEVICES`` lists the assigned ones), so the
    index is the assigned id's place in that list; where nothing hides them (unset), it is the
    id itself."""
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
    """One stage's tensor-parallel process group, seen from one rank.

    On CUDA the rank's device is made current (``torch.cuda.set_device``) when the group object is
    made, before the worker builds its model, and is handed to ``init_process_group`` as
    ``device_id``: NCCL then binds the communicator to that device at once instead of guessing
    it from the current device later (which, with every GPU visible, is device 0 for all ranks)."""

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
        """Extra ``init_process_group`` arguments: the rank's device on CUDA, none on CPU."""
        if self.device != "cuda":
            return {}
        import torch

        return {"device_id": torch.device("cuda", self.device_index)}

    @property
    def initialized(self) -> bool:
        import torch.distributed as dist

        return self.world_size == 1 or dist.is_initialized()

    def init(self, master_addr: str, port: int, world_size: int, rank: int, timeout_s: float) -> None:
        """Join the group; blocks until all ``world_size`` ranks have called it (or ``timeout_s``)."""
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"tp rank {rank} outside world_size {world_size}")
        self.world_size, self.rank = world_size, rank
        if world_size == 1:
            return  # a single rank reduces nothing: no group, no rendezvous
        # timeout= matters: gloo's default is 30 minutes, so a rank whose peer died would hang.
        dist.init_process_group(self.backend, init_method=f"tcp://{master_addr}:{port}",
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s),
                                **self.process_group_options())

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``part`` (same shape on each) concatenated along dim 0 in rank order, on
        every rank."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return part
        out = torch.empty((self.world_size * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        dist.all_gather_single(out, part)
        return out

    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable the model's row-parallel layers use: sum in place over the group."""

        def reduce(x: torch.Tensor) -> torch.Tensor:
            import torch.distributed as dist

            if self.world_size > 1:
                dist.all_reduce(x)
            return x

        return reduce
