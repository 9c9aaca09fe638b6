"""GPU checks of the kernels package: CuPy kernels vs the torch reference, and swap round-trips.

Runs only where CUDA exists (skipped otherwise) and needs no Ray: ``python3 -m pytest -q
tests/gpu``. Every check draws fresh random inputs, poisons outputs with NaN first (so an element
the kernel never writes fails), and compares by relative error ||out - ref|| / ||ref|| against a
float64 reference computed on the CPU from the same (rounded) inputs.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from fastserve import kernels
from fastserve.kernels import reference
from fastserve.worker.messages import blocks_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_LAYERS = 2
LAYER = 1
KEY, VALUE = 0, 1
PAD_SLOT = -1
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Relative-error bounds per storage dtype: the output's own rounding dominates.
REL_ERROR_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Prefill runs torch SDPA, whose fused kernels may use tf32 / half intermediates.
PREFILL_REL_ERROR_BOUND = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Integer dtype of the same width, to compare tensors bit for bit (NaN == NaN included).
BITS_DTYPE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def cupy_ops() -> ModuleType:
    """The CuPy launchers; the CUDA path must actually be taken on this machine."""
    pytest.importorskip("cupy")
    from fastserve.kernels import cupy_ops as ops

    assert kernels.backend_for(torch.zeros(1, device="cuda")) == kernels.CUDA_BACKEND
    return ops


@pytest.fixture
def gen() -> torch.Generator:
    # Fresh inputs every run (seeded from the clock), reproducible from the seed in the report.
    seed = torch.seed()
    print(f"seed={seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual64, expected64 = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual64).all(), "non-finite output (unwritten or NaN)"
    return float((actual64 - expected64).norm() / expected64.norm())


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(BITS_DTYPE[tensor.dtype])


def make_cache(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> torch.Tensor:
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_heads, head_dim)
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


def paged_case(
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, block-major cache, block_tables, context_lens) with shuffled, distinct blocks."""
    blocks_per_seq = [blocks_for(n, block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # a padded column in every row
    num_blocks = sum(blocks_per_seq) + 1
    cache = make_cache(num_blocks, block_size, num_heads, head_dim, dtype, gen)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen, device="cuda")
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return query.to(dtype), cache, tables.cuda(), lens.cuda()


def reference_paged_f64(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    cache64 = cache.double().cpu()
    return reference.paged_attention(
        query.double().cpu(),
        cache64[:, LAYER, KEY],
        cache64[:, LAYER, VALUE],
        tables.cpu(),
        lens.cpu(),
        scale,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    ("block_size", "num_heads", "head_dim"),
    [(16, 12, 64), (7, 4, 80), (32, 2, 256), (1, 3, 128)],
)
def test_paged_attention_matches_reference(
    cupy_ops: ModuleType,
    gen: torch.Generator,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    head_dim: int,
) -> None:
    # Contexts shorter than the kernel's warp count, ending mid-block, on a block edge, long.
    context_lens = [1, 2, 3, block_size, 2 * block_size + 1, 300, 1037]
    query, cache, tables, lens = paged_case(
        context_lens, block_size, num_heads, head_dim, dtype, gen
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))

    cupy_ops.paged_attention(
        query, cache[:, LAYER, KEY], cache[:, LAYER, VALUE], tables, lens, scale, out=out
    )
    torch.cuda.synchronize()

    expected = reference_paged_f64(query, cache, tables, lens, scale)
    assert rel_error(out, expected) < REL_ERROR_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_paged_attention_dispatch_and_nan_past_context(
    cupy_ops: ModuleType, gen: torch.Generator, dtype: torch.dtype
) -> None:
    """The public API takes the CUDA path, and never reads past a sequence's context."""
    block_size, num_heads, head_dim = 16, 4, 64
    query, cache, tables, lens = paged_case(
        [5, 40, 17], block_size, num_heads, head_dim, dtype, gen
    )
    expected = reference_paged_f64(query, cache, tables, lens, 0.125)
    key_cache, value_cache = cache[:, LAYER, KEY], cache[:, LAYER, VALUE]
    # Unwritten slots of a real cache may hold NaN: poison every slot past each context.
    for seq, n in enumerate(lens.tolist()):
        last = int(tables[seq, (n - 1) // block_size])
        key_cache[last, (n - 1) % block_size + 1 :] = float("nan")
        value_cache[last, (n - 1) % block_size + 1 :] = float("nan")

    assert kernels.backend_for(query) == kernels.CUDA_BACKEND
    out = kernels.paged_attention(query, key_cache, value_cache, tables, lens, 0.125)
    assert rel_error(out, expected) < REL_ERROR_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("block_size", "num_heads", "head_dim"), [(16, 12, 64), (5, 3, 256)])
def test_write_kv_matches_reference_bit_exact(
    cupy_ops: ModuleType,
    gen: torch.Generator,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    head_dim: int,
) -> None:
    num_blocks, num_tokens = 9, 37
    cache = make_cache(num_blocks, block_size, num_heads, head_dim, dtype, gen)
    cache[:, LAYER] = float("nan")  # poison the layer being written
    expected = cache.clone()
    # Strided sources, as slices of a fused QKV projection.
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::5] = PAD_SLOT

    cupy_ops.write_kv(cache[:, LAYER, KEY], cache[:, LAYER, VALUE], key, value, slots)
    reference.write_kv(expected[:, LAYER, KEY], expected[:, LAYER, VALUE], key, value, slots)
    torch.cuda.synchronize()

    assert torch.equal(bits(cache), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_write_then_decode_matches_prefill(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Public API end to end on CUDA: prefill's last token == decode over the written cache."""
    num_heads, head_dim, block_size, seq_len = 8, 128, 16, 203
    q, k, v = (
        torch.randn(seq_len, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
        for _ in range(3)
    )
    cache = make_cache(16, block_size, num_heads, head_dim, dtype, gen)
    blocks = torch.randperm(16, generator=gen, device="cuda")[: blocks_for(seq_len, block_size)]
    positions = torch.arange(seq_len, device="cuda")
    slots = blocks[positions // block_size] * block_size + positions % block_size
    key_cache, value_cache = cache[:, LAYER, KEY], cache[:, LAYER, VALUE]
    scale = head_dim**-0.5

    kernels.write_kv(key_cache, value_cache, k, v, slots)
    decode = kernels.paged_attention(
        q[-1:],
        key_cache,
        value_cache,
        blocks[None, :].to(torch.int32),
        torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        scale,
    )
    expected = reference.prefill_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), torch.tensor([0, seq_len]), scale
    )
    assert rel_error(decode[0], expected[-1]) < REL_ERROR_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_attention_on_cuda_matches_cpu(gen: torch.Generator, dtype: torch.dtype) -> None:
    num_heads, head_dim = 8, 64
    seq_lens = [1, 33, 250]
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], device="cuda")
    total = sum(seq_lens)
    q, k, v = (
        torch.randn(total, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
        for _ in range(3)
    )
    out = kernels.prefill_attention(q, k, v, cu, head_dim**-0.5)
    expected = reference.prefill_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), cu.cpu(), head_dim**-0.5
    )
    assert rel_error(out, expected) < PREFILL_REL_ERROR_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_chunked_prefill_attention_on_cuda_matches_one_prefill(gen: torch.Generator,
                                                               dtype: torch.dtype) -> None:
    """Chunked prefill on CUDA (the torch gather path): a chunk at position 100 over the
    paged prefix equals the tail of one causal prefill of the whole sequence."""
    num_heads, head_dim, block_size, seq_len, past = 8, 64, 16, 180, 100
    cache = make_cache(16, block_size, num_heads, head_dim, dtype, gen)
    key_cache, value_cache = cache[:, LAYER, KEY], cache[:, LAYER, VALUE]
    q, k, v = (torch.randn(seq_len, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
               for _ in range(3))
    blocks = torch.randperm(16, device="cuda")[: -(-seq_len // block_size)]
    slots = blocks.repeat_interleave(block_size)[:seq_len] * block_size \
        + torch.arange(seq_len, device="cuda") % block_size
    kernels.write_kv(key_cache, value_cache, k, v, slots)   # the whole sequence, prefix included
    out = kernels.context_prefill_attention(
        q[past:], k[past:], v[past:], key_cache, value_cache,
        torch.tensor([0, seq_len - past], device="cuda"), (past,),
        blocks[None, :].to(torch.int32), head_dim**-0.5)
    expected = reference.prefill_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), torch.tensor([0, seq_len]),
        head_dim**-0.5)
    assert rel_error(out, expected[past:]) < PREFILL_REL_ERROR_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_copy_blocks_swap_round_trip_bit_exact(gen: torch.Generator, dtype: torch.dtype) -> None:
    """Swap out to pinned host memory and back in, on a side stream: every bit survives."""
    num_blocks, block_size, num_heads, head_dim = 24, 16, 8, 64
    device_cache = make_cache(num_blocks, block_size, num_heads, head_dim, dtype, gen)
    host_cache = torch.empty(device_cache.shape, dtype=dtype, pin_memory=True)
    host_cache.fill_(float("nan"))
    assert host_cache.is_pinned()
    back = torch.full_like(device_cache, float("nan"))
    # Runs and non-runs on both sides.
    device_ids = [3, 4, 5, 6, 11, 0, 1, 20, 17, 18]
    host_ids = [0, 1, 2, 3, 9, 14, 15, 4, 22, 23]
    return_ids = [7, 8, 9, 10, 2, 12, 13, 21, 5, 6]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the cache was filled on the default stream
    with torch.cuda.stream(side):
        kernels.copy_blocks(device_cache, host_cache, device_ids, host_ids, non_blocking=True)
        kernels.copy_blocks(host_cache, back, host_ids, return_ids, non_blocking=True)
    side.synchronize()

    for d, h, r in zip(device_ids, host_ids, return_ids, strict=True):
        assert torch.equal(bits(host_cache[h]), bits(device_cache[d].cpu()))
        assert torch.equal(bits(back[r]), bits(device_cache[d]))
    untouched = sorted(set(range(num_blocks)) - set(return_ids))
    assert torch.isnan(back[untouched].float()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 1), (32, 8)])
def test_paged_attention_gqa_matches_dense_reference(
    cupy_ops: ModuleType, gen: torch.Generator, dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    """Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads)."""
    block_size, head_dim = 16, 128
    group = num_heads // num_kv_heads
    _, cache, tables, lens = paged_case([1, 3, block_size + 1, 300], block_size, num_kv_heads, head_dim,
                                        dtype, gen)
    query = torch.randn(lens.numel(), num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    cupy_ops.paged_attention(query, cache[:, LAYER, KEY], cache[:, LAYER, VALUE], tables, lens, scale, out=out)
    torch.cuda.synchronize()
    dense = cache.repeat_interleave(group, dim=-2)   # an MHA cache with each KV head repeated
    expected = reference_paged_f64(query, dense, tables, lens, scale)
    assert rel_error(out, expected) < REL_ERROR_BOUND[dtype]


# ---------------------------------------------------------------- decode attention v2 (split)


V2_CONTEXTS = [1, 2, 17, 256, 257, 1037]   # around the 256-token partitions' edges
V2_SPLITS = (None, 1, 3)                     # chosen by the launcher, none, forced


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"),
                         [(16, 32, 8, 128), (16, 8, 1, 128), (7, 4, 4, 80), (32, 16, 2, 256),
                          (1, 12, 4, 64), (16, 24, 2, 128)])
def test_paged_attention_v2_matches_reference_and_v1(
    cupy_ops: ModuleType, gen: torch.Generator, dtype: torch.dtype, block_size: int, num_heads: int,
    num_kv_heads: int, head_dim: int,
) -> None:
    """The split kernel against the float64 reference (GQA-aware) and the one-block kernel, over
    contexts around the partition edges, GQA groups of 1-12 (tiles of 1-8 heads), and chosen,
    single and forced splits."""
    _, cache, tables, lens = paged_case(V2_CONTEXTS, block_size, num_kv_heads, head_dim, dtype, gen)
    query = torch.randn(lens.numel(), num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    scale = head_dim**-0.5
    key_cache, value_cache = cache[:, LAYER, KEY], cache[:, LAYER, VALUE]
    assert cupy_ops.v2_supports(query, key_cache, value_cache)
    expected = reference_paged_f64(query, cache, tables, lens, scale)
    old = torch.full_like(query, float("nan"))
    cupy_ops.paged_attention_v1(query, key_cache, value_cache, tables, lens, scale, out=old)
    for splits in V2_SPLITS:
        out = torch.full_like(query, float("nan"))
        cupy_ops.paged_attention_v2(query, key_cache, value_cache, tables, lens, scale, out=out, splits=splits)
        torch.cuda.synchronize()
        assert rel_error(out, expected) < REL_ERROR_BOUND[dtype], f"splits={splits}"
        # Both round once to the dtype from fp32 sums in different orders: within two roundings.
        assert rel_error(out, old) < 2 * REL_ERROR_BOUND[dtype], f"splits={splits}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_paged_attention_v2_reads_only_the_context_of_a_strided_table(
    cupy_ops: ModuleType, gen: torch.Generator, dtype: torch.dtype
) -> None:
    """Rows of a wider static table (the graphs' buffers): past-context slots hold NaN, table
    columns past the context hold garbage block ids, and the kernel reads neither."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 16, 4, 128
    _, cache, tables, lens = paged_case([3, 40, 600], block_size, num_kv_heads, head_dim, dtype, gen)
    key_cache, value_cache = cache[:, LAYER, KEY], cache[:, LAYER, VALUE]
    query = torch.randn(3, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    expected = reference_paged_f64(query, cache, tables, lens, 0.1)
    for seq, n in enumerate(lens.tolist()):
        last = int(tables[seq, (n - 1) // block_size])
        key_cache[last, (n - 1) % block_size + 1:] = float("nan")
        value_cache[last, (n - 1) % block_size + 1:] = float("nan")
    wide = torch.full((8, 512), 2**30, dtype=torch.int32, device="cuda")   # out of range past the context
    wide[:3, : tables.shape[1]] = tables
    for seq, n in enumerate(lens.tolist()):
        wide[seq, blocks_for(n, block_size):] = 2**30
    out = cupy_ops.paged_attention_v2(query, key_cache, value_cache, wide[:3], lens, 0.1)
    assert rel_error(out, expected) < REL_ERROR_BOUND[dtype]


def test_paged_attention_dispatch_takes_v2_where_it_fits(cupy_ops: ModuleType) -> None:
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert cupy_ops.v2_supports(torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda"), cache, cache)
    odd = torch.zeros(4, 16, 2, 20, dtype=torch.float16, device="cuda")   # 40-byte rows
    assert not cupy_ops.v2_supports(torch.zeros(1, 8, 20, dtype=torch.float16, device="cuda"), odd, odd)
    assert [cupy_ops.group_tile(g) for g in (1, 3, 4, 8, 12, 16, 7)] == [1, 3, 4, 8, 6, 8, 7]
