"""GPU checks of the data plane beyond the kernels: SDPA's fused path, no host reads in a forward,
the KV store's pinning and swap ordering on CUDA streams, the model in bf16, and greedy parity
with ``transformers`` on the GPU (fp32 and bf16, with a swap to the host pool midway).

Runs only where CUDA exists (skipped otherwise) and needs no Ray: ``python3 -m pytest -q
tests/gpu``. The model is a small random LLaMA (grouped-query attention, llama3 rope scaling)
built here and saved as a checkpoint; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastserve import kernels
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.kv_store import KVStore
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, SwapCommand
from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.greedy import SwapMidway, greedy_until_stop
from tests.harness.hf_reference import Reference, hf_greedy_reference
from tests.harness.host_reads import HostReads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LLAMA3_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
TINY_LLAMA = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny-llama-gpu")
PROMPTS = [[1, 11, 57, 100, 7], [1, 300, 4], [1, *range(20, 120)], [1, 99, 98, 97, 96, 95, 94, 93]]
NEW_TOKENS = 24
BLOCK_SIZE = 16
DEVICE_BLOCKS, HOST_BLOCKS = 64, 32
#: Job 2 (the long prompt) goes to the host pool at step 6 and comes back at step 9.
SWAP = SwapMidway("2", out_step=6, in_step=9)
WEIGHT_STD, NORM_STD = 0.08, 0.1
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: A token may differ from HF's only where HF's own top-2 logits were closer than this: the two
#: implementations' rounding differs (fp32: summation order; bf16: every matmul's rounding).
TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25}
#: Prefill logits against HF in float32 on the same weights: ||ours - ref|| / ||ref||.
LOGITS_REL_ERROR = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - e).norm() / e.norm())


# ---------------------------------------------------------------- prefill attention: fused SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (8, 2), (32, 8)])
def test_prefill_attention_takes_a_fused_kernel_on_cuda(dtype: torch.dtype, num_heads: int,
                                                        num_kv_heads: int) -> None:
    """With the math backend disabled both prefill paths still run (flash, memory-efficient or
    cuDNN), and agree with the CPU reference."""
    gen = torch.Generator().manual_seed(num_heads + num_kv_heads)
    lengths, head_dim, block_size = (37, 1, 300), 128, 16
    total = sum(lengths)
    bounds = tuple(int(x) for x in torch.tensor((0, *lengths)).cumsum(0))
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    cache = torch.randn(32, 2, block_size, num_kv_heads, head_dim, generator=gen)
    starts, tables = (40, 0, 17), torch.tensor([[3, 4, 5], [0, 0, 0], [9, 10, 0]], dtype=torch.int32)
    scale = head_dim ** -0.5
    expected = kernels.prefill_attention(q, k, v, bounds, scale)
    expected_ctx = kernels.context_prefill_attention(q, k, v, cache[:, 0], cache[:, 1], bounds, starts,
                                                     tables, scale)
    on = [t.to("cuda", dtype) for t in (q, k, v, cache)]
    with sdpa_kernel(FUSED):
        got = kernels.prefill_attention(*on[:3], bounds, scale)
        got_ctx = kernels.context_prefill_attention(*on[:3], on[3][:, 0], on[3][:, 1], bounds, starts,
                                                    tables.cuda(), scale)
    bound = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    assert rel_error(got, expected) < bound
    assert rel_error(got_ctx, expected_ctx) < bound


# ---------------------------------------------------------------- the KV store on CUDA


def test_host_pool_is_pinned_in_place_at_its_exact_size() -> None:
    kv = KVStore(num_layers=4, num_heads=2, head_dim=128, block_size=16, num_device_blocks=8,
                 num_host_blocks=3, dtype=torch.bfloat16, device="cuda")
    try:
        assert kv.host_pool.is_pinned()
        assert kv.host_pool.untyped_storage().nbytes() == 3 * kv.bytes_per_block   # not rounded up
    finally:
        kv.close()
    assert not kv.host_pool.is_pinned()   # unregistered on close


def test_swaps_see_compute_issued_before_them_and_run_in_issue_order() -> None:
    """A swap-out issued right after a slow write on the compute stream copies the written data
    (the side stream waits for the compute stream); the blocks' next owner, waiting as a step does
    (``wait_for``), overwrites them only after the copy read them; a swap-in from that host block
    issued before the swap-out finished reads it (the in-stream waits for the out-stream's copy of the
    same host blocks); the step that uses
    the swapped-in blocks waits on the copy's event (``wait_for``) without blocking the host."""
    kv = KVStore(num_layers=2, num_heads=2, head_dim=64, block_size=16, num_device_blocks=8,
                 num_host_blocks=4, dtype=torch.float16, device="cuda")
    try:
        torch.cuda._sleep(50_000_000)                  # keep the compute stream busy
        kv.device_pool[1:3].fill_(7.0)                 # ... then write the blocks to be swapped
        kv.swap(SwapCommand("out", "a", (1, 2), (0, 3)))
        # The blocks' next owner writes them only after its step's wait on the swaps touching
        # them (``StageRunner.forward`` waits for every block its batch reads or writes), so the
        # copy reads 7s, not the -1s issued after it; the host does not block.
        assert kv.wait_for([1, 2]) == 0.0
        kv.device_pool[1:3].fill_(-1.0)
        kv.swap(SwapCommand("in", "a", (0, 3), (5, 6)))
        waited = kv.wait_for([5, 6])
        assert waited == 0.0                           # the compute stream waits, not the host
        got = kv.device_pool[5:7].float()
        assert bool((got == 7.0).all())
        assert bool((kv.host_pool[[0, 3]].float() == 7.0).all())
    finally:
        kv.close()


def test_swap_wait_is_the_compute_streams_stall_read_after_the_device_passed_it() -> None:
    """A step over blocks whose swap-in is still copying does not block the host (``wait_for``
    returns 0); the compute stream's stall is timed by events around its wait and read once the
    device has passed it (``device_wait_s``), about the time the copy was held up. A wait on a
    swap already done records nothing."""
    kv = KVStore(num_layers=2, num_heads=2, head_dim=64, block_size=16, num_device_blocks=8,
                 num_host_blocks=4, dtype=torch.float16, device="cuda")
    try:
        kv.swap(SwapCommand("in", "done", (0,), (2,)))
        torch.cuda.synchronize()
        assert kv.wait_for([2]) == 0.0 and kv.device_stalls.pending == 0   # nothing to wait for
        with torch.cuda.stream(kv._streams["in"]):   # hold the swap-in stream: the next copy starts late
            torch.cuda._sleep(100_000_000)
        kv.swap(SwapCommand("in", "a", (1,), (5,)))
        assert kv.swaps_in_flight() == {"a"}            # tracked by its event, not by a step's end
        assert kv.wait_for([5]) == 0.0                  # the host went on at once
        assert kv.device_stalls.pending == 1
        torch.cuda.synchronize()                        # (the test's sync, not the store's)
        stalled = kv.device_wait_s()
        assert 0.005 < stalled < 5.0, stalled
        assert kv.device_stalls.pending == 0 and kv.device_wait_s() == 0.0
        assert kv.swaps_in_flight() == frozenset()
    finally:
        kv.close()


def test_cupys_nccl_binding_loads_libnccl_beside_torch() -> None:
    """What Ray's NCCL channels import (``fastserve.worker.nccl`` checks it in each stage worker of a GPU
    pipeline as it starts): with torch loaded first, as in a stage worker, CuPy's binding finds the
    libnccl torch's wheel brought, and has the call Ray makes. Skipped where CuPy is absent."""
    pytest.importorskip("cupy")
    import cupy.cuda.nccl as nccl

    assert nccl.available, "cupy.cuda.nccl could not load libnccl"
    assert len(nccl.get_unique_id()) > 0


# ---------------------------------------------------------------- the model on CUDA


def hf_model(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    import transformers

    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA.to_hf_dict()))
    with torch.no_grad():   # HF zero-initialises biases and ones norms: randomise them all
        for name, param in model.named_parameters():
            param.normal_(1.0, NORM_STD) if "norm" in name else param.normal_(0.0, WEIGHT_STD)
    model.generation_config.eos_token_id = None   # our runs ignore EOS; so must generate
    return model.eval().to("cuda", dtype)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    hf_model(torch.float32).save_pretrained(path)
    return path


def executor(path: Path, dtype: torch.dtype) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY_LLAMA, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE,
                                       dtype=DTYPE_NAMES[dtype], device="cuda", load_format="auto",
                                       model_path=str(path)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_model_is_built_on_the_gpu_in_its_dtype_and_its_logits_match_hf(checkpoint: Path,
                                                                       dtype: torch.dtype) -> None:
    ex = executor(checkpoint, dtype)
    try:
        params = list(ex.model.parameters())
        assert all(p.is_cuda and p.dtype == dtype for p in params)
        hf32 = hf_model(torch.float32)
        greedy = SamplingParams(temperature=0.0)
        entries = tuple(BatchEntry(str(i), tuple(p), 0, tuple(range(8 * i, 8 * i + 8)), True, greedy)
                        for i, p in enumerate(PROMPTS[:3]))
        batch = ex.runner.build_batch(BatchPlan(0, entries))
        with torch.inference_mode():
            logits = ex.model.logits(ex.runner.forward(batch, None, {}))
            ref = torch.cat([hf32(torch.tensor([p], device="cuda")).logits[0] for p in PROMPTS[:3]])
        assert rel_error(logits.float(), ref.float()) < LOGITS_REL_ERROR[dtype]
    finally:
        ex.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_a_forward_reads_nothing_back_to_the_host(checkpoint: Path, dtype: torch.dtype) -> None:
    """A mixed step (two prefills, one a chunk over a cached prefix; a decode) runs its layers
    without one host read: no per-layer sync with the GPU."""
    ex = executor(checkpoint, dtype)
    try:
        assert kernels.backend_for(ex.kv.device_pool) == kernels.CUDA_BACKEND   # CuPy kernels, probed
        greedy = SamplingParams(temperature=0.0)
        first = BatchPlan(0, (BatchEntry("a", tuple(PROMPTS[2][:40]), 0, (0, 1, 2), True, greedy),
                              BatchEntry("b", tuple(PROMPTS[0]), 0, (3,), True, greedy)))
        ex.execute(first)
        mixed = BatchPlan(1, (BatchEntry("a", tuple(PROMPTS[2][40:]), 40, (0, 1, 2, 4, 5, 6, 7), True, greedy),
                              BatchEntry("b", (5,), len(PROMPTS[0]), (3,), False, greedy, 1),
                              BatchEntry("c", tuple(PROMPTS[1]), 0, (8,), True, greedy)))
        batch = ex.runner.build_batch(mixed)
        with torch.inference_mode(), HostReads() as reads:
            ex.runner.forward(batch, None, {})
        assert reads.count == 0, reads.names
    finally:
        ex.close()


@pytest.fixture(scope="module")
def hf_references() -> dict[torch.dtype, dict[str, Reference]]:
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = hf_model(dtype)
        refs[dtype] = {str(i): hf_greedy_reference(hf, p, NEW_TOKENS, None) for i, p in enumerate(PROMPTS)}
    return refs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_greedy_tokens_match_generate_with_a_swap_midway(checkpoint: Path, dtype: torch.dtype,
                                                        hf_references: dict[torch.dtype, dict[str, Reference]]
                                                        ) -> None:
    """Our engine's greedy tokens, with job 2 swapped to pinned host memory and back midway, equal
    HF ``generate``'s in the same dtype on the same GPU up to the first position where HF itself
    was tied (top-2 logits closer than the dtype's rounding); after such a tie the two runs
    legitimately continue differently, so the comparison ends there."""
    driver = Driver(executor(checkpoint, dtype))
    try:
        ours = greedy_until_stop(driver, PROMPTS, NEW_TOKENS, None, swap=SWAP)
        assert driver.swaps == {"out": 1, "in": 1}
    finally:
        driver.ex.close()
    for job, ref in hf_references[dtype].items():
        for pos, (mine, theirs) in enumerate(zip(ours[job], ref.tokens, strict=True)):
            if mine != theirs:
                assert ref.top2_gaps[pos] < TIE_GAP[dtype], (
                    f"job {job}: token {pos}: ours {mine}, HF {theirs}, HF preferred it by {ref.top2_gaps[pos]:.3g}")
                break
