"""Counting a block's host reads of tensor values (``.tolist()``, ``.item()``, ``int(t)``, ...).

On a GPU each such read stalls the host until the device has caught up. A torch-function mode
sees every one of these calls on any device, so the same count holds on the CPU (tests/unit) and
on a GPU (tests/gpu).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that read a tensor's values back to the host."""

    READS = frozenset({"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def host_reads(fn: Callable[[], Any]) -> int:
    """How many host reads ``fn()`` makes."""
    with HostReads() as mode:
        fn()
    return mode.count
