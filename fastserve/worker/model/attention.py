"""``paged_self_attention``: where every model's attention meets the paged KV cache. It writes the new
K/V to their slots, then runs varlen causal prefill and paged decode; a sliding ``window`` reaches the
kernels only where it cuts a context.
"""

from __future__ import annotations

import torch

from fastserve import kernels
from fastserve.worker.model.batch import ForwardBatch


def paged_self_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         layer_cache: torch.Tensor, batch: ForwardBatch,
                         scale: float, window: int | None = None) -> torch.Tensor:
    """``query [T, H, D]``, ``key``/``value [T, KV, D]`` → ``[T, H, D]``. ``layer_cache``: one
    layer's ``[num_blocks, 2, block_size, KV, D]``; ``window`` None is full causal attention."""
    key_cache, value_cache = layer_cache[:, 0], layer_cache[:, 1]
    kernels.write_kv(key_cache, value_cache, key, value, batch.slot_mapping)
    p = batch.num_prefill_tokens
    parts = []
    if p:
        parts.append(_prefill(query[:p], key[:p], value[:p], key_cache, value_cache, batch, scale,
                              _prefill_window(batch, window)))
    if batch.num_decode:
        parts.append(kernels.paged_attention(query[p:], key_cache, value_cache,
                                             batch.decode_block_tables, batch.decode_context_lens,
                                             scale, _decode_window(batch, window)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prefill_window(batch: ForwardBatch, window: int | None) -> int | None:
    """``window`` where some prefill token sits at or past it (its context is cut), else None."""
    if window is None:
        return None
    bounds = batch.prefill_cu_seqlens
    starts = batch.prefill_start_pos or (0,) * (len(bounds) - 1)
    longest = max((s + b - a for s, a, b in zip(starts, bounds[:-1], bounds[1:], strict=True)), default=0)
    return window if longest > window else None


def _decode_window(batch: ForwardBatch, window: int | None) -> int | None:
    """``window`` where some decode context is longer than it, else None (one host sync per layer)."""
    if window is None or not batch.num_decode:
        return None
    return window if int(batch.decode_context_lens.max()) > window else None


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch,
             scale: float, window: int | None) -> torch.Tensor:
    tables = batch.prefill_block_tables
    if (window is None and tables is not None and batch.prefill_cu_q is not None and batch.prefill_cu_k is not None
            and kernels.varlen_prefill_supported(query, key_cache)):
        return kernels.varlen_prefill_attention(query, key, value, key_cache, value_cache, batch.prefill_cu_q,
                                                batch.prefill_cu_k, batch.prefill_max_q, batch.prefill_max_k,
                                                batch.prefill_start_pos, tables, scale)
    # Only chunks that continue a cached prefix need the cache, unless the kernel always reads it.
    if tables is None or not (any(batch.prefill_start_pos) or kernels.prefill_reads_cache(query, key_cache)):
        return kernels.prefill_attention(query, key, value, batch.prefill_cu_seqlens, scale, window)
    return kernels.context_prefill_attention(query, key, value, key_cache, value_cache,
                                             batch.prefill_cu_seqlens, batch.prefill_start_pos,
                                             tables, scale, window)
