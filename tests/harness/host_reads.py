"""Counting a block's transfers that make the host wait for the device, in both directions.

- Reads: a tensor's values back to the host (``.tolist()``, ``.item()``, ``int(t)``, ``.cpu()``,
  a copy from a device tensor into host memory that is not a non-blocking copy into page-locked
  memory, ...). On a GPU each stalls the host until the device has caught up.
- Writes: host data made or copied onto a device (``torch.tensor(list, device=...)``, ``.to(device)``,
  ``.cuda()``, ``device_tensor.copy_(host_tensor)``) unless the source is page-locked and the copy
  ``non_blocking``: from pageable memory the copy is synchronous for the host.

A torch-function mode sees every one of these calls on any device, so the same count holds on the
CPU (tests/unit, where a CPU tensor's ``.tolist()`` still counts and a "device" is any non-CPU one,
``meta`` included) and on a GPU (tests/gpu).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Functions that make a tensor from host data, with a ``device`` argument.
FACTORIES = frozenset({"tensor", "as_tensor", "asarray"})


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        return torch.device(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _on_device(device: torch.device | None) -> bool:
    return device is not None and device.type != "cpu"


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """Where ``Tensor.to(...)`` / ``.cuda(...)`` sends its tensor (None: stays where it is)."""
    if "device" in kwargs:
        return _device_of(kwargs["device"])
    for value in args[1:]:
        device = _device_of(value)
        if device is not None:
            return device
    return None


class HostReads(TorchFunctionMode):
    """Counts the calls that make the host wait on a transfer: ``reads`` (device → host) and
    ``writes`` (host → device); ``count`` is both, ``names`` says which calls. With
    ``device_only`` a value read of a CPU tensor (staging memory the step fills itself) is not a
    read; without it every one counts, which lets a CPU test stand in for a GPU."""

    READS = frozenset({"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"})

    def __init__(self, device_only: bool = False) -> None:
        super().__init__()
        self.device_only = device_only
        self.reads = 0
        self.writes = 0
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return self.reads + self.writes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS:
            if not (self.device_only and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
                self._read(name)
        elif name in FACTORIES and _on_device(_device_of(kwargs.get("device"))):
            self._write(f"{name}(device=...)")
        elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
            self._moved(name, args[0], _to_target(args, kwargs) if name == "to" else torch.device("cuda"),
                        bool(kwargs.get("non_blocking", False)))
        elif name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            blocking = not (kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]))
            self._copied(args[0], args[1], blocking)
        return func(*args, **kwargs)

    def _read(self, name: str) -> None:
        self.reads += 1
        self.names.append(name)

    def _write(self, name: str) -> None:
        self.writes += 1
        self.names.append(name)

    def _moved(self, name: str, tensor: torch.Tensor, target: torch.device | None, non_blocking: bool) -> None:
        if target is None or target.type == tensor.device.type:
            return
        if tensor.device.type == "cpu" and _on_device(target):
            if not (non_blocking and tensor.is_pinned()):
                self._write(f"{name}(host->device)")
        elif target.type == "cpu":
            self._read(f"{name}(device->host)")

    def _copied(self, dst: torch.Tensor, src: torch.Tensor, blocking: bool) -> None:
        if src.device.type == "cpu" and _on_device(dst.device) and (blocking or not src.is_pinned()):
            self._write("copy_(host->device)")
        elif _on_device(src.device) and dst.device.type == "cpu" and (blocking or not dst.is_pinned()):
            self._read("copy_(device->host)")


def host_reads(fn: Callable[[], Any]) -> int:
    """How many waiting transfers (reads and writes) ``fn()`` makes."""
    with HostReads() as mode:
        fn()
    return mode.count
