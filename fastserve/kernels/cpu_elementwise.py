"""The CPU bf16 elementwise kernels in ``cpu/elementwise_bf16.c`` (RMSNorm with the residual add,
SwiGLU, rotary) and which tensors they take (``fits_*``); unavailable without AVX-512 BF16."""

from __future__ import annotations

import ctypes
import functools

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, KernelBuildError, load_optional

ELEMENTWISE_SOURCE = SOURCE_DIR / "elementwise_bf16.c"
#: The rotary kernel's half head: a whole number of 16-lane registers.
ROTARY_HALF_MULTIPLE = 16


@functools.cache
def _library() -> ctypes.CDLL | None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    return load_optional(ELEMENTWISE_SOURCE, "elementwise_bf16_available", {
        "rms_norm_bf16": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32],
        "silu_mul_bf16": [ptr, i64, ptr, i64, ptr, i64, i64, i32],
        "rope_bf16": [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i32],
    }, "torch's ops")


def available() -> bool:
    return _library() is not None


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    """CPU bf16 matrices whose rows are contiguous runs (any row stride)."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1
               for t in tensors)


def fits_rms_norm(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> bool:
    """``x`` [rows, hidden] (and ``delta`` of its shape) with contiguous rows, a contiguous
    ``weight`` [hidden], all bf16 on the CPU, on a machine where the kernels built."""
    return (_bf16_rows(x) and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape == (x.shape[1],) and weight.is_contiguous()
            and (delta is None or (_bf16_rows(delta) and delta.shape == x.shape)) and available())


def fits_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """``gate`` and ``up`` [rows, width] bf16 CPU matrices with contiguous rows (views of one
    merged projection's output do), where the kernels built."""
    return _bf16_rows(gate, up) and gate.shape == up.shape and available()


def fits_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """``x`` [tokens, heads, head_dim] with each token's heads one contiguous run (a view of a
    merged projection's output is), ``cos``/``signed_sin`` contiguous [tokens, 1, head_dim], all
    bf16 on the CPU, head_dim a multiple of 32, where the kernels built."""
    if x.dim() != 3 or cos.shape != (x.shape[0], 1, x.shape[2]) or signed_sin.shape != cos.shape:
        return False
    tensors = (x, cos, signed_sin)
    return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors)
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous() and signed_sin.is_contiguous()
            and x.shape[2] % (2 * ROTARY_HALF_MULTIPLE) == 0 and available())


def library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelBuildError("the CPU bf16 elementwise kernels are not available on this machine")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not fits_rms_norm(x, weight, delta):
        given = "" if delta is None else f", delta {tuple(delta.shape)} {delta.dtype}"
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
                         f"{given} do not fit the kernel")
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    total = x if delta is None else torch.empty(rows, cols, dtype=torch.bfloat16)
    if rows:
        library().rms_norm_bf16(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                             0 if delta is None else delta.stride(0), None if delta is None else total.data_ptr(),
                             weight.data_ptr(), out.data_ptr(), rows, cols, float(eps), torch.get_num_threads())
    return total, out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not fits_silu_mul(gate, up):
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "do not fit the kernel")
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    if rows:
        library().silu_mul_bf16(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
                             rows, cols, torch.get_num_threads())
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    if not fits_rotary(x, cos, signed_sin):
        raise ValueError(f"rotate: x {tuple(x.shape)} {x.dtype} {x.stride()}, cos {tuple(cos.shape)} "
                         "do not fit the kernel")
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16)
    if tokens:
        library().rope_bf16(x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), signed_sin.data_ptr(),
                         out.data_ptr(), tokens, torch.get_num_threads())
    return out
