"""CuPy launchers for the CUDA sources in ``cuda/``: compiled once per device and constants, tensors
checked, launched on torch's current stream (so they land in a ``torch.cuda.graph`` capture); never
a sync or a host copy. Signatures match ``reference``. Imports cupy: only the dispatcher, once cupy
works, imports this. Decode attention: v2 (split context, the default) or v1 (the reference on a GPU
and the fallback for shapes v2 does not take).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import cupy
import numpy as np
import torch

from fastserve.kernels.cuda_specs import CUDA_KERNEL_SUFFIX, PAGED_ATTENTION_MAX_HEAD_DIM

CUDA_SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
_LOCAL_INCLUDE = re.compile(r'^#include "([^"/]+)"$', re.MULTILINE)
PAGED_ATTENTION_SOURCE = "paged_attention.cu"
PAGED_ATTENTION_V2_SOURCE = "paged_attention_v2.cu"
WRITE_KV_SOURCE = "write_kv.cu"
# NUM_THREADS, PARTITION, MAX_SPLITS in the .cu files (the reductions assume them).
PAGED_ATTENTION_THREADS = 128
PAGED_ATTENTION_PARTITION = 256
PAGED_ATTENTION_MAX_SPLITS = 1024
PAGED_ATTENTION_MAX_GROUP_TILE = 8   # v2's accumulators stay in registers up to this
# Enough waves that the last one's imbalance is small, few enough that splits read whole partitions.
PAGED_ATTENTION_BLOCKS_PER_SM = 4
VEC_BYTES = 16
# One block per token; threads stride over num_heads * head_dim, so more rarely helps.
WRITE_KV_MAX_THREADS = 256
WARP_SIZE = 32
LOG2_E = 1.4426950408889634   # v2 keeps scores in log2 units: exp2 is one instruction


@functools.cache
def _source(filename: str) -> str:
    """The source as NVRTC compiles it: each ``#include "header"`` of this folder spliced in, so the
    text CuPy's kernel cache keys on holds the headers too."""
    text = (CUDA_SOURCE_DIR / filename).read_text()
    return _LOCAL_INCLUDE.sub(lambda m: _source(m.group(1)), text)


@functools.cache
def _module(filename: str, device_index: int, options: tuple[str, ...] = ()) -> Any:
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=_source(filename), options=options)


@functools.cache
def _function(filename: str, kernel: str, device_index: int, options: tuple[str, ...] = ()) -> Any:
    with cupy.cuda.Device(device_index):
        return _module(filename, device_index, options).get_function(kernel)


_streams: dict[tuple[int, int], Any] = {}


def _cupy_stream(torch_stream: torch.cuda.Stream, device_index: int) -> Any:
    """``Stream.from_external`` (CuPy 13+), else ``ExternalStream``; once per torch stream."""
    key = (device_index, int(torch_stream.cuda_stream))
    stream = _streams.get(key)
    if stream is None:
        with cupy.cuda.Device(device_index):
            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            try:
                stream = from_external(torch_stream) if from_external is not None else None
            except (TypeError, ValueError, AttributeError):
                stream = None
            if stream is None:
                stream = cupy.cuda.ExternalStream(key[1], device_index)
        _streams[key] = stream
    return stream


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _kernel_name(base: str, dtype: torch.dtype) -> str:
    suffix = CUDA_KERNEL_SUFFIX.get(dtype)
    if suffix is None:
        raise TypeError(f"{base}: no CUDA kernel for {dtype}")
    return f"{base}_{suffix}"


def _ptr(tensor: torch.Tensor) -> np.uint64:
    # Kernel pointer parameters are 8 bytes; a uint64 scalar is passed by value like one.
    return np.uint64(tensor.data_ptr())


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _launch(
    filename: str,
    kernel: str,
    device: torch.device,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    options: tuple[str, ...] = (),
) -> None:
    device_index = _device_index(device)
    function = _function(filename, kernel, device_index, options)
    stream = _cupy_stream(torch.cuda.current_stream(device_index), device_index)
    with cupy.cuda.Device(device_index):
        function(grid, block, args, stream=stream)


def _cache_strides(cache: torch.Tensor) -> tuple[np.int64, np.int64, np.int64]:
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


def _paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tables keep their row stride (a static buffer's rows are wider than the batch)."""
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
        # The kernels map query head h to KV head h // (num_heads // num_kv_heads) unchecked.
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
    tables = block_tables.to(device=device, dtype=torch.int32)
    if tables.dim() != 2 or (tables.stride(1) != 1 and tables.shape[1] > 1):
        tables = tables.contiguous()
    lens = context_lens.to(device=device, dtype=torch.int32).contiguous()
    return _innermost_contiguous(query), tables, lens, out


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
    """v2 where it takes the shapes, else v1; ``out`` is written instead of a fresh tensor."""
    if v2_supports(query, key_cache, value_cache):
        return paged_attention_v2(query, key_cache, value_cache, block_tables, context_lens, scale, out=out)
    return paged_attention_v1(query, key_cache, value_cache, block_tables, context_lens, scale, out=out)


def v2_supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Head rows whole 16-byte vectors, every cache row 16-byte aligned."""
    head_dim = query.shape[-1]
    size = key_cache.element_size()
    if head_dim > PAGED_ATTENTION_MAX_HEAD_DIM or (head_dim * size) % VEC_BYTES:
        return False
    for cache in (key_cache, value_cache):
        if cache.data_ptr() % VEC_BYTES or any((cache.stride(i) * size) % VEC_BYTES for i in range(3)):
            return False
    return True


def group_tile(group: int) -> int:
    """Query heads one v2 block serves: the largest divisor of the group within the tile."""
    return max(t for t in range(1, min(group, PAGED_ATTENTION_MAX_GROUP_TILE) + 1) if group % t == 0)


def num_splits(grid_blocks: int, device_index: int) -> int:
    """Splits that fill the GPU; from the grid alone, so a graph and the eager step of one size round alike."""
    wanted = -(-PAGED_ATTENTION_BLOCKS_PER_SM * _multiprocessors(device_index) // max(grid_blocks, 1))
    return max(1, min(wanted, PAGED_ATTENTION_MAX_SPLITS))


def paged_attention_v2(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """The split kernel (``paged_attention_v2.cu``); ``splits`` overrides ``num_splits`` (tests)."""
    if not v2_supports(query, key_cache, value_cache):
        raise ValueError(f"paged_attention_v2 does not take head_dim {query.shape[-1]} of "
                         f"{query.dtype} or a cache not aligned to {VEC_BYTES} bytes")
    query, tables, lens, out = _paged_attention_args(query, key_cache, value_cache, block_tables,
                                                     context_lens, out)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    device = query.device
    num_kv_heads = key_cache.shape[2]
    tile = group_tile(num_heads // num_kv_heads)
    grid_x = num_heads // tile
    block_size = key_cache.shape[1]
    if splits is None:
        splits = num_splits(grid_x * num_seqs, _device_index(device))
    if not 1 <= splits <= PAGED_ATTENTION_MAX_SPLITS:
        raise ValueError(f"paged_attention_v2: splits must be in [1, {PAGED_ATTENTION_MAX_SPLITS}], got {splits}")
    if splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=device)
        part_stats = torch.empty((2, num_seqs, num_heads, splits), dtype=torch.float32, device=device)
        stats = (_ptr(part_acc), _ptr(part_stats[0]), _ptr(part_stats[1]))
    else:
        stats = (np.uint64(0), np.uint64(0), np.uint64(0))
    options = (f"-DPA_HEAD_DIM={head_dim}", f"-DPA_GROUP={tile}")
    args = (
        _ptr(out),
        *stats,
        _ptr(query),
        _ptr(key_cache),
        _ptr(value_cache),
        _ptr(tables),
        _ptr(lens),
        np.float32(scale * LOG2_E),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(block_size),
        np.int64(tables.stride(0)),
        np.int64(query.stride(0)),
        np.int64(query.stride(1)),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
    )
    _launch(PAGED_ATTENTION_V2_SOURCE, _kernel_name("paged_attention_v2", query.dtype), device,
            (grid_x, num_seqs, splits), (PAGED_ATTENTION_THREADS,), args, options)
    if splits > 1:
        reduce_args = (_ptr(out), stats[0], stats[1], stats[2], np.int32(num_heads), np.int32(splits))
        _launch(PAGED_ATTENTION_V2_SOURCE, _kernel_name("paged_attention_reduce", query.dtype), device,
                (num_heads, num_seqs), (PAGED_ATTENTION_THREADS,), reduce_args, options)
    return out


def paged_attention_v1(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One block per (head, sequence)."""
    query, tables, lens, out = _paged_attention_args(query, key_cache, value_cache, block_tables,
                                                     context_lens, out)
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    num_kv_heads = key_cache.shape[2]
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
    _launch(PAGED_ATTENTION_SOURCE, kernel, query.device, (num_heads, num_seqs), (PAGED_ATTENTION_THREADS,), args)
    return out


GATHER_KV_SOURCE = "gather_kv.cu"
GATHER_KV_TOKENS_PER_BLOCK = 16   # TOKENS_PER_BLOCK in gather_kv.cu
GATHER_KV_THREADS = 128
# Word widths gather_kv.cu is instantiated for, widest first.
GATHER_KV_WORDS = ((16, "w16"), (4, "w4"), (2, "w2"))


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_k: torch.Tensor,
    total: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first ``cu_k[b+1] - cu_k[b]`` positions, packed into ``[total, KV, D]`` at
    rows ``cu_k[b] ..``, one launch. Bit-exact."""
    _require_cache_layout(key_cache, "key_cache")
    _require_cache_layout(value_cache, "value_cache")
    device = key_cache.device
    _, block_size, num_heads, head_dim = key_cache.shape
    packed_k = torch.empty((total, num_heads, head_dim), dtype=key_cache.dtype, device=device)
    packed_v = torch.empty_like(packed_k)
    num_seqs = cu_k.numel() - 1
    if total == 0 or num_seqs <= 0:
        return packed_k, packed_v
    for cache in (key_cache, value_cache):
        if cache.stride(2) != head_dim:
            raise ValueError(f"gather_kv: a position's heads must be contiguous, strides {cache.stride()}")
    size = key_cache.element_size()
    row_bytes = num_heads * head_dim * size
    strides = [s * size for c in (key_cache, value_cache) for s in (c.stride(0), c.stride(1))]
    pointers = (key_cache.data_ptr(), value_cache.data_ptr(), packed_k.data_ptr(), packed_v.data_ptr())
    word, suffix = next((w, n) for w, n in GATHER_KV_WORDS
                        if all(x % w == 0 for x in (row_bytes, *strides, *pointers)))
    tables = block_tables.to(device=device, dtype=torch.int32)
    if tables.stride(1) != 1 and tables.shape[1] > 1:
        tables = tables.contiguous()
    cu = cu_k.to(device=device, dtype=torch.int32).contiguous()
    args = (_ptr(packed_k), _ptr(packed_v), _ptr(key_cache), _ptr(value_cache), _ptr(tables), _ptr(cu),
            np.int32(block_size), np.int32(row_bytes // word), np.int64(tables.stride(0)),
            *(np.int64(s // word) for s in strides))
    grid = (-(-max_k // GATHER_KV_TOKENS_PER_BLOCK), num_seqs)
    _launch(GATHER_KV_SOURCE, f"gather_kv_{suffix}", device, grid, (GATHER_KV_THREADS,), args)
    return packed_k, packed_v
