"""The data plane's kernel API (``write_kv``, the attentions, ``copy_blocks``, ``rms_norm``, ``silu_mul``,
``rotate``) and, per call, which implementation runs: the CuPy kernels in ``cuda/`` on CUDA tensors
where cupy works, the C kernels in ``cpu/`` on CPU tensors they fit, else the torch reference
(``reference``: same signatures, same results to rounding). ``FASTSERVE_KERNEL_BACKEND=torch``
forces the reference; a sliding ``window`` always runs it. Each path: docs/engine.md.

KV layout: one tensor per stage, ``cache[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (2 = key, value), so a block is one contiguous range; kernels get the per-layer views
``cache[:, layer, 0|1]``, strided along dim 0, and honour the strides. cupy is imported lazily.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from fastserve.kernels import reference
from fastserve.kernels.cuda_specs import CUDA_KERNEL_SUFFIX

__all__ = [
    "BACKEND_ENV_VAR",
    "CPU_BACKEND",
    "CUDA_BACKEND",
    "TORCH_BACKEND",
    "backend_for",
    "context_prefill_attention",
    "copy_blocks",
    "paged_attention",
    "paged_attention_backend",
    "prefill_attention",
    "prefill_reads_cache",
    "varlen_prefill_attention",
    "varlen_prefill_supported",
    "rms_norm",
    "rotate",
    "silu_mul",
    "write_kv",
]

CUDA_BACKEND = "cuda"
CPU_BACKEND = "cpu"
TORCH_BACKEND = "torch"
BACKEND_ENV_VAR = "FASTSERVE_KERNEL_BACKEND"

_log = logging.getLogger(__name__)


_PROBE_SOURCE = r'''
extern "C" __global__ void fastserve_probe(int* out) { out[threadIdx.x] = 2 * threadIdx.x + 1; }
'''
_PROBE_THREADS = 32


@functools.cache
def _cupy_usable() -> bool:
    """Whether cupy can compile and run a kernel: a broken NVRTC or a too-old driver passes the
    device count and would otherwise fail the first forward instead of falling back."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        probe = cupy.RawKernel(_PROBE_SOURCE, "fastserve_probe")
        out = cupy.zeros(_PROBE_THREADS, dtype=cupy.int32)
        probe((1,), (_PROBE_THREADS,), (out,))
        if out.tolist() != [2 * i + 1 for i in range(_PROBE_THREADS)]:
            raise RuntimeError(f"the probe kernel computed {out.tolist()}")
    except Exception as exc:  # any failure means "no CUDA path"
        if torch.cuda.is_available():
            _log.warning("cupy unusable (%s); CUDA tensors use the torch reference kernels", exc)
        return False
    return True


def backend_for(tensor: torch.Tensor) -> str:
    if _forced_reference():
        return TORCH_BACKEND
    if tensor.is_cuda and tensor.dtype in CUDA_KERNEL_SUFFIX and _cupy_usable():
        return CUDA_BACKEND
    return TORCH_BACKEND


def _forced_reference() -> bool:
    return os.environ.get(BACKEND_ENV_VAR, "").strip().lower() == TORCH_BACKEND


def cpu_step_allowed() -> bool:
    """Not while the reference is forced: ``cpu_step``'s run of C calls has none inside."""
    return not _forced_reference()


def paged_attention_backend(query: torch.Tensor, key_cache: torch.Tensor) -> str:
    if _forced_reference():
        return TORCH_BACKEND
    if query.is_cuda:
        return backend_for(query)
    from fastserve.kernels import cpu_ops

    return CPU_BACKEND if cpu_ops.supports(query, key_cache) else TORCH_BACKEND


def _cupy_ops() -> ModuleType:
    from fastserve.kernels import cupy_ops

    return cupy_ops


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Each token's K/V ``[T, kv_heads, D]`` into slot ``block_id * block_size + offset``; < 0: padding."""
    if backend_for(key_cache) == CUDA_BACKEND:
        _cupy_ops().write_kv(key_cache, value_cache, key, value, slot_mapping)
    elif key_cache.device.type == "cpu" and not _forced_reference() and _cpu_writes(key_cache, key, value):
        from fastserve.kernels import cpu_ops

        cpu_ops.write_kv(key_cache, value_cache, key, value, slot_mapping)
    else:
        reference.write_kv(key_cache, value_cache, key, value, slot_mapping)


def _cpu_elementwise() -> ModuleType | None:
    if _forced_reference():
        return None
    from fastserve.kernels import cpu_elementwise

    return cpu_elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + delta`` (residual add fused); returns (the sum in x's dtype, the normed rows).
    Normed in float32, cast back, then scaled by ``weight``."""
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_rms_norm(x, weight, delta):
        return cpu.rms_norm(x, weight, eps, delta)
    return reference.rms_norm(x, weight, eps, delta)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_silu_mul(gate, up):
        return cpu.silu_mul(gate, up)
    return reference.silu_mul(gate, up)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding; ``signed_sin`` is sin with its first half negated."""
    cpu = _cpu_elementwise()
    if cpu is not None and cpu.fits_rotary(x, cos, signed_sin):
        return cpu.rotate(x, cos, signed_sin)
    return reference.rotate(x, cos, signed_sin)


def _cpu_writes(key_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    from fastserve.kernels import cpu_ops

    return cpu_ops.supports_write(key_cache, key, value)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences; query head h reads KV head ``h // (H // kv_heads)``.
    ``cu_seqlens``: host ints (a device tensor costs a sync per call). Softmax in float32."""
    return reference.prefill_attention(query, key, value, cu_seqlens, scale, window)


def context_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    start_positions: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``prefill_attention`` where sequence b starts at ``start_positions[b]`` and also attends to
    its cached prefix through ``block_tables[b]``. The new K/V must already be in the cache."""
    if window is None and prefill_reads_cache(query, key_cache):
        from fastserve.kernels import cpu_prefill

        return cpu_prefill.context_prefill_attention(query, key_cache, value_cache, cu_seqlens, start_positions,
                                                     block_tables, scale)
    return reference.context_prefill_attention(query, key, value, key_cache, value_cache,
                                               cu_seqlens, start_positions, block_tables, scale, window)


def prefill_reads_cache(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the CPU C kernel runs here: it reads new K/V from the cache, and takes whole prompts too."""
    if _forced_reference() or query.device.type != "cpu":
        return False
    from fastserve.kernels import cpu_prefill

    return cpu_prefill.supports(query, key_cache)


def varlen_prefill_supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    if backend_for(key_cache) != CUDA_BACKEND:
        return False
    from fastserve.kernels import varlen

    return varlen.supports(query, key_cache)


def varlen_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    start_positions: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``context_prefill_attention`` as one varlen flash call; ``max_q``/``max_k`` are host ints."""
    from fastserve.kernels import varlen

    return varlen.prefill_attention(query, key, value, key_cache, value_cache, cu_q, cu_k, max_q, max_k,
                                    start_positions, block_tables, scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query per sequence over positions ``0..context_lens[b]-1`` of its paged
    KV; position p is in block ``block_tables[b, p // block_size]``."""
    if window is not None:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, window)
    backend = paged_attention_backend(query, key_cache)
    if backend == CPU_BACKEND:
        from fastserve.kernels import cpu_ops

        return cpu_ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    impl = _cupy_ops() if backend == CUDA_BACKEND else reference
    return impl.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int] | torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    non_blocking: bool = False,
) -> None:
    """``src[src_ids[k]] -> dst[dst_ids[k]]``, one slice copy per run of consecutive ids. With
    ``non_blocking`` on a side stream, synchronise it before reusing the source blocks."""
    reference.copy_blocks(src, dst, src_ids, dst_ids, non_blocking=non_blocking)
