"""CPU tests of the kernels package: torch references vs naive per-token loops, and nvcc builds.

The naive implementations below are the executable spec: they walk tokens and slots one at a
time in float64, with none of the batching, gathering or masking the references use. Caches are
always per-layer views of a block-major ``[num_blocks, num_layers, 2, block_size, H, D]`` tensor,
so dim 0 is strided exactly as in the model.
"""

from __future__ import annotations

import ast
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastserve import kernels
from fastserve.kernels import reference
from fastserve.worker.messages import blocks_for

KERNELS_DIR = Path(kernels.__file__).resolve().parent
CUDA_SOURCES = sorted((KERNELS_DIR / "cuda").glob("*.cu"))
NVCC_ARCH = "sm_90"
NVCC_TIMEOUT_S = 120

NUM_LAYERS = 3
LAYER = 1  # a middle layer, so neither neighbour's storage is adjacent by accident
KEY, VALUE = 0, 1
PAD_SLOT = -1

# Absolute/relative tolerances vs a float64 loop, per storage dtype (output rounding dominates).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
ATTN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_cache(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> torch.Tensor:
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def layer_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[:, LAYER, KEY], cache[:, LAYER, VALUE]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- naive loop implementations


def naive_write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[token]
        value_cache[block, offset] = value[token]


def naive_attend(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """One query [H, D] against a list of [H, D] keys/values, float64, per head."""
    num_heads, head_dim = q.shape
    out = torch.zeros(num_heads, head_dim, dtype=torch.float64)
    for head in range(num_heads):
        scores = [scale * float(q[head].double() @ k[head].double()) for k in keys]
        peak = max(scores)
        weights = [math.exp(s - peak) for s in scores]
        total = sum(weights)
        for w, v in zip(weights, values, strict=True):
            out[head] += (w / total) * v[head].double()
    return out


def naive_prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    out = torch.zeros(query.shape, dtype=torch.float64)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        for t in range(start, end):
            visible = range(start, t + 1)
            out[t] = naive_attend(
                query[t], [key[j] for j in visible], [value[j] for j in visible], scale
            )
    return out


def naive_paged(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    block_size = key_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for seq, context_len in enumerate(context_lens.tolist()):
        keys, values = [], []
        for pos in range(context_len):
            block = int(block_tables[seq, pos // block_size])
            keys.append(key_cache[block, pos % block_size])
            values.append(value_cache[block, pos % block_size])
        out[seq] = naive_attend(query[seq], keys, values, scale)
    return out


# ---------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_write_kv_matches_naive_with_padding(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_heads, head_dim, num_tokens = 13, 3, 8, 11
    cache = make_cache(num_blocks, block_size, num_heads, head_dim, dtype, gen)
    expected_cache = cache.clone()
    key = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = PAD_SLOT

    key_cache, value_cache = layer_views(cache)
    assert not key_cache.is_contiguous()
    kernels.write_kv(key_cache, value_cache, key, value, slots)
    naive_write_kv(*layer_views(expected_cache), key, value, slots)

    # Bit-exact over the WHOLE cache: other layers and the padded tokens' slots are untouched.
    assert torch.equal(cache, expected_cache)


def test_write_kv_strided_sources_and_all_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_heads, head_dim, num_tokens = 4, 3, 2, 4, 5
    cache = make_cache(num_blocks, block_size, num_heads, head_dim, torch.float32, gen)
    # Key/value as slices of a fused QKV projection: strided along tokens.
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 4, 11, 5, 1])
    expected_cache = cache.clone()
    kernels.write_kv(*layer_views(cache), key, value, slots)
    naive_write_kv(*layer_views(expected_cache), key, value, slots)
    assert torch.equal(cache, expected_cache)

    untouched = cache.clone()
    kernels.write_kv(*layer_views(cache), key, value, torch.full((num_tokens,), PAD_SLOT))
    assert torch.equal(cache, untouched)


# ---------------------------------------------------------------- prefill_attention


@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=dtype_id)
def test_prefill_attention_matches_naive(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, head_dim = 3, 16
    seq_lens = [1, 7, 13, 4]
    cu_seqlens = [0]
    for n in seq_lens:
        cu_seqlens.append(cu_seqlens[-1] + n)
    num_tokens = cu_seqlens[-1]
    query, key, value = (
        torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype) for _ in range(3)
    )
    scale = head_dim**-0.5

    out = kernels.prefill_attention(query, key, value, torch.tensor(cu_seqlens), scale)

    assert out.shape == query.shape
    assert_close(out, naive_prefill(query, key, value, cu_seqlens, scale), dtype)


def test_prefill_attention_is_causal_and_per_sequence() -> None:
    gen = torch.Generator().manual_seed(2)
    num_heads, head_dim = 2, 8
    query, key, value = (torch.randn(10, num_heads, head_dim, generator=gen) for _ in range(3))
    cu_seqlens = torch.tensor([0, 6, 10], dtype=torch.int32)
    out = kernels.prefill_attention(query, key, value, cu_seqlens, 0.5)

    # Changing a later token (or another sequence) must not change earlier outputs.
    key2, value2 = key.clone(), value.clone()
    key2[4:], value2[4:] = 0.0, 0.0
    out2 = kernels.prefill_attention(query, key2, value2, cu_seqlens, 0.5)
    assert torch.equal(out[:4], out2[:4])
    # The first token of each sequence sees only itself.
    assert torch.allclose(out[[0, 6]], value[[0, 6]], atol=1e-6)


# ---------------------------------------------------------------- paged_attention


def make_paged_case(
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random cache + query; each sequence gets distinct, shuffled (non-sequential) blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [blocks_for(n, block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # one extra column so every row has 0-padding
    num_blocks = sum(blocks_per_seq) + 2
    cache = make_cache(num_blocks, block_size, num_heads, head_dim, dtype, gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = torch.tensor([order.pop() for _ in range(n)])
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return query, cache, block_tables, lens


@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_attention_matches_naive(dtype: torch.dtype, block_size: int) -> None:
    # Lengths end mid-block, exactly on a block boundary, and at 1.
    context_lens = [1, block_size, 2 * block_size + 1, 5 * block_size - 1, 17]
    num_heads, head_dim = 2, 24
    query, cache, tables, lens = make_paged_case(
        context_lens, block_size, num_heads, head_dim, dtype, seed=block_size
    )
    key_cache, value_cache = layer_views(cache)
    scale = head_dim**-0.5

    out = kernels.paged_attention(query, key_cache, value_cache, tables, lens, scale)

    assert out.shape == query.shape
    expected = naive_paged(query, key_cache, value_cache, tables, lens, scale)
    assert_close(out, expected, dtype)
    # The dispatcher may pick the C kernel for float32: hold the torch reference to the spec too.
    assert_close(reference.paged_attention(query, key_cache, value_cache, tables, lens, scale), expected, dtype)


HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
# 3 threads on 5 sequences split each sequence's heads into uneven runs (2 + 1 of 3 heads).
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("block_size", "head_dim"), [(1, 24), (3, 64), (16, 24), (16, 80)])
def test_cpu_kernel_paged_attention_matches_naive(block_size: int, head_dim: int, threads: int) -> None:
    # head_dim 24 and 80 exercise the dot product's tail past its 16 vector lanes.
    from fastserve.kernels import cpu_ops

    assert cpu_ops.available(), "the C compiler is there, so the CPU kernels must build"
    context_lens = [1, block_size, 2 * block_size + 1, 5 * block_size - 1, 17]
    query, cache, tables, lens = make_paged_case(context_lens, block_size, 3, head_dim, torch.float32, seed=7)
    key_cache, value_cache = layer_views(cache)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    expected = naive_paged(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    assert_close(out, expected, torch.float32)
    reference_out = reference.paged_attention(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, reference_out, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("block_size", "head_dim", "num_kv_heads"), [(1, 24, 3), (16, 64, 1), (16, 80, 3)])
def test_cpu_kernel_bf16_cache_matches_naive(block_size: int, head_dim: int, num_kv_heads: int,
                                             threads: int) -> None:
    # A bf16 cache is widened to float32 exactly and everything after is float32, so with a
    # float32 query the result is the float64 spec's on the same bf16 values to float32 rounding;
    # a bf16 query comes back bf16, rounded once.
    from fastserve.kernels import cpu_ops

    context_lens = [1, block_size, 2 * block_size + 1, 5 * block_size - 1, 17]
    query, cache, tables, lens = make_paged_case(context_lens, block_size, num_kv_heads, head_dim,
                                                 torch.bfloat16, seed=5)
    query = torch.randn(len(context_lens), 3, head_dim, generator=torch.Generator().manual_seed(6))
    key_cache, value_cache = layer_views(cache)
    scale = head_dim**-0.5
    group = 3 // num_kv_heads   # the spec walks one KV head per query head: repeat them
    dense_k, dense_v = (c.repeat_interleave(group, dim=2) for c in (key_cache, value_cache))
    expected = naive_paged(query, dense_k, dense_v, tables, lens, scale)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.paged_attention_backend(query.to(torch.bfloat16), key_cache) == kernels.CPU_BACKEND
        out = cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, scale)
        out_bf16 = kernels.paged_attention(query.to(torch.bfloat16), key_cache, value_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(previous)
    assert_close(out, expected, torch.float32)
    assert_close(out_bf16, naive_paged(query.to(torch.bfloat16), dense_k, dense_v, tables, lens, scale),
                 torch.bfloat16)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("num_heads", [1, 7, 12])
def test_cpu_kernel_splits_a_lone_sequence_over_its_heads(num_heads: int) -> None:
    # One sequence on two threads is cut into runs of heads (the kernel's work items); every
    # head's output must be what it would be alone, whatever the run it fell in.
    from fastserve.kernels import cpu_ops

    query, cache, tables, lens = make_paged_case([37], 16, num_heads, 64, torch.float32, seed=11)
    key_cache, value_cache = layer_views(cache)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    assert_close(out, naive_paged(query, key_cache, value_cache, tables, lens, 0.125), torch.float32)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_cpu_kernel_rejects_tables_outside_the_pool() -> None:
    from fastserve.kernels import cpu_ops

    query, cache, tables, lens = make_paged_case([5, 9], 4, 2, 8, torch.float32, seed=3)
    key_cache, value_cache = layer_views(cache)
    tables[1, 1] = key_cache.shape[0]   # one past the last block, inside the context
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.3)
    with pytest.raises(ValueError, match="do not match"):
        cpu_ops.paged_attention(query[:, :1], key_cache, value_cache, tables, lens, 0.3)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_cpu_kernel_rejects_a_context_longer_than_its_table() -> None:
    from fastserve.kernels import cpu_ops

    query, cache, tables, lens = make_paged_case([5, 9], 4, 2, 8, torch.float32, seed=3)
    key_cache, value_cache = layer_views(cache)
    lens[1] = tables.shape[1] * key_cache.shape[1] + 1
    with pytest.raises(ValueError, match="needs more than the table's"):
        cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, 0.3)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_kv_equals_the_reference(dtype: torch.dtype) -> None:
    # The C copy writes exactly what the torch reference writes: strided value rows (a view of a
    # merged q/k/v output), a padding slot (-1) skipped, slots in several blocks of a layer view.
    from fastserve.kernels import cpu_ops

    torch.manual_seed(5)
    pool = torch.randn(6, 3, 2, 4, 2, 8).to(dtype)   # [blocks, layers, K/V, block_size, heads, dim]
    merged = torch.randn(5, 3 * 16).to(dtype)
    key = merged[:, 16:32].view(5, 2, 8).contiguous()
    value = merged[:, 32:].view(5, 2, 8)             # rows 48 elements apart
    slots = torch.tensor([0, 5, -1, 23, 9])
    ours, ref = pool.clone(), pool.clone()
    assert cpu_ops.supports_write(ours[:, 1, 0], key, value)
    kernels.write_kv(ours[:, 1, 0], ours[:, 1, 1], key, value, slots)
    reference.write_kv(ref[:, 1, 0], ref[:, 1, 1], key, value, slots)
    assert torch.equal(ours, ref) and not torch.equal(ours, pool)
    # A slot past the pool is refused before anything is written.
    with pytest.raises(IndexError, match="past the cache's 6 blocks of 4"):
        cpu_ops.write_kv(ours[:, 0, 0], ours[:, 0, 1], key, value, torch.tensor([0, 1, 2, 3, 24]))
    assert torch.equal(ours, ref)
    # Rows that need a cast, or are not contiguous runs of heads, go to the reference.
    assert not cpu_ops.supports_write(ours[:, 1, 0], key.double(), value.double())
    assert not cpu_ops.supports_write(ours[:, 1, 0], key.transpose(1, 2).contiguous().transpose(1, 2), value)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_paged_attention_dispatch_by_device_dtype_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    query, cache, _, _ = make_paged_case([5], 4, 2, 8, torch.float32, seed=3)
    key_cache, _ = layer_views(cache)
    assert kernels.paged_attention_backend(query, key_cache) == kernels.CPU_BACKEND
    bf16 = query.to(torch.bfloat16)
    assert kernels.paged_attention_backend(bf16, key_cache.to(torch.bfloat16)) == kernels.CPU_BACKEND
    half = query.to(torch.float16)
    assert kernels.paged_attention_backend(half, key_cache.to(torch.float16)) == kernels.TORCH_BACKEND
    # A bf16 query on a float32 cache is no kernel's case.
    assert kernels.paged_attention_backend(bf16, key_cache) == kernels.TORCH_BACKEND
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "torch")
    assert kernels.paged_attention_backend(query, key_cache) == kernels.TORCH_BACKEND


def test_cpu_kernel_build_is_cached_and_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastserve.kernels import cpu_ops

    monkeypatch.setenv(cpu_ops.CACHE_ENV_VAR, str(tmp_path))
    with pytest.raises(cpu_ops.KernelBuildError, match="failed|No such file"):
        cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE, compiler="/bin/false")
    assert list(tmp_path.iterdir()) == []   # nothing half-written is left behind
    if HAVE_CC:
        first = cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE)
        assert first.parent == tmp_path and cpu_ops.build(cpu_ops.PAGED_ATTENTION_SOURCE) == first


def test_paged_attention_ignores_positions_past_context() -> None:
    query, cache, tables, lens = make_paged_case([5, 9], 4, 2, 8, torch.float32, seed=3)
    key_cache, value_cache = layer_views(cache)
    out = kernels.paged_attention(query, key_cache, value_cache, tables, lens, 0.3)
    # Poison every slot past each context (rest of the last block, and padded block 0 entries
    # other sequences do not own): results must not move.
    for seq, n in enumerate(lens.tolist()):
        last_block = int(tables[seq, (n - 1) // 4])
        key_cache[last_block, (n - 1) % 4 + 1 :] = float("nan")
        value_cache[last_block, (n - 1) % 4 + 1 :] = float("nan")
    again = kernels.paged_attention(query, key_cache, value_cache, tables, lens, 0.3)
    assert torch.equal(out, again)


def test_decode_after_prefill_matches_prefill_last_token() -> None:
    """write_kv + paged_attention of the last token == prefill output of that token."""
    gen = torch.Generator().manual_seed(4)
    num_heads, head_dim, block_size, seq_len = 2, 8, 5, 12
    q, k, v = (torch.randn(seq_len, num_heads, head_dim, generator=gen) for _ in range(3))
    cache = make_cache(4, block_size, num_heads, head_dim, torch.float32, gen)
    table = torch.tensor([[3, 0, 2]], dtype=torch.int32)
    slots = torch.tensor(
        [int(table[0, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
    )
    kernels.write_kv(*layer_views(cache), k, v, slots)

    prefill = kernels.prefill_attention(q, k, v, torch.tensor([0, seq_len]), 0.25)
    decode = kernels.paged_attention(
        q[-1:], *layer_views(cache), table, torch.tensor([seq_len], dtype=torch.int32), 0.25
    )
    torch.testing.assert_close(decode[0], prefill[-1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- copy_blocks


def test_coalesce_runs_groups_only_consecutive_pairs() -> None:
    src = [3, 4, 5, 9, 1, 2, 7, 8]
    dst = [0, 1, 2, 7, 8, 9, 4, 6]
    assert reference.coalesce_runs(src, dst) == [
        (3, 0, 3),  # 3,4,5 -> 0,1,2
        (9, 7, 1),
        (1, 8, 2),  # 1,2 -> 8,9
        (7, 4, 1),  # 7 -> 4, 8 -> 6: src consecutive but dst not, so two copies
        (8, 6, 1),
    ]
    assert reference.coalesce_runs(torch.tensor([2, 3]), torch.tensor([5, 6])) == [(2, 5, 2)]
    assert reference.coalesce_runs([], []) == []


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([0, 1, 2, 3], [4, 5, 6, 7]),
        ([5, 0, 6, 2], [1, 3, 2, 0]),
        ([7, 1, 2, 3, 9], [0, 4, 5, 6, 2]),
    ],
)
def test_copy_blocks_matches_per_block_copy(src_ids: list[int], dst_ids: list[int]) -> None:
    gen = torch.Generator().manual_seed(5)
    src = make_cache(10, 3, 2, 4, torch.bfloat16, gen)
    dst = make_cache(8, 3, 2, 4, torch.bfloat16, gen)
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = src[s]
    kernels.copy_blocks(src, dst, torch.tensor(src_ids), dst_ids)
    assert torch.equal(dst, expected)


def test_copy_blocks_rejects_bad_input() -> None:
    src = torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="ids"):
        kernels.copy_blocks(src, torch.zeros(4, 2, 3), [0, 1], [0])
    with pytest.raises(ValueError, match="mismatch"):
        kernels.copy_blocks(src, torch.zeros(4, 2, 4), [0], [0])
    with pytest.raises(IndexError, match="out of range"):
        kernels.copy_blocks(src, torch.zeros(4, 2, 3), [3, 4], [0, 1])
    with pytest.raises(IndexError, match="out of range"):
        kernels.copy_blocks(src, torch.zeros(4, 2, 3), [0], [-1])


# ---------------------------------------------------------------- dispatch and packaging


def test_cpu_tensors_use_torch_backend_without_loading_cupy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert kernels.backend_for(torch.zeros(1)) == kernels.TORCH_BACKEND
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "torch")
    assert kernels.backend_for(torch.zeros(1)) == kernels.TORCH_BACKEND
    assert "fastserve.kernels.cupy_ops" not in sys.modules


def test_kernels_import_cupy_lazily() -> None:
    """Importing the kernels never needs CUDA: cupy is imported at module level only by
    ``cupy_ops``, which is itself imported once cupy works (the tower test checks the rest)."""
    eager = []
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                if any(str(name).split(".")[0] == "cupy" for name in names):
                    eager.append(path.name)
    assert eager == ["cupy_ops.py"]


def test_cuda_sources_exist() -> None:
    names = {p.name for p in CUDA_SOURCES}
    assert {"paged_attention.cu", "write_kv.cu"} <= names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles(source: Path, tmp_path: Path) -> None:
    ptx = tmp_path / f"{source.stem}.ptx"
    result = subprocess.run(
        ["nvcc", f"-arch={NVCC_ARCH}", "--ptx", "-o", str(ptx), str(source)],
        capture_output=True,
        text=True,
        timeout=NVCC_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = ptx.read_text()
    # One entry per dtype; gather_kv.cu (a bit-exact copy) has one per word width instead.
    suffixes = ("w16", "w4", "w2") if source.name == "gather_kv.cu" else kernels.CUDA_KERNEL_SUFFIX.values()
    for suffix in suffixes:
        assert f".entry {source.stem}_{suffix}" in text, f"{source.stem}_{suffix} not exported"


# ---------------------------------------------------------------- grouped-query attention


def expand_kv_heads(cache: torch.Tensor, group: int) -> torch.Tensor:
    """A dense MHA copy of a GQA cache/tensor: each KV head repeated for its ``group`` query heads."""
    return cache.repeat_interleave(group, dim=-2)


GQA_SHAPES = [(4, 2), (4, 1), (6, 3)]   # (query heads, KV heads)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_prefill_attention_gqa_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(11)
    cu = [0, 5, 6, 19]
    head_dim = 16
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    key = torch.randn(cu[-1], num_kv_heads, head_dim, generator=gen)
    value = torch.randn(cu[-1], num_kv_heads, head_dim, generator=gen)
    out = kernels.prefill_attention(query, key, value, torch.tensor(cu), head_dim**-0.5)
    group = num_heads // num_kv_heads
    expected = naive_prefill(query, expand_kv_heads(key, group), expand_kv_heads(value, group), cu, head_dim**-0.5)
    assert_close(out, expected, torch.float32)


def gqa_paged_case(num_heads: int, num_kv_heads: int, block_size: int, head_dim: int,
                   seed: int) -> tuple[torch.Tensor, ...]:
    """A GQA case: (query with num_heads, key/value caches with num_kv_heads, tables, lens, the
    dense-MHA expected output)."""
    query_src, cache, tables, lens = make_paged_case([1, block_size + 2, 23, 40], block_size, num_kv_heads,
                                                     head_dim, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(query_src.shape[0], num_heads, head_dim, generator=gen)
    key_cache, value_cache = layer_views(cache)
    group = num_heads // num_kv_heads
    expected = naive_paged(query, expand_kv_heads(key_cache, group), expand_kv_heads(value_cache, group),
                           tables, lens, head_dim**-0.5)
    return query, key_cache, value_cache, tables, lens, expected


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_reference_paged_attention_gqa_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    query, key_cache, value_cache, tables, lens, expected = gqa_paged_case(num_heads, num_kv_heads, 4, 16, seed=5)
    out = reference.paged_attention(query, key_cache, value_cache, tables, lens, 16**-0.5)
    assert_close(out, expected, torch.float32)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernel_paged_attention_gqa_matches_dense(num_heads: int, num_kv_heads: int, threads: int) -> None:
    from fastserve.kernels import cpu_ops

    query, key_cache, value_cache, tables, lens, expected = gqa_paged_case(num_heads, num_kv_heads, 3, 24, seed=9)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_ops.paged_attention(query, key_cache, value_cache, tables, lens, 24**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert_close(out, expected, torch.float32)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_paged_attention_rejects_kv_heads_that_do_not_divide_query_heads() -> None:
    from fastserve.kernels import cpu_ops

    query, key_cache, value_cache, tables, lens, _ = gqa_paged_case(4, 2, 4, 8, seed=1)
    odd_query = torch.randn(query.shape[0], 3, 8)
    with pytest.raises(ValueError, match="do not match"):
        cpu_ops.paged_attention(odd_query, key_cache, value_cache, tables, lens, 0.3)
    with pytest.raises(ValueError, match="cannot share"):
        reference.paged_attention(odd_query, key_cache, value_cache, tables, lens, 0.3)


def test_kernel_sources_ship_in_the_package() -> None:
    # The C and CUDA sources are built at run time from the installed package: a wheel without
    # them would silently fall back to the torch reference kernels.
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = package_data["fastserve.kernels"]
    folder = root / "fastserve" / "kernels"
    sources = [p.relative_to(folder).as_posix() for p in folder.rglob("*")
               if p.suffix in (".c", ".cu", ".cuh", ".h")]
    assert {"cpu/paged_attention.c", "cpu/linear_bf16.c", "cpu/elementwise_bf16.c", "cpu/simd_math.h"} <= set(sources)
    assert all(any(fnmatch.fnmatch(s, g) for g in globs) for s in sources), (sources, globs)
