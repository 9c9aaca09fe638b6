"""Paged attention over one mixed batch, shared by every architecture.

``paged_self_attention`` takes the projected queries, keys and values of a batch's tokens, writes every token's
K/V to its cache slot, and attends: prefill tokens causally to their own sequence's new tokens,
decode tokens to their sequence's paged KV. Grouped-query attention is the kernels' business:
``key``/``value`` may carry fewer heads than ``query`` (a divisor of them); query head ``h``
reads KV head ``h // (num_heads / num_kv_heads)``.

One place for the model side of attention, so that a new kind of batch entry (a prefill chunk
starting at ``start_pos > 0`` that also attends to its cached KV) is added here once for all
models.
"""

from __future__ import annotations

import torch

import kernels
from actors.model.batch import ForwardBatch


def paged_self_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         layer_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """``query [T, H, D]``, ``key``/``value [T, KV, D]`` → attention output ``[T, H, D]``.

    ``layer_cache`` is one layer's ``[num_blocks, 2, block_size, KV, D]`` view of the KV store.
    """
    key_cache, value_cache = layer_cache[:, 0], layer_cache[:, 1]
    kernels.write_kv(key_cache, value_cache, key, value, batch.slot_mapping)
    p = batch.num_prefill_tokens
    parts = []
    if p:
        parts.append(kernels.prefill_attention(query[:p], key[:p], value[:p], batch.prefill_cu_seqlens, scale))
    if batch.num_decode:
        parts.append(kernels.paged_attention(query[p:], key_cache, value_cache,
                                             batch.decode_block_tables, batch.decode_context_lens, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
