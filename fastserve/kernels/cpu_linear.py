"""The CPU bfloat16 linear kernel in ``fastserve/kernels/cpu/linear_bf16.c``: built, loaded and called.

Owns the kernel's weight layout (``pack``: once per weight, after loading) and the call
(``linear``: ``F.linear``'s contract for a bf16 ``x`` and a packed weight). Built with the same
compiler, flags and on-disk cache as the attention kernel (``fastserve.kernels.cpu_ops.build``); where the
compiler does not target AVX-512 BF16, or no compiler is found, ``available()`` is False and the
model keeps oneDNN's packed GEMM. Why a kernel of our own: see the C file's note (oneDNN reads a
decode step's weights at 11-17 GB/s on the AMD EPYC Zen 4; this one at 20-26).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, KernelBuildError, build

LINEAR_SOURCE = SOURCE_DIR / "linear_bf16.c"
#: The kernel's block of outputs (NB in the C file) and its task of two blocks: N must be a
#: multiple of the task, K of the bf16 pair.
OUTPUT_BLOCK = 16
OUTPUT_MULTIPLE = 2 * OUTPUT_BLOCK
K_MULTIPLE = 2
#: The kernel's arithmetic, per call (``PATH_*`` in the C file): vdpbf16ps with a lone row on
#: four chains; vdpbf16ps with every row on one chain (a row's sums independent of the row
#: count); AMX tiles (row-count independent too; ``UNIFORM`` where AMX is absent or in features
#: are not a multiple of ``AMX_K_MULTIPLE``).
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
    """Whether the kernel built with AVX-512 BF16 on this machine (probed once per process)."""
    return _library() is not None


@functools.cache
def amx_available() -> bool:
    """Whether ``AMX`` runs on AMX tiles here: the compiler targets AMX-BF16 and the OS grants
    this process the tile state (probed once per process; elsewhere ``AMX`` runs ``UNIFORM``)."""
    lib = _library()
    return lib is not None and bool(lib.linear_bf16_amx_available())


def paths() -> tuple[int, ...]:
    """The paths that differ on this machine: ``DPBF16`` and ``AMX`` where AMX runs, else
    ``DPBF16`` alone (its ``UNIFORM`` twin is only for batch-invariant mode); none without the kernel."""
    if not available():
        return ()
    return (DPBF16, AMX) if amx_available() else (DPBF16,)


def library() -> ctypes.CDLL:
    """The loaded kernel, for callers that make their own ctypes calls (``fastserve.kernels.cpu_step``)."""
    lib = _library()
    if lib is None:
        raise KernelBuildError("the CPU bf16 linear kernel is not available on this machine")
    return lib


def fits(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in]) can be packed for the kernel: a CPU bf16 matrix whose out
    features are a multiple of 32 and in features even, on a machine where the kernel built."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % OUTPUT_MULTIPLE == 0 and weight.shape[1] % K_MULTIPLE == 0
            and weight.shape[0] > 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in the kernel's layout ([out/16, in/2, 16, 2]); ``fits(weight)``
    must hold."""
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
    """``F.linear(x, weight, bias)`` for a bf16 ``x`` [rows, in] and ``pack(weight)``: products
    summed in float32, the bias added in float32, one rounding to bf16. With ``widened``, those
    bf16 values as float32 (``F.linear(...).float()``'s bits) written by the kernel itself: a
    model's logits without a second pass over them. ``path``: the arithmetic (``DPBF16``,
    ``UNIFORM``, ``AMX``)."""
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
    """``silu_mul(gate, up)`` of ``linear(x, packed)``'s two halves (gate first), bit for bit, in
    one call: ``packed`` is the merged [2 inter, in] gate/up weight."""
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
