"""CuPy launchers for the CUDA sources in ``fastserve/kernels/cuda/``.

Owns loading the ``.cu`` files with ``cupy.RawModule`` (compiled once per device, then cached),
checking/normalising the torch tensors handed to them, and launching the kernels on the current
torch CUDA stream with raw ``data_ptr()``s and element strides. Signatures match
``fastserve.kernels.reference``; ``fastserve/kernels/__init__.py`` decides when these are used.

This module imports cupy at import time, so it is only imported by the dispatcher once cupy has
been found to work with a device; nothing else should import it directly.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import cupy
import numpy as np
import torch

from fastserve.kernels.cuda_specs import CUDA_KERNEL_SUFFIX, PAGED_ATTENTION_MAX_HEAD_DIM

CUDA_SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
PAGED_ATTENTION_SOURCE = "paged_attention.cu"
WRITE_KV_SOURCE = "write_kv.cu"
# Must equal NUM_THREADS in paged_attention.cu (the kernel's reductions assume it).
PAGED_ATTENTION_THREADS = 128
# One block per token; threads stride over num_heads * head_dim, so more rarely helps.
WRITE_KV_MAX_THREADS = 256
WARP_SIZE = 32


@functools.cache
def _source(filename: str) -> str:
    return (CUDA_SOURCE_DIR / filename).read_text()


@functools.cache
def _module(filename: str, device_index: int) -> Any:
    """One RawModule per source and device: a RawModule holds a single loaded module."""
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=_source(filename))


@functools.cache
def _function(filename: str, kernel: str, device_index: int) -> Any:
    """Compiled kernel (NVRTC, then CuPy's on-disk cache) for one device."""
    with cupy.cuda.Device(device_index):
        return _module(filename, device_index).get_function(kernel)


def _kernel_name(base: str, dtype: torch.dtype) -> str:
    suffix = CUDA_KERNEL_SUFFIX.get(dtype)
    if suffix is None:
        raise TypeError(f"{base}: no CUDA kernel for {dtype}")
    return f"{base}_{suffix}"


def _ptr(tensor: torch.Tensor) -> np.uint64:
    # Kernel pointer parameters are 8 bytes; a uint64 scalar is passed by value like one.
    return np.uint64(tensor.data_ptr())


def _launch(
    filename: str,
    kernel: str,
    device: torch.device,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
) -> None:
    """Launch on torch's current stream so the kernel orders with surrounding torch work."""
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    function = _function(filename, kernel, device_index)
    torch_stream = torch.cuda.current_stream(device_index)
    with cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(torch_stream.cuda_stream):
        function(grid, block, args)


def _cache_strides(cache: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
    """Block, in-block position and head strides of a per-layer cache view, as the kernels take them."""
    return np.int64(cache.stride(0)), np.int64(cache.stride(1)), np.int64(cache.stride(2))


def _innermost_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _require_cache_layout(cache: torch.Tensor, name: str) -> None:
    # Caches are written in place, so they cannot be copied into a friendlier layout.
    if cache.dim() != 4 or cache.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, num_heads, head_dim] with a contiguous "
            f"last dim; got shape {tuple(cache.shape)} strides {cache.stride()}"
        )


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """CUDA ``write_kv``: see ``kernels.write_kv``."""
    _require_cache_layout(key_cache, "key_cache")
    _require_cache_layout(value_cache, "value_cache")
    device = key_cache.device
    _check_same_device(device, value_cache=value_cache, key=key, value=value)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The copy is bit-exact, so sources must already have the cache's dtype.
    key = _innermost_contiguous(key.to(key_cache.dtype))
    value = _innermost_contiguous(value.to(value_cache.dtype))
    slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous()
    row = num_heads * head_dim
    threads = min(WRITE_KV_MAX_THREADS, -(-row // WARP_SIZE) * WARP_SIZE)
    args = (
        _ptr(key_cache),
        _ptr(value_cache),
        _ptr(key),
        _ptr(value),
        _ptr(slots),
        np.int32(num_heads),
        np.int32(head_dim),
        np.int32(key_cache.shape[1]),
        np.int64(key.stride(0)),
        np.int64(key.stride(1)),
        np.int64(value.stride(0)),
        np.int64(value.stride(1)),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
    )
    kernel = _kernel_name("write_kv", key_cache.dtype)
    _launch(WRITE_KV_SOURCE, kernel, device, (num_tokens,), (threads,), args)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA ``paged_attention``: see ``kernels.paged_attention``.

    ``out`` (contiguous, query's shape and dtype) is written instead of a fresh tensor; the GPU
    tests poison it to prove every element is written.
    """
    _require_cache_layout(key_cache, "key_cache")
    _require_cache_layout(value_cache, "value_cache")
    if query.dim() != 3:
        raise ValueError(f"paged_attention: query must be [B, H, D], got {tuple(query.shape)}")
    device = query.device
    _check_same_device(device, key_cache=key_cache, value_cache=value_cache)
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError(
            f"paged_attention: query {query.dtype}, caches {key_cache.dtype}/{value_cache.dtype}"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape[3] != head_dim:
        # The kernel maps query head h to KV head h // (num_heads // num_kv_heads) unchecked.
        raise ValueError(f"paged_attention: {num_heads} query heads of dim {head_dim} do not fit a cache of "
                         f"{num_kv_heads} KV heads of dim {key_cache.shape[3]}")
    if head_dim > PAGED_ATTENTION_MAX_HEAD_DIM:
        raise ValueError(
            f"paged_attention: head_dim {head_dim} > {PAGED_ATTENTION_MAX_HEAD_DIM} unsupported"
        )
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=device)
    elif (
        out.shape != query.shape
        or out.dtype != query.dtype
        or out.device != device
        or not out.is_contiguous()
    ):
        raise ValueError("paged_attention: out must be contiguous with the query's shape/dtype")
    if num_seqs == 0:
        return out
    query = _innermost_contiguous(query)
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=device, dtype=torch.int32).contiguous()
    args = (
        _ptr(out),
        _ptr(query),
        _ptr(key_cache),
        _ptr(value_cache),
        _ptr(tables),
        _ptr(lens),
        np.float32(scale),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int32(key_cache.shape[1]),
        np.int64(tables.stride(0)),
        np.int64(query.stride(0)),
        np.int64(query.stride(1)),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
    )
    kernel = _kernel_name("paged_attention", query.dtype)
    grid = (num_heads, num_seqs)
    _launch(PAGED_ATTENTION_SOURCE, kernel, device, grid, (PAGED_ATTENTION_THREADS,), args)
    return out
