"""The CPU bf16 linear kernel in ``cpu/linear_bf16.c``: its weight layout (``pack``, once per weight)
and the call (``F.linear``'s contract). Why our own: the C file's note (it streams a decode step's
weights faster than oneDNN). Unavailable without AVX-512 BF16: the model keeps oneDNN's GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, KernelBuildError, build

LINEAR_SOURCE = SOURCE_DIR / "linear_bf16.c"
#: NB in the C file and its task of two blocks: N a multiple of the task, K of the bf16 pair.
OUTPUT_BLOCK = 16
OUTPUT_MULTIPLE = 2 * OUTPUT_BLOCK
K_MULTIPLE = 2
#: ``PATH_*`` in the C file; ``UNIFORM`` and ``AMX`` give row sums independent of the row count.
DPBF16, UNIFORM, AMX = 0, 1, 2
PATH_NAMES = {DPBF16: "dpbf16", UNIFORM: "dpbf16_uniform", AMX: "amx"}
AMX_K_MULTIPLE = 32

_log = logging.getLogger(__name__)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build(LINEAR_SOURCE)))
    except (KernelBuildError, OSError, subprocess.TimeoutExpired) as exc:
        _log.warning("CPU bf16 linear kernel unavailable, using oneDNN: %s", exc)
        return None
    lib.linear_bf16_available.restype = ctypes.c_int
    if not lib.linear_bf16_available():
        _log.info("the C compiler does not target AVX-512 BF16 here: bf16 linears stay on oneDNN")
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.linear_bf16_pack.argtypes = [ptr, i64, i64, ptr]
    lib.linear_bf16_pack.restype = None
    lib.linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i32, i32]
    lib.linear_bf16.restype = None
    lib.linear_bf16_widened.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i32, i32]
    lib.linear_bf16_widened.restype = None
    lib.linear_bf16_swiglu.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i32, i32]
    lib.linear_bf16_swiglu.restype = None
    lib.linear_bf16_amx_available.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


@functools.cache
def amx_available() -> bool:
    """The compiler targets AMX-BF16 and the OS grants the tile state (else ``AMX`` runs ``UNIFORM``)."""
    lib = _library()
    return lib is not None and bool(lib.linear_bf16_amx_available())


def paths() -> tuple[int, ...]:
    """The paths worth timing here (``UNIFORM`` is only for batch-invariant mode)."""
    if not available():
        return ()
    return (DPBF16, AMX) if amx_available() else (DPBF16,)


def library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelBuildError("the CPU bf16 linear kernel is not available on this machine")
    return lib


def fits(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % OUTPUT_MULTIPLE == 0 and weight.shape[1] % K_MULTIPLE == 0
            and weight.shape[0] > 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as ``[out/16, in/2, 16, 2]``."""
    lib = _library()
    if lib is None or not fits(weight):
        raise ValueError(f"a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device} "
                         f"is not the bf16 kernel's (out a multiple of {OUTPUT_MULTIPLE}, in even, CPU)")
    w = weight.detach().contiguous()
    out_features, in_features = w.shape
    packed = torch.empty(out_features // OUTPUT_BLOCK, in_features // 2, OUTPUT_BLOCK, 2, dtype=torch.bfloat16)
    lib.linear_bf16_pack(w.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           widened: bool = False, path: int = DPBF16) -> torch.Tensor:
    """``F.linear`` with float32 sums and one rounding to bf16; ``widened`` writes those values as
    float32 (logits without a second pass)."""
    if path not in PATH_NAMES:
        raise ValueError(f"path must be one of {sorted(PATH_NAMES)}, got {path!r}")
    lib = library()
    out_features, in_features = packed.shape[0] * OUTPUT_BLOCK, packed.shape[1] * 2
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"x of shape {tuple(x.shape)} ({x.dtype}, {x.device}) does not fit a bf16 CPU "
                         f"weight of {in_features} in features")
    # Each row is read as int32 pairs: contiguous rows with an even stride, 4-byte aligned.
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    fp32_bias = None
    if bias is not None:
        fp32_bias = bias.detach().to(torch.float32).contiguous()
        if fp32_bias.shape != (out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {out_features} out features")
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32 if widened else torch.bfloat16)
    if x.shape[0]:
        call = lib.linear_bf16_widened if widened else lib.linear_bf16
        call(x.data_ptr(), x.shape[0], in_features, x.stride(0), packed.data_ptr(), out_features,
             None if fp32_bias is None else fp32_bias.data_ptr(), out.data_ptr(), torch.get_num_threads(), path)
    return out


def swiglu(x: torch.Tensor, packed: torch.Tensor, path: int = DPBF16) -> torch.Tensor:
    """``silu_mul`` of the merged gate/up ``linear``'s halves, bit for bit, in one call."""
    lib = library()
    inter, in_features = packed.shape[0] * OUTPUT_BLOCK // 2, packed.shape[1] * 2
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"x of shape {tuple(x.shape)} ({x.dtype}, {x.device}) does not fit a bf16 CPU "
                         f"weight of {in_features} in features")
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    if x.shape[0]:
        lib.linear_bf16_swiglu(x.data_ptr(), x.shape[0], in_features, x.stride(0), packed.data_ptr(), inter,
                               out.data_ptr(), torch.get_num_threads(), path)
    return out
