"""The CPU prefill attention kernel in ``cpu/prefill_attention_bf16.c``: which tensors it takes and
the call, which reads every K/V (the new tokens' too) from the paged cache. Needs AVX-512 BF16."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from fastserve.kernels.cpu_ops import SOURCE_DIR, KernelBuildError, load_optional, raise_for_status

PREFILL_SOURCE = SOURCE_DIR / "prefill_attention_bf16.c"
#: head_dim must be a multiple of this (the kernel's value sums take 32 dims at a time).
HEAD_DIM_MULTIPLE = 32


@functools.cache
def _library() -> ctypes.CDLL | None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    return load_optional(PREFILL_SOURCE, "prefill_attention_bf16_available", {
        "prefill_attention_bf16": [ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32,
                                   ctypes.c_float, ptr, i32],
    }, "torch's SDPA")


def available() -> bool:
    return _library() is not None


def library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise KernelBuildError("the CPU bf16 prefill attention kernel is not available on this machine")
    return lib


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel takes a bf16 ``query`` [T, H, D] (each token's heads one contiguous
    run, rows 4-byte aligned) over a bf16 CPU cache [blocks, block_size, KV, D] (head_dim
    contiguous): D a multiple of 32."""
    if query.dim() != 3 or key_cache.dim() != 4:
        return False
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    return (query.device.type == "cpu" and key_cache.device.type == "cpu"
            and query.dtype == key_cache.dtype == torch.bfloat16
            and query.stride(2) == 1 and query.stride(1) == dim and query.stride(0) % 2 == 0
            and query.data_ptr() % 4 == 0 and key_cache.stride(-1) == 1
            and key_cache.shape[3] == dim and dim % HEAD_DIM_MULTIPLE == 0
            and kv_heads >= 1 and heads % kv_heads == 0 and available())


def check_tables(tables: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor, block_size: int,
                 num_blocks: int) -> None:
    """The kernel trusts its tables: every block a sequence reaches must be in its table and pool."""
    for b in range(positions.numel()):
        width = -(-(int(positions[b]) + int(starts[b + 1] - starts[b])) // block_size)
        used = tables[b, :width]
        if width > tables.shape[1] or (used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks)):
            raise IndexError(f"sequence {b}'s table does not hold its {width} blocks inside the pool of {num_blocks}")


def context_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              cu_seqlens: torch.Tensor | Sequence[int], start_positions: Sequence[int],
                              block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    lib = _library()
    if lib is None or not supports(query, key_cache):
        raise ValueError(f"a {query.dtype} query {tuple(query.shape)} over a {key_cache.dtype} cache "
                         f"{tuple(key_cache.shape)} is not the bf16 prefill kernel's")
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value caches differ: {tuple(key_cache.shape)} {key_cache.stride()} vs "
                         f"{tuple(value_cache.shape)} {value_cache.stride()}")
    starts = torch.tensor(cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens),
                          dtype=torch.int64)
    positions = torch.tensor(list(start_positions), dtype=torch.int64)
    num_seqs = positions.numel()
    tables = block_tables.to(dtype=torch.int32).contiguous()
    if starts.numel() != num_seqs + 1 or tables.shape[0] != num_seqs or int(starts[-1]) != query.shape[0]:
        raise ValueError(f"{num_seqs} start positions, {starts.numel()} cumulative starts, {tables.shape[0]} "
                         f"tables for {query.shape[0]} query rows")
    block_size, num_blocks = key_cache.shape[1], key_cache.shape[0]
    check_tables(tables, starts, positions, block_size, num_blocks)
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    if query.shape[0] == 0:
        return out
    block_stride, token_stride, head_stride, _ = key_cache.stride()
    status = lib.prefill_attention_bf16(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_stride, token_stride,
        head_stride, tables.data_ptr(), tables.stride(0), starts.data_ptr(), positions.data_ptr(), num_seqs,
        query.shape[1], key_cache.shape[2], query.shape[2], block_size, float(scale), out.data_ptr(),
        torch.get_num_threads())
    raise_for_status("prefill_attention_bf16", status)
    return out
