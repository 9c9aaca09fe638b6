"""A step's decoder layers (LLaMA family, bf16, CPU) as one fixed run of C calls.

The module path makes the same kernel calls through per-op wrappers (~330 a step, about half a
batch-1 step: docs/engine.md); here checks and buffers are made once per step and a layer is a
few ctypes calls. Same kernels, same order, same bits: the MLP's residual add is fused into the
next layer's norm, gate/up and silu_mul are one call, with the roundings torch's ops make.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastserve.kernels import cpu_elementwise, cpu_linear, cpu_ops, cpu_prefill

BF16 = torch.bfloat16
BF16_BYTES = 2


@dataclass(frozen=True)
class LayerDims:

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rms_norm_eps: float
    scale: float


#: A GEMM path that is not our kernel's: the run calls ``StepGemm.other`` for it.
OTHER = -1


@dataclass(frozen=True)
class StepGemm:
    """One layer's GEMM: ``ranges`` ``((max_rows, path), ...)`` ascending (the last covers more rows),
    each a ``cpu_linear`` path on ``packed`` or ``OTHER``, where ``other(x)`` gives ``x W^T``."""

    packed: torch.Tensor | None
    other: Callable[[torch.Tensor], torch.Tensor] | None
    ranges: tuple[tuple[int, int], ...]

    def path(self, rows: int) -> int:
        for max_rows, path in self.ranges:
            if rows <= max_rows:
                return path
        return self.ranges[-1][1]


@dataclass(frozen=True)
class StepLayer:

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: StepGemm
    o: StepGemm
    gate_up: StepGemm
    down: StepGemm

    @property
    def gemms(self) -> tuple[StepGemm, StepGemm, StepGemm, StepGemm]:
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True)
class PrefillRows:
    """The step's prefill rows, a batch's first rows; a start position > 0 continues a cached prefix."""

    cu_seqlens: torch.Tensor       # int64 [num_seqs + 1]
    start_positions: torch.Tensor  # int64 [num_seqs]
    block_tables: torch.Tensor     # int32 [num_seqs, width], contiguous

    @classmethod
    def of(cls, cu_seqlens: Sequence[int], start_positions: Sequence[int], block_tables: torch.Tensor) -> PrefillRows:
        return cls(torch.tensor(list(cu_seqlens), dtype=torch.int64),
                   torch.tensor(list(start_positions), dtype=torch.int64),
                   block_tables.to(dtype=torch.int32).contiguous())

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def available() -> bool:
    return (cpu_linear.available() and cpu_elementwise.available() and cpu_ops.available()
            and cpu_ops.bf16_rows_available() and cpu_prefill.available())


def fits(dims: LayerDims, layers: Sequence[StepLayer]) -> bool:
    """Whether these shapes and weights run here; each GEMM's paths alike in every layer (a step
    picks each path once)."""
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    packed_out = cpu_linear.OUTPUT_BLOCK

    def shaped(gemm: StepGemm, out_features: int, in_features: int) -> bool:
        packed, paths = gemm.packed, {path for _, path in gemm.ranges}
        ours = paths - {OTHER}
        return ((not ours or (packed is not None and packed.dtype == BF16 and packed.dim() == 4
                              and packed.shape[0] * packed_out == out_features and packed.shape[1] * 2 == in_features
                              and packed.is_contiguous() and ours <= set(cpu_linear.PATH_NAMES)))
                and (OTHER not in paths or gemm.other is not None))

    return (available() and dims.head_dim % (2 * cpu_elementwise.ROTARY_HALF_MULTIPLE) == 0
            and dims.num_heads % dims.num_kv_heads == 0 and dims.hidden % 2 == 0
            and dims.intermediate % cpu_linear.OUTPUT_BLOCK == 0
            and all(n.dtype == BF16 and n.shape == (dims.hidden,) and n.is_contiguous()
                    for layer in layers for n in (layer.input_norm, layer.post_norm))
            and all(tuple(g.ranges for g in layer.gemms) == tuple(g.ranges for g in layers[0].gemms)
                    for layer in layers)
            and all(shaped(layer.qkv, q + 2 * kv, dims.hidden) and shaped(layer.o, dims.hidden, q)
                    and shaped(layer.gate_up, 2 * dims.intermediate, dims.hidden)
                    and shaped(layer.down, dims.hidden, dims.intermediate) for layer in layers))


def run_layers(x: torch.Tensor, layers: Sequence[StepLayer], dims: LayerDims, cache: torch.Tensor,
                  cos: torch.Tensor, signed_sin: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  prefill: PrefillRows | None = None) -> torch.Tensor:
    """The hidden rows after ``layers``: ``prefill``'s tokens first, then one decode token a row;
    ``block_tables`` and ``context_lens`` (each row's token included) are the decode rows'."""
    rows = x.shape[0]
    num_prefill = 0 if prefill is None else prefill.num_tokens
    num_decode = rows - num_prefill
    hidden, heads, kv_heads, head_dim = dims.hidden, dims.num_heads, dims.num_kv_heads, dims.head_dim
    q_width, kv_width, inter = heads * head_dim, kv_heads * head_dim, dims.intermediate
    qkv_width = q_width + 2 * kv_width
    _check(x, cache, cos, signed_sin, slot_mapping, block_tables, context_lens, dims, len(layers), num_decode)
    num_blocks, block_size = cache.shape[0], cache.shape[3]
    block_stride, layer_stride, kv_stride, token_stride, head_stride = cache.stride()[:5]
    if prefill is not None:
        cpu_prefill.check_tables(prefill.block_tables, prefill.cu_seqlens, prefill.start_positions, block_size,
                                 num_blocks)
    attention_lib = cpu_ops.library()
    if num_decode:
        cpu_ops.raise_for_tables(attention_lib.check_block_tables(
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], context_lens.data_ptr(),
            num_decode, block_size, num_blocks), context_lens, block_tables.shape[1], block_size, num_blocks)
    if rows == 0:
        return x
    elementwise = cpu_elementwise.library()
    linear: Callable[..., Any] = cpu_linear.library().linear_bf16
    swiglu: Callable[..., Any] = cpu_linear.library().linear_bf16_swiglu
    rms_norm: Callable[..., Any] = elementwise.rms_norm_bf16
    rope: Callable[..., Any] = elementwise.rope_bf16
    silu_mul: Callable[..., Any] = elementwise.silu_mul_bf16
    attention: Callable[..., Any] = getattr(attention_lib, cpu_ops.BF16_ROWS)
    write_kv: Callable[..., Any] = getattr(attention_lib, cpu_ops.WRITE_KV)
    prefill_attention: Callable[..., Any] = cpu_prefill.library().prefill_attention_bf16
    other = _other
    if _timings is not None:   # a profile (``timed``): each call clocked, by kernel family
        sink = _timings
        linear, swiglu = _clocked(linear, "gemm", sink), _clocked(swiglu, "gemm", sink)
        rms_norm, rope, silu_mul = (_clocked(rms_norm, "norm", sink), _clocked(rope, "rotary", sink),
                                    _clocked(silu_mul, "silu_mul", sink))
        attention, prefill_attention = _clocked(attention, "attention", sink), _clocked(prefill_attention,
                                                                                        "prefill_attention", sink)
        write_kv = _clocked(write_kv, "write_kv", sink)

        def other(gemm: StepGemm) -> Callable[[torch.Tensor], torch.Tensor]:
            return _clocked(_other(gemm), "gemm_other", sink)
    threads = torch.get_num_threads()
    # Each GEMM's path for this step's row count: alike in every layer (``fits``).
    qkv_path, o_path, gate_up_path, down_path = (g.path(rows) for g in layers[0].gemms) if layers else (0,) * 4

    def empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype)

    residuals = (empty(rows, hidden), empty(rows, hidden))
    normed, qkv, o, down = empty(rows, hidden), empty(rows, qkv_width), empty(rows, hidden), empty(rows, hidden)
    # q and k rotated by one call into one buffer: each row its query heads, then its KV heads.
    qk_width = q_width + kv_width
    qk_rot, attn, act = empty(rows, heads + kv_heads, head_dim), empty(rows, q_width), empty(rows, inter)
    p = _Pointers(x, normed, qkv, o, down, qk_rot, attn, act)
    k_rot = p.qk_rot + q_width * BF16_BYTES
    # The decode rows' queries and outputs: rows of qk_rot and attn after the prefill tokens.
    decode_q, decode_out = p.qk_rot + num_prefill * qk_width * BF16_BYTES, p.attn + num_prefill * q_width * BF16_BYTES
    cos_p, sin_p, slots_p = cos.data_ptr(), signed_sin.data_ptr(), slot_mapping.data_ptr()
    tables_p, table_stride, lens_p = block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr()
    v_src = p.qkv + (q_width + kv_width) * BF16_BYTES
    cache_p = cache.data_ptr()
    prefill_seqs = prefill_tables_p = prefill_table_stride = prefill_starts_p = prefill_positions_p = 0
    if prefill is not None:
        prefill_seqs = prefill.start_positions.numel()
        prefill_tables_p, prefill_table_stride = prefill.block_tables.data_ptr(), prefill.block_tables.stride(0)
        prefill_starts_p, prefill_positions_p = prefill.cu_seqlens.data_ptr(), prefill.start_positions.data_ptr()
    # The residual stream: x, then the two buffers in turn (a fused add never writes its input).
    res, res_stride, current = p.x, x.stride(0), x
    for i, layer in enumerate(layers):
        key_cache = cache_p + i * layer_stride * BF16_BYTES
        value_cache = key_cache + kv_stride * BF16_BYTES
        if i == 0:
            rms_norm(res, res_stride, None, 0, None, layer.input_norm.data_ptr(), p.normed, rows, hidden,
                     dims.rms_norm_eps, threads)
        else:   # the previous layer's MLP residual, added here
            current = residuals[0] if current is not residuals[0] else residuals[1]
            rms_norm(res, res_stride, p.down, hidden, current.data_ptr(), layer.input_norm.data_ptr(), p.normed,
                     rows, hidden, dims.rms_norm_eps, threads)
            res, res_stride = current.data_ptr(), hidden
        if qkv_path == OTHER:
            qkv.copy_(other(layer.qkv)(normed))
        else:
            linear(p.normed, rows, hidden, hidden, _packed(layer.qkv), qkv_width, None, p.qkv, threads, qkv_path)
        rope(p.qkv, qkv_width, heads + kv_heads, head_dim, cos_p, sin_p, p.qk_rot, rows, threads)
        if write_kv(k_rot, v_src, qk_width * BF16_BYTES, qkv_width * BF16_BYTES, key_cache, value_cache,
                    block_stride * BF16_BYTES, token_stride * BF16_BYTES, slots_p, rows, block_size, num_blocks,
                    kv_width * BF16_BYTES) == cpu_ops.OUTSIDE_POOL:
            raise IndexError(f"slot {int(slot_mapping.max())} lies past the cache's {num_blocks} blocks "
                             f"of {block_size}")
        if prefill is not None:   # the new K/V are in the cache: the kernel reads them there
            cpu_ops.raise_for_status("prefill_attention_bf16", prefill_attention(
                p.qk_rot, qk_width, key_cache, value_cache, block_stride, token_stride, head_stride,
                prefill_tables_p, prefill_table_stride, prefill_starts_p, prefill_positions_p, prefill_seqs, heads,
                kv_heads, head_dim, block_size, dims.scale, p.attn, threads))
        if num_decode:
            cpu_ops.raise_for_status(cpu_ops.BF16_ROWS, attention(
                decode_q, qk_width, key_cache, value_cache, block_stride, token_stride, head_stride, tables_p,
                table_stride, lens_p, num_decode, heads, kv_heads, head_dim, block_size, dims.scale, decode_out,
                q_width, threads))
        if o_path == OTHER:
            o.copy_(other(layer.o)(attn))
        else:
            linear(p.attn, rows, q_width, q_width, _packed(layer.o), hidden, None, p.o, threads, o_path)
        current = residuals[0] if current is not residuals[0] else residuals[1]
        rms_norm(res, res_stride, p.o, hidden, current.data_ptr(), layer.post_norm.data_ptr(), p.normed,
                 rows, hidden, dims.rms_norm_eps, threads)
        res, res_stride = current.data_ptr(), hidden
        if gate_up_path == OTHER:   # the GEMM, then silu_mul: the fused call's roundings
            gate_up = other(layer.gate_up)(normed)
            silu_mul(gate_up.data_ptr(), gate_up.stride(0), gate_up.data_ptr() + inter * BF16_BYTES,
                     gate_up.stride(0), p.act, rows, inter, threads)
        else:
            swiglu(p.normed, rows, hidden, hidden, _packed(layer.gate_up), inter, p.act, threads, gate_up_path)
        if down_path == OTHER:
            down.copy_(other(layer.down)(act))
        else:
            linear(p.act, rows, inter, inter, _packed(layer.down), hidden, None, p.down, threads, down_path)
    return current + down if layers else x


_timings: dict[str, float] | None = None


@contextlib.contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Seconds per kernel family of every run inside the block. Not for serving: clocks cost a call."""
    global _timings
    sink: dict[str, float] = {}
    previous, _timings = _timings, sink
    try:
        yield sink
    finally:
        _timings = previous


def _clocked(fn: Callable[..., Any], family: str, sink: dict[str, float]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            sink[family] = sink.get(family, 0.0) + time.perf_counter() - start
    return call


def _packed(gemm: StepGemm) -> int:
    assert gemm.packed is not None   # fits(): our kernel's paths have a packed weight
    return gemm.packed.data_ptr()


def _other(gemm: StepGemm) -> Callable[[torch.Tensor], torch.Tensor]:
    assert gemm.other is not None    # fits(): OTHER has a callable
    return gemm.other


class _Pointers:

    def __init__(self, x: torch.Tensor, *buffers: torch.Tensor) -> None:
        self.x = x.data_ptr()
        self.normed, self.qkv, self.o, self.down, self.qk_rot, self.attn, self.act = (b.data_ptr() for b in buffers)


def _check(x: torch.Tensor, cache: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
           slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
           dims: LayerDims, num_layers: int, num_decode: int) -> None:
    rows = x.shape[0]
    problems = []
    if not (x.dtype == BF16 and x.dim() == 2 and x.shape[1] == dims.hidden and x.stride(1) == 1
            and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0 and x.device.type == "cpu"):
        problems.append(f"x {tuple(x.shape)} {x.dtype} {x.stride()}")
    if not (cache.dtype == BF16 and cache.dim() == 6 and cache.shape[1] >= num_layers and cache.shape[2] == 2
            and tuple(cache.shape[4:]) == (dims.num_kv_heads, dims.head_dim) and cache.stride(5) == 1
            and cache.stride(4) == dims.head_dim):
        problems.append(f"cache {tuple(cache.shape)} {cache.dtype} {cache.stride()}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if not (t.dtype == BF16 and tuple(t.shape) == (rows, 1, dims.head_dim) and t.is_contiguous()):
            problems.append(f"{name} {tuple(t.shape)} {t.dtype}")
    if not (slot_mapping.dtype == torch.int64 and slot_mapping.shape == (rows,) and slot_mapping.is_contiguous()):
        problems.append(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if not (block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == num_decode
            and block_tables.stride(1) == 1):
        problems.append(f"block_tables {tuple(block_tables.shape)} {block_tables.dtype}")
    if not (context_lens.dtype == torch.int32 and context_lens.shape == (num_decode,)
            and context_lens.is_contiguous()):
        problems.append(f"context_lens {tuple(context_lens.shape)} {context_lens.dtype}")
    if problems:
        raise ValueError("run_layers: " + "; ".join(problems) + " do not fit the run")

