"""Our CPU bf16 prefill attention kernel (``fastserve.kernels.cpu_prefill``) against the torch reference.

The kernel reads every key and value from the paged cache (the new tokens' too, written first)
and sums in float32 in another order than SDPA, so outputs may differ by about one bf16 step.
Skipped where the kernel did not build with AVX-512 BF16 (the model then stays on SDPA).
"""

from __future__ import annotations

import pytest
import torch

from fastserve import kernels
from fastserve.kernels import cpu_prefill, reference

pytestmark = pytest.mark.skipif(not cpu_prefill.available(),
                                reason="the C compiler does not target AVX-512 BF16 on this machine")

BLOCK = 16
LAYERS = 2


def written_batch(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, num_blocks: int,
                  seed: int) -> dict:
    """A batch of prefills (start, new tokens) in a block-major cache: each sequence's prefix and
    its new K/V written at their positions through a shuffled block table; a layer view."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, LAYERS, 2, BLOCK, kv_heads, dim, generator=gen).bfloat16()
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(s + n) // BLOCK) for s, n in seqs)
    tables, keys, values, cu = [], [], [], [0]
    for start, n in seqs:
        own = [order.pop() for _ in range(-(-(start + n) // BLOCK))]
        tables.append(own + [0] * (width - len(own)))
        k = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
        v = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
        slots = torch.tensor([own[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)])
        reference.write_kv(key_cache, value_cache, k, v, slots)
        keys.append(k)
        values.append(v)
        cu.append(cu[-1] + n)
    return {"query": torch.randn(cu[-1], heads, dim, generator=gen).bfloat16(), "key": torch.cat(keys),
            "value": torch.cat(values), "key_cache": key_cache, "value_cache": value_cache,
            "cu_seqlens": tuple(cu), "start_positions": tuple(s for s, _ in seqs),
            "block_tables": torch.tensor(tables, dtype=torch.int32), "scale": dim ** -0.5}


def close_to_reference(batch: dict) -> bool:
    ours = cpu_prefill.context_prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["cu_seqlens"],
        batch["start_positions"], batch["block_tables"], batch["scale"])
    ref = reference.context_prefill_attention(**batch)
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    step = torch.ldexp(torch.ones_like(ref, dtype=torch.float32),
                       torch.frexp(ref.float().abs().clamp_min(1e-3)).exponent - 8)
    return bool(((ours.float() - ref.float()).abs() <= 2 * step).all())


@pytest.mark.parametrize("seqs", [
    [(0, 1)], [(0, 37)], [(0, 256)],                        # whole prompts
    [(50, 20)], [(768, 256)], [(15, 1)],                    # chunks continuing a prefix
    [(0, 37), (50, 20), (15, 1), (100, 300)],               # a mixed batch
])
def test_gqa_prompts_and_chunks_match_the_reference(seqs: list[tuple[int, int]]) -> None:
    blocks = sum(-(-(s + n) // BLOCK) for s, n in seqs) + 4
    assert close_to_reference(written_batch(seqs, heads=9, kv_heads=3, dim=64, num_blocks=blocks, seed=len(seqs)))


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 32), (16, 2, 128), (10, 1, 64), (128, 1, 256)])
def test_other_head_shapes(heads: int, kv_heads: int, dim: int) -> None:
    # No grouping; 8 query heads per KV head (two passes of four); one KV head for ten; 128
    # query heads on one KV head at head_dim 256 (one row a task, scratch sized at run time).
    assert close_to_reference(written_batch([(0, 33), (40, 9)], heads, kv_heads, dim, num_blocks=12, seed=dim))


def test_refuses_tables_outside_the_pool_and_shapes_it_does_not_take() -> None:
    batch = written_batch([(0, 20)], heads=9, kv_heads=3, dim=64, num_blocks=4, seed=0)
    bad = batch["block_tables"].clone()
    bad[0, 1] = 4
    with pytest.raises(IndexError, match="inside the pool of 4"):
        cpu_prefill.context_prefill_attention(batch["query"], batch["key_cache"], batch["value_cache"],
                                              batch["cu_seqlens"], batch["start_positions"], bad, 0.125)
    assert not cpu_prefill.supports(batch["query"].float(), batch["key_cache"])
    assert not cpu_prefill.supports(torch.zeros(3, 9, 48).bfloat16(), torch.zeros(2, BLOCK, 3, 48).bfloat16())
    with pytest.raises(ValueError, match="not the bf16 prefill kernel's"):
        cpu_prefill.context_prefill_attention(batch["query"].float(), batch["key_cache"], batch["value_cache"],
                                              batch["cu_seqlens"], batch["start_positions"],
                                              batch["block_tables"], 0.125)


def test_the_dispatcher_sends_bf16_cpu_prefills_to_the_kernel_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = written_batch([(0, 20)], heads=9, kv_heads=3, dim=64, num_blocks=4, seed=1)
    assert kernels.prefill_reads_cache(batch["query"], batch["key_cache"])
    assert not kernels.prefill_reads_cache(batch["query"].float(), batch["key_cache"].float())
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, kernels.TORCH_BACKEND)
    assert not kernels.prefill_reads_cache(batch["query"], batch["key_cache"])
