"""The CPU greedy-sampling reduction in ``cpu/greedy.c`` (torch's argmax does not vectorise on CPU):
each float32 row's first maximum and whether it is all finite."""

from __future__ import annotations

import ctypes
import functools

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, load_optional

GREEDY_SOURCE = SOURCE_DIR / "greedy.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return load_optional(GREEDY_SOURCE, "greedy_available",
                         {"greedy_rows": [ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]}, "torch's argmax")


def fits(logits: torch.Tensor) -> bool:
    """A float32 CPU matrix with contiguous rows, where the kernel built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _library() is not None)


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """``torch.argmax``'s answer for a row without NaN, and whether the row is all finite."""
    lib = _library()
    if lib is None or not fits(logits):
        raise ValueError(f"greedy_rows takes float32 CPU rows where the kernel built: got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.uint8)
    if rows:
        lib.greedy_rows(logits.data_ptr(), rows, vocab, logits.stride(0), tokens.data_ptr(), finite.data_ptr(),
                        torch.get_num_threads())
    return tokens.tolist(), [bool(f) for f in finite.tolist()]
