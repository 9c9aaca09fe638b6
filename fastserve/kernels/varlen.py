"""Prefill attention on a GPU as one FlashAttention-2 varlen call per layer over every sequence
(``aten::_flash_attention_forward``, GQA in place), with a probe, once per device and dtype, that
this torch build has it. When a sequence continues a cached prefix, every sequence's K/V are first
gathered from the paged cache in one CuPy launch: FA2's own paged path takes 256-token blocks only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

#: What FlashAttention-2 takes.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
FLASH_MIN_CAPABILITY = (8, 0)

_log = logging.getLogger(__name__)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int, scale: float) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return out[0]


@functools.cache
def _flash_works(device_index: int, dtype: torch.dtype) -> bool:
    """Whether torch's varlen flash kernel runs here (probed once on a tiny causal case against
    a dense reference: a build without it, or an older GPU, raises)."""
    try:
        if torch.cuda.get_device_capability(device_index) < FLASH_MIN_CAPABILITY:
            return False
        gen = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)
        q, k, v = (torch.randn(5, 2, 64, device=f"cuda:{device_index}", generator=gen).to(dtype) for _ in range(3))
        cu = torch.tensor([0, 5], dtype=torch.int32, device=q.device)
        got = _flash(q, k, v, cu, cu, 5, 5, 0.125)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            is_causal=True, scale=0.125).transpose(0, 1)
        return bool(torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2))
    except (RuntimeError, AttributeError, TypeError) as exc:
        _log.warning("varlen flash attention unavailable (%s); prefill uses one SDPA call per sequence", exc)
        return False


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` here takes these tensors (and the kernel runs on this device)."""
    head_dim = query.shape[-1]
    if not (query.is_cuda and query.dtype in FLASH_DTYPES and key_cache.dtype == query.dtype
            and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % FLASH_HEAD_DIM_MULTIPLE == 0):
        return False
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    return _flash_works(index, query.dtype)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """FlashAttention reads rows through their strides but needs each head's row contiguous."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def prefill_attention(
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
    """``kernels.context_prefill_attention`` in one flash call: ``query [T, H, D]``, ``key``/``value``
    ``[T, KV, D]`` (already written to the caches); ``cu_q``/``cu_k`` int32 device cumulative new
    tokens and contexts; ``max_q``/``max_k`` the longest of each (host ints)."""
    query = _last_dim_contiguous(query)
    if any(start_positions):
        from fastserve.kernels import cupy_ops

        total = int(sum(start_positions)) + query.shape[0]
        key, value = cupy_ops.gather_kv(key_cache, value_cache, block_tables, cu_k, total, max_k)
        return _flash(query, key, value, cu_q, cu_k, max_q, max_k, scale)
    return _flash(query, _last_dim_contiguous(key), _last_dim_contiguous(value), cu_q, cu_q, max_q, max_q, scale)
