"""The parts of the CUDA path whose logic runs on a CPU: what reaches torch's SDPA, and
that the forward never reads a device tensor back to the host.

- SDPA's fused kernels take 4-D inputs only; a 3-D call falls back to the math path, which
  materialises the ``[H, L, L]`` scores. The CPU has a fused kernel with the same rule (flash), so
  forcing it with ``sdpa_kernel`` here fails exactly where a GPU would take the math path.
- A host read of a tensor's values (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``) stalls
  the host on a GPU until the device catches up (``tests.harness.host_reads`` counts them on any
  device); prefill attention, run on the host-side bounds the batch keeps, makes none.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastserve import kernels
from fastserve.worker.kv_store import KVStore, pinned_allocator_bytes, register_host_memory
from fastserve.worker.messages import BatchEntry, SamplingParams
from fastserve.worker.model.batch import ForwardBatch
from fastserve.worker.parallel import TensorParallelGroup, cuda_device_index
from tests.harness.host_reads import host_reads

HEAD_DIM = 16
BLOCK_SIZE = 4
SCALE = HEAD_DIM ** -0.5
GQA_SHAPES = [(4, 4), (4, 2), (6, 1)]   # (query heads, KV heads)
LENGTHS = (5, 1, 9)                     # prefill sequences packed in one batch


def packed(num_heads: int, num_kv_heads: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    total = sum(LENGTHS)
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
    return q, k, v


def bounds() -> tuple[int, ...]:
    out = [0]
    for n in LENGTHS:
        out.append(out[-1] + n)
    return tuple(out)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_prefill_attention_runs_on_a_fused_sdpa_kernel(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    q, k, v = packed(num_heads, num_kv_heads, gen)
    with sdpa_kernel([SDPBackend.MATH]):
        expected = kernels.prefill_attention(q, k, v, bounds(), SCALE)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):   # raises "No available kernel" on 3-D inputs
        fused = kernels.prefill_attention(q, k, v, bounds(), SCALE)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_context_prefill_attention_runs_on_a_fused_sdpa_kernel(num_heads: int, num_kv_heads: int) -> None:
    """A chunk continuing a cached prefix (lower-right causal mask) and a fresh sequence."""
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    q, k, v = packed(num_heads, num_kv_heads, gen)
    num_blocks = 8
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    starts = (6, 0, 3)
    tables = torch.tensor([[1, 2, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0]], dtype=torch.int32)
    args = (q, k, v, cache[:, 0], cache[:, 1], bounds(), starts, tables, SCALE)
    with sdpa_kernel([SDPBackend.MATH]):
        expected = kernels.context_prefill_attention(*args)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fused = kernels.context_prefill_attention(*args)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_the_batch_keeps_prefill_bounds_on_the_host() -> None:
    greedy = SamplingParams(temperature=0.0)
    entries = [
        BatchEntry("a", (3, 4, 5), 0, (0,), is_prefill=True, sampling=greedy),
        BatchEntry("b", (7,), 5, (1, 2), is_prefill=False, sampling=greedy),
        BatchEntry("c", (8, 9), 0, (3,), is_prefill=True, sampling=greedy),
    ]
    batch = ForwardBatch.build(entries, BLOCK_SIZE)
    assert batch.prefill_cu_seqlens == (0, 3, 5)
    assert all(type(b) is int for b in batch.prefill_cu_seqlens)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA_SHAPES)
def test_prefill_attention_reads_nothing_back_from_the_device(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = packed(num_heads, num_kv_heads, gen)
    cache = torch.randn(8, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    tables = torch.tensor([[1, 2, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0]], dtype=torch.int32)
    assert host_reads(lambda: kernels.prefill_attention(q, k, v, bounds(), SCALE)) == 0
    assert host_reads(lambda: kernels.context_prefill_attention(
        q, k, v, cache[:, 0], cache[:, 1], bounds(), (6, 0, 3), tables, SCALE)) == 0
    # The counter counts: bounds handed over as a tensor are read back, once per call.
    assert host_reads(lambda: kernels.prefill_attention(q, k, v, torch.tensor(bounds()), SCALE)) == 1


# ---------------------------------------------------------------- pinned host pool sizes


def test_torchs_pinned_allocator_would_round_llama3_70b_swap_space_to_a_power_of_two() -> None:
    """The host pool of one llama3-70b.yaml rank: 60,000 blocks of 640 KiB (80 layers x K/V x 1 KV
    head x 128 x 16 tokens x bf16) = 36.6 GiB, which ``pin_memory=True`` would make 64 GiB; the
    KV store registers exactly the pool instead."""
    layers, kv_heads, head_dim, block_size, blocks = 80, 1, 128, 16, 60_000
    pool = blocks * layers * 2 * block_size * kv_heads * head_dim * torch.bfloat16.itemsize
    assert pool == 39_321_600_000
    assert pinned_allocator_bytes(pool) == 64 * 2**30
    assert [pinned_allocator_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]


def test_the_host_pool_is_exactly_its_blocks() -> None:
    kv = KVStore(num_layers=3, num_heads=2, head_dim=8, block_size=4, num_device_blocks=5,
                 num_host_blocks=7, dtype=torch.bfloat16)
    try:
        assert kv.host_pool.untyped_storage().nbytes() == 7 * kv.bytes_per_block
        assert kv.host_pool.is_contiguous() and not kv._registered   # only a CUDA store registers
    finally:
        kv.close()


def test_registering_refuses_what_cuda_cannot_pin_in_place() -> None:
    with pytest.raises(ValueError, match="only a contiguous CPU tensor can be registered"):
        register_host_memory(torch.zeros(4, 6)[:, ::2])
    assert register_host_memory(torch.zeros(0, 6)) is False   # nothing to pin, no CUDA call


# ---------------------------------------------------------------- the TP group's device


@pytest.mark.parametrize(("gpu_ids", "visible", "index"), [
    ([3], "3", 0),              # Ray hid the other GPUs: the one visible is device 0
    ([5], "4,5,6", 1),          # several visible: the assigned one's place in the list
    (["2"], None, 2),           # nothing hides them: the id is the index
])
def test_the_worker_finds_its_cuda_index(gpu_ids: list[int | str], visible: str | None, index: int) -> None:
    assert cuda_device_index(gpu_ids, visible) == index


def test_a_gpu_missing_from_the_visible_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"GPU 7 assigned by Ray is not in CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_device_index([7], "0,1")
    with pytest.raises(ValueError, match="no GPU is assigned"):
        cuda_device_index([], "0")


def test_the_gloo_group_takes_no_device_and_a_bad_index_is_refused() -> None:
    assert TensorParallelGroup("cpu").process_group_options() == {}
    with pytest.raises(ValueError, match="device_index must be >= 0, got -1"):
        TensorParallelGroup("cpu", -1)


# ---------------------------------------------------------------- building the model in place


def test_the_model_is_built_in_its_dtype_and_equals_a_cast_of_the_fp32_build() -> None:
    """Built in bf16 directly (no fp32 copy first), the weights are exactly the fp32 build's cast."""
    from fastserve.worker.executor import build_stage
    from fastserve.worker.model.config import OPTConfig
    from fastserve.worker.model.shard import StageShard

    tiny = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     ffn_dim=64, max_position_embeddings=64, name="tiny")
    whole = StageShard.whole(tiny)
    fp32 = build_stage(tiny, whole, "float32", "cpu", "dummy", None, seed=3)
    bf16 = build_stage(tiny, whole, "bfloat16", "cpu", "dummy", None, seed=3)
    assert torch.get_default_dtype() == torch.float32   # restored
    cast = {n: p.to(torch.bfloat16) for n, p in fp32.named_parameters()}
    params = dict(bf16.named_parameters())
    assert params.keys() == cast.keys()
    for name, p in params.items():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, cast[name]), name
