"""Structured outputs' grammar masks on CPU logits, in ``fastserve/kernels/cpu/token_mask.c``: built,
loaded and called.

Owns ``mask_rows``: the named rows of float32 CPU logits get -inf wherever their packed mask
(one bit per token, little-endian 32-bit words) disallows the token, in place, and each masked
row's greedy token comes back. Why C: see the C file. Where no compiler is found it is
unavailable and the sampler keeps torch's ``masked_fill_``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np
import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, load_optional

TOKEN_MASK_SOURCE = SOURCE_DIR / "token_mask.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signature: list[type] = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    return load_optional(TOKEN_MASK_SOURCE, "token_mask_available", {"mask_rows": signature}, "torch's masked_fill_")


def fits(logits: torch.Tensor) -> bool:
    """A float32 CPU matrix with contiguous rows, where the kernel built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _library() is not None)


def mask_rows(logits: torch.Tensor, rows: Sequence[int], packed: np.ndarray) -> tuple[list[bool], list[int]]:
    """Row ``rows[i]`` of ``logits`` masked by ``packed[i]`` (uint8 [len(rows), 4 * words]) in
    place; whether each row's mask allows any token, and each row's first maximum after it
    (``torch.argmax``'s answer for a row without NaN). ``fits(logits)`` must hold."""
    lib = _library()
    if lib is None or not fits(logits):
        raise ValueError(f"mask_rows takes float32 CPU rows where the kernel built: got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    if packed.shape[1] % 4:
        raise ValueError(f"a mask is whole 32-bit words; got rows of {packed.shape[1]} bytes")
    masks = np.ascontiguousarray(packed)
    ids = np.asarray(rows, dtype=np.int64)
    allowed = np.zeros(len(rows), dtype=np.uint8)
    tokens = np.zeros(len(rows), dtype=np.int64)
    lib.mask_rows(logits.data_ptr(), logits.stride(0), logits.shape[1], ids.ctypes.data, len(rows),
                  masks.ctypes.data, masks.shape[1] // 4, allowed.ctypes.data, tokens.ctypes.data,
                  torch.get_num_threads())
    return [bool(a) for a in allowed], tokens.tolist()
