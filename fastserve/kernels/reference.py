"""Torch reference implementations of the kernel API (any device): the semantics every CUDA and C
kernel is tested against, same signatures. As Hugging Face: scores and softmax in float32, output in
the input dtype; query head h reads KV head ``h // (num_heads // num_kv_heads)``; a ``window`` lets
position p see ``p - window + 1 .. p`` only. Half inputs are upcast off CUDA (slow, less accurate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

ACCUM_DTYPE = torch.float32

BlockIds = Sequence[int] | torch.Tensor


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K/V row into cache slot ``slot_mapping[t]``; slots < 0 are skipped."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep.to(key.device)], value[keep.to(value.device)]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    # Advanced-index assignment on the (non-contiguous) views writes through to the cache storage.
    key_cache[blocks, offsets] = key.to(device=key_cache.device, dtype=key_cache.dtype)
    value_cache[blocks, offsets] = value.to(device=value_cache.device, dtype=value_cache.dtype)


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """On CUDA SDPA's fused kernels keep the softmax in float32 already."""
    if tensor.is_cuda or tensor.dtype == torch.float64:
        return tensor.dtype
    return ACCUM_DTYPE


def check_kv_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads "
                         "(the KV head count must divide the query head count)")


def _sequence_bounds(cu_seqlens: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] per sequence; passed host-side, as a device read would stall every layer."""
    starts = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _heads_first(tokens: torch.Tensor, dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """``[L, heads, D]`` as ``[1, heads * repeat, L, D]``: fused SDPA takes 4-D only (3-D runs the
    math path, which materialises ``[H, L, L]`` scores)."""
    out = tokens.to(dtype).transpose(0, 1).unsqueeze(0)
    return out.repeat_interleave(repeat, dim=1) if repeat > 1 else out


def _allowed(rows: int, past: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[rows, past + rows]``: row i sits at position ``past + i``."""
    query_pos = torch.arange(rows, device=device)[:, None] + past
    key_pos = torch.arange(past + rows, device=device)[None, :]
    allowed = key_pos <= query_pos
    return allowed if window is None else allowed & (key_pos > query_pos - window)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float,
            dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """One sequence: q at positions ``past ..``, k/v ``[past + L, KV, D]``; causal, lower-right aligned."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    # On CUDA the KV heads are repeated: not every fused kernel takes GQA (the memory-efficient
    # one, which fp32 needs).
    repeat = num_heads // num_kv_heads if q.is_cuda else 1
    grouped = num_heads != num_kv_heads and repeat == 1
    q4, k4, v4 = _heads_first(q, dtype), _heads_first(k, dtype, repeat), _heads_first(v, dtype, repeat)
    if window is not None and past + q.shape[0] <= window:
        window = None   # every key is inside the window
    if past or window is not None:
        allowed = _allowed(q.shape[0], past, window, q.device)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed, scale=scale, enable_gqa=grouped)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=grouped)
    return out[0].transpose(0, 1)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    compute_dtype = _compute_dtype(query)
    check_kv_heads(query.shape[1], key.shape[1])
    for start, end in _sequence_bounds(cu_seqlens):
        if end > start:
            out[start:end] = _attend(query[start:end], key[start:end], value[start:end], 0, scale, compute_dtype,
                                     window)
    return out


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
    """Sequence b's tokens sit at ``start_positions[b] ..``, its prefix read through ``block_tables[b]``
    and the new tokens from ``key``/``value``."""
    out = torch.empty_like(query)
    compute_dtype = _compute_dtype(query)
    check_kv_heads(query.shape[1], key.shape[1])
    block_size = key_cache.shape[1]
    for b, (start, end) in enumerate(_sequence_bounds(cu_seqlens)):
        if end <= start:
            continue
        past = int(start_positions[b])
        k, v = key[start:end], value[start:end]
        if past:
            blocks = block_tables[b, : -(-past // block_size)].to(device=key_cache.device, dtype=torch.long)
            heads, dim = key.shape[1], key.shape[2]
            past_k = key_cache[blocks].reshape(-1, heads, dim)[:past].to(device=k.device, dtype=k.dtype)
            past_v = value_cache[blocks].reshape(-1, heads, dim)[:past].to(device=v.device, dtype=v.dtype)
            k, v = torch.cat([past_k, k]), torch.cat([past_v, v])
        out[start:end] = _attend(query[start:end], k, v, past, scale, compute_dtype, window)
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    block_size = key_cache.shape[1]
    context_lens = context_lens.to(device=query.device, dtype=torch.long)
    max_context = int(context_lens.max()) if context_lens.numel() else 0
    blocks_needed = max(1, -(-max_context // block_size))
    tables = block_tables[:, :blocks_needed].to(device=key_cache.device, dtype=torch.long)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    check_kv_heads(num_heads, num_kv_heads)
    positions = blocks_needed * block_size

    compute_dtype = ACCUM_DTYPE if query.dtype != torch.float64 else torch.float64
    keys = key_cache[tables].reshape(num_seqs, positions, num_kv_heads, head_dim).to(compute_dtype)
    values = value_cache[tables].reshape(num_seqs, positions, num_kv_heads, head_dim).to(compute_dtype)
    position_ids = torch.arange(positions, device=query.device)
    past_context = position_ids[None, :] >= context_lens[:, None]  # [B, positions]
    # Slots past a context may hold a recycled block's stale NaN, and 0 * NaN is NaN under a mask.
    shortest = int(context_lens.min()) if context_lens.numel() else 0
    tail = past_context[:, shortest:, None, None]
    keys[:, shortest:].masked_fill_(tail, 0.0)
    values[:, shortest:].masked_fill_(tail, 0.0)
    hidden = past_context
    if window is not None:   # the query sits at context_len - 1: keys before context_len - window are out
        hidden = past_context | (position_ids[None, :] < context_lens[:, None] - window)
    out = F.scaled_dot_product_attention(
        query.to(compute_dtype).unsqueeze(2),  # [B, H, 1, D]
        keys.transpose(1, 2), values.transpose(1, 2),  # [B, KV, positions, D] views
        attn_mask=~hidden[:, None, None, :], scale=scale, enable_gqa=num_heads != num_kv_heads,
    ).squeeze(2)
    return out.to(query.dtype)


def _as_id_list(ids: BlockIds) -> list[int]:
    return [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]


def coalesce_runs(src_ids: BlockIds, dst_ids: BlockIds) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs of consecutive id pairs, in order."""
    src, dst = _as_id_list(src_ids), _as_id_list(dst_ids)
    if len(src) != len(dst):
        raise ValueError(f"copy_blocks: {len(src)} source ids but {len(dst)} destination ids")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            run_src, run_dst, length = runs[-1]
            if s == run_src + length and d == run_dst + length:
                runs[-1] = (run_src, run_dst, length + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _check_run(start: int, length: int, num_blocks: int, side: str) -> None:
    if start < 0 or start + length > num_blocks:
        raise IndexError(
            f"copy_blocks: {side} blocks [{start}, {start + length}) out of range [0, {num_blocks})"
        )


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: BlockIds,
    dst_ids: BlockIds,
    non_blocking: bool = False,
) -> None:
    """Runs must not overlap when ``src`` and ``dst`` share storage."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"copy_blocks: block shape/dtype mismatch {tuple(src.shape[1:])}/{src.dtype} "
            f"vs {tuple(dst.shape[1:])}/{dst.dtype}"
        )
    for src_start, dst_start, length in coalesce_runs(src_ids, dst_ids):
        # Slicing past the end would silently shorten a run and copy_ would then broadcast.
        _check_run(src_start, length, src.shape[0], "source")
        _check_run(dst_start, length, dst.shape[0], "destination")
        source, target = src[src_start : src_start + length], dst[dst_start : dst_start + length]
        if source.device.type == target.device.type == "cpu" and source.is_contiguous() and target.is_contiguous():
            # One thread's memcpy: swaps run on the KV store's thread, whose OpenMP team would
            # throttle the model's.
            np.copyto(_as_bytes(target), _as_bytes(source))
        else:
            target.copy_(source, non_blocking=non_blocking)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x + delta``, its RMSNorm): rows in float32, cast back, then times ``weight`` (as HF)."""
    if delta is not None:
        x = x + delta
    # Transformers' pow/mean/rsqrt/mul bit for bit, in one op.
    normed = F.rms_norm(x.to(torch.float32), weight.shape, None, eps)
    return x, weight * normed.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Transformers' ``x * cos + rotate_half(x) * sin`` bit for bit: ``roll`` swaps the halves and
    the sign lives in ``signed_sin`` (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
