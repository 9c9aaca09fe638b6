"""Sampling's inverse-CDF draw on CPU float32 probabilities, in ``cpu/draw.c``: built, loaded and
called. Why C: see the C file. Where no compiler is found it is unavailable and the sampler keeps
torch's float64 ``cumsum`` and ``searchsorted`` (the same tokens)."""

from __future__ import annotations

import ctypes
import functools

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, load_optional

DRAW_SOURCE = SOURCE_DIR / "draw.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib = load_optional(DRAW_SOURCE, "draw_available",
                        {"draw_rows": [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]},
                        "torch's cumsum and searchsorted")
    if lib is not None:
        lib.draw_block.restype = i64
    return lib


def fits(probs: torch.Tensor) -> bool:
    """A float32 CPU matrix with contiguous rows, where the kernel built."""
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
            and probs.stride(1) == 1 and _library() is not None)


def draw_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first index whose float64 running sum passes ``uniforms[row] * total`` or reaches
    the total, and whether its total is finite and positive (``sampler.draw_rows``'s contract)."""
    lib = _library()
    if lib is None or not fits(probs):
        raise ValueError(f"draw_rows takes float32 CPU rows where the kernel built: got "
                         f"{probs.dtype} {tuple(probs.shape)} on {probs.device}")
    rows, vocab = probs.shape
    if uniforms.shape != (rows,):
        raise ValueError(f"draw_rows takes one variate per row: {tuple(uniforms.shape)} for {rows} rows")
    u = uniforms.to(torch.float64).contiguous()
    tokens = torch.zeros(rows, dtype=torch.int64)
    ok = torch.zeros(rows, dtype=torch.bool)
    if rows and vocab:
        block = int(lib.draw_block())
        scratch = torch.empty(rows * -(-vocab // block), dtype=torch.float64)
        lib.draw_rows(probs.data_ptr(), rows, vocab, probs.stride(0), u.data_ptr(), scratch.data_ptr(),
                      tokens.data_ptr(), ok.data_ptr(), torch.get_num_threads())
    return tokens, ok
