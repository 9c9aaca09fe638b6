"""GPU checks of a step at the hardware's floor: varlen prefill, fused GEMMs, sync-free inputs,
CUDA graphs, a two-stage split on one GPU, and OPT against ``transformers`` in fp16 and bf16.

Runs only where CUDA exists (skipped otherwise) and needs no Ray: ``python3 -m pytest -q
tests/gpu``. Models are small and random (built here, nothing downloaded). Tolerances as in
test_kernels_gpu.py: the output dtype's rounding dominates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastserve import kernels
from fastserve.kernels import reference
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.kv_store import KVStore
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, blocks_for
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.model.registry import build_model
from fastserve.worker.model.shard import StageShard
from fastserve.worker.model.weights import dummy_weights, load_weights
from fastserve.worker.sampler import Sampler
from fastserve.worker.spec import ModelSpec
from fastserve.worker.stage import StageRunner
from tests.harness.engine_driver import Driver
from tests.harness.greedy import SwapMidway, greedy_until_stop
from tests.harness.hf_reference import Reference, hf_greedy_reference
from tests.harness.host_reads import HostReads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HALF = [torch.float16, torch.bfloat16]
#: Flash attention's fp16/bf16 operands and fp32 softmax against a float64 reference.
PREFILL_BOUND = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
TINY_LLAMA = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, name="tiny-llama-step")
TINY_OPT = OPTConfig(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, ffn_dim=512,
                     max_position_embeddings=512, name="tiny-opt-gpu")
BLOCK_SIZE = 16
DEVICE_BLOCKS, HOST_BLOCKS = 256, 64
PROMPTS = [[1, 11, 57, 100, 7], [1, 300, 4], [1, *range(20, 140)], [1, 99, 98, 97, 96, 95, 94, 93]]
NEW_TOKENS = 24


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - e).norm() / e.norm())


@pytest.fixture
def gen() -> torch.Generator:
    seed = torch.seed()
    print(f"seed={seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


# ---------------------------------------------------------------- varlen prefill, gather


def _prefill_case(lengths: list[int], starts: list[int], heads: int, kv_heads: int, dtype: torch.dtype,
                  gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    head_dim = 128
    contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    blocks = [blocks_for(c, BLOCK_SIZE) for c in contexts]
    cache = torch.randn(sum(blocks) + 3, 2, 2, BLOCK_SIZE, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    order = torch.randperm(cache.shape[0], generator=gen, device="cuda").tolist()
    tables = torch.zeros(len(lengths), max(blocks) + 2, dtype=torch.int32)
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    key_cache, value_cache = cache[:, 1, 0], cache[:, 1, 1]
    slots = []
    for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        slots += [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s, s + n)]
    kernels.write_kv(key_cache, value_cache, k, v, torch.tensor(slots, device="cuda"))
    return q, k, v, key_cache, value_cache, tables.cuda()


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
@pytest.mark.parametrize("starts", [[0, 0, 0], [40, 0, 17]], ids=["prompts", "chunks"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (32, 8)])
def test_varlen_prefill_is_one_call_equal_to_the_reference(gen: torch.Generator, dtype: torch.dtype,
                                                           starts: list[int], heads: int, kv_heads: int) -> None:
    """Whole prompts and chunks continuing a cached prefix, GQA and not: one flash call equals the
    float64 reference (prefix read from the paged cache)."""
    lengths = [37, 1, 300]
    q, k, v, key_cache, value_cache, tables = _prefill_case(lengths, starts, heads, kv_heads, dtype, gen)
    assert kernels.varlen_prefill_supported(q, key_cache)
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    cu_k = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = 128**-0.5
    out = kernels.varlen_prefill_attention(q, k, v, key_cache, value_cache, cu_q, cu_k, max(lengths),
                                           max(contexts), starts, tables, scale)
    bounds = tuple(int(x) for x in cu_q.tolist())
    expected = reference.context_prefill_attention(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), key_cache.double().cpu(),
        value_cache.double().cpu(), bounds, starts, tables.cpu(), scale)
    assert rel_error(out, expected) < PREFILL_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_gather_kv_is_bit_exact(gen: torch.Generator, dtype: torch.dtype) -> None:
    pytest.importorskip("cupy")
    from fastserve.kernels import cupy_ops

    lengths, starts = [5, 3, 40], [30, 0, 17]
    _, _, _, key_cache, value_cache, tables = _prefill_case(lengths, starts, 4, 2, dtype, gen)
    contexts = [s + n for s, n in zip(starts, lengths, strict=True)]
    cu_k = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed_k, packed_v = cupy_ops.gather_kv(key_cache, value_cache, tables, cu_k, sum(contexts), max(contexts))
    for b, n in enumerate(contexts):
        blocks = tables[b, : blocks_for(n, BLOCK_SIZE)].long()
        want_k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:n]
        want_v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:n]
        rows = slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert torch.equal(packed_k[rows], want_k) and torch.equal(packed_v[rows], want_v)


# ---------------------------------------------------------------- a model on the GPU


def random_runner(config: LlamaConfig | OPTConfig, dtype: torch.dtype, shard: StageShard | None = None,
                  graphs: bool = True, seed: int = 0) -> StageRunner:
    """A stage with seeded dummy weights (the same for any shard of the same config and seed), its
    linears fused as the executor fuses them, and its own KV store."""
    from fastserve.worker.graphs import GraphSettings

    shard = shard or StageShard.whole(config)
    with torch.device("cuda"):
        torch.set_default_dtype(dtype)
        try:
            model = build_model(config, shard)
        finally:
            torch.set_default_dtype(torch.float32)
    load_weights(model, dummy_weights(model, seed))
    model = model.to("cuda", dtype).eval()
    model.pack_linear_weights()
    kv = KVStore(shard.num_layers, model.num_local_kv_heads, config.head_dim, BLOCK_SIZE, DEVICE_BLOCKS,
                 HOST_BLOCKS, dtype, "cuda")
    return StageRunner(model, kv, Sampler(seed), GraphSettings(enabled=graphs, max_batch=16, max_context=1024))


def prompts_plan(n: int, prompt_len: int, step: int = 0) -> BatchPlan:
    per = blocks_for(prompt_len + 64, BLOCK_SIZE)
    return BatchPlan(step, tuple(
        BatchEntry(str(b), tuple(int(t) for t in torch.randint(3, 500, (prompt_len,),
                                                               generator=torch.Generator().manual_seed(b))),
                   0, tuple(range(b * per, (b + 1) * per)), True, GREEDY) for b in range(n)))


def decode_plan(prev: BatchPlan, tokens: dict[str, int], step: int) -> BatchPlan:
    return BatchPlan(step, tuple(BatchEntry(e.job_id, (tokens[e.job_id],), e.context_len, e.block_table, False,
                                            GREEDY, step) for e in prev.entries))


def generate(runners: list[StageRunner], n: int, prompt_len: int, steps: int) -> list[dict[str, int]]:
    """Greedy tokens of ``n`` prompts through ``runners`` in order (a pipeline on one GPU)."""
    plan = prompts_plan(n, prompt_len)
    out = []
    for step in range(steps):
        hidden = None
        for runner in runners[:-1]:
            hidden = runner.run(plan, hidden, sample=False).hidden
        tokens = runners[-1].run(plan, hidden, sample=True).tokens
        out.append(tokens)
        plan = decode_plan(plan, tokens, step + 1)
    return out


def test_gpu_linears_are_fused_into_one_gemm_each() -> None:
    from fastserve.worker.model.llama import DecoderLayer

    runner = random_runner(TINY_LLAMA, torch.bfloat16)
    layer = runner.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    qkv, gate_up = layer.self_attn.qkv, layer.mlp.gate_up
    for merged in (qkv, gate_up):
        assert merged._fused is not None
        for member in merged.members:   # views of the fused weight: no second copy
            assert member.weight.untyped_storage().data_ptr() == merged._fused.untyped_storage().data_ptr()
    runner.kv.close()


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_graph_replay_equals_eager_token_for_token(batch: int) -> None:
    """At a bucket's own batch size a replay runs the eager step's kernels with the same
    arguments: the same greedy tokens, step for step."""
    steps = 12
    graphed = random_runner(TINY_LLAMA, torch.bfloat16, graphs=True)
    eager = random_runner(TINY_LLAMA, torch.bfloat16, graphs=False)
    try:
        got = generate([graphed], batch, 40, steps)
        want = generate([eager], batch, 40, steps)
        assert graphed.graphs is not None and graphed.graphs.captured == (batch,)
        assert got == want
    finally:
        graphed.kv.close()
        eager.kv.close()


def test_a_decode_step_makes_no_sync() -> None:
    """A decode step, graphed and eager, under torch's sync debug mode set to error: no pageable
    copy, no host read, no stream sync inside it (the one wait, for the sampled ids, is an event's,
    after every launch), and no host transfer the harness sees either."""
    for graphs in (True, False):
        runner = random_runner(TINY_LLAMA, torch.bfloat16, graphs=graphs)
        try:
            plan = prompts_plan(3, 30)
            tokens = runner.run(plan, None, sample=True).tokens
            plan = decode_plan(plan, tokens, 1)
            tokens = runner.run(plan, None, sample=True).tokens   # captures the bucket's graph
            plan = decode_plan(plan, tokens, 2)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with HostReads(device_only=True) as transfers:
                    out = runner.run(plan, None, sample=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert transfers.count == 0, transfers.names
            assert set(out.tokens) == {"0", "1", "2"}
        finally:
            runner.kv.close()


def test_a_two_stage_split_on_one_gpu_equals_the_whole_model() -> None:
    """Layers 0-1 and 2-3 as two stages on one GPU (hidden states passed between them, the later
    stage's graphs reading them from their static input) give the whole model's tokens."""
    whole = random_runner(TINY_LLAMA, torch.bfloat16)
    first = random_runner(TINY_LLAMA, torch.bfloat16, StageShard(0, 2, 4))
    last = random_runner(TINY_LLAMA, torch.bfloat16, StageShard(2, 4, 4))
    try:
        assert generate([first, last], 4, 33, 10) == generate([whole], 4, 33, 10)
        assert last.graphs is not None and last.graphs.captured == (4,)
    finally:
        for r in (whole, first, last):
            r.kv.close()


def test_a_swap_in_longer_than_the_forward_does_not_stretch_its_step() -> None:
    """A step that issues a swap-in for a job outside its batch returns while the copy is held up
    (one stream per direction, tracked by its event), and reports the job as still in flight: had
    the step waited for its swaps, the copy would have completed before it returned."""
    from fastserve.worker.messages import SwapCommand

    runner = random_runner(TINY_LLAMA, torch.bfloat16)
    try:
        plan = prompts_plan(2, 20)
        tokens = runner.run(plan, None, sample=True).tokens
        plan = decode_plan(plan, tokens, 1)
        runner.run(plan, None, sample=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(runner.kv._streams["in"]):
            torch.cuda._sleep(400_000_000)   # hold the swap-in stream (~0.2-0.4 s)
        far = (DEVICE_BLOCKS - 2, DEVICE_BLOCKS - 1)   # blocks no entry of the batch uses
        swap_in = (SwapCommand("in", "x", (0, 1), far),)
        out = runner.run(BatchPlan(2, decode_plan(plan, tokens, 2).entries, (), swap_in), None, sample=True)
        assert out.swaps_in_flight == {"x"}
        assert set(out.tokens) == {"0", "1"}
        torch.cuda.synchronize()
        assert runner.kv.swaps_in_flight() == frozenset()
    finally:
        runner.kv.close()


# ---------------------------------------------------------------- OPT against transformers


def hf_opt(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    import transformers

    torch.manual_seed(4321)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**TINY_OPT.to_hf_dict()))
    with torch.no_grad():   # HF zero-initialises biases and ones norms: randomise them all
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "layer_norm.weight" in name else param.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    return model.eval().to("cuda", dtype)


@pytest.fixture(scope="module")
def opt_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-opt-gpu")
    hf_opt(torch.float32).save_pretrained(path)
    return path


#: A token may differ from HF's only where HF's own top-2 logits were closer than the dtype's
#: rounding of a logit (fp16: 2^-10 relative, bf16: 2^-7, over logits of order 1-10).
OPT_TIE_GAP = {torch.float16: 0.05, torch.bfloat16: 0.25}


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
def test_opt_greedy_matches_hf_on_cuda_with_a_swap_midway(opt_checkpoint: Path, dtype: torch.dtype) -> None:
    """OPT (no GQA, biases, learned positions) in fp16 and bf16: our engine's greedy tokens, job 2
    swapped to pinned host memory and back midway, equal HF ``generate``'s on the same GPU up to
    the first position where HF itself was tied."""
    name = dtype_id(dtype)
    ex = InProcessExecutor(ModelSpec(TINY_OPT, DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE, dtype=name, device="cuda",
                                     load_format="auto", model_path=str(opt_checkpoint)))
    driver = Driver(ex)
    try:
        ours = greedy_until_stop(driver, PROMPTS, NEW_TOKENS, None, swap=SwapMidway("2", 6, 9))
        assert driver.swaps == {"out": 1, "in": 1}
    finally:
        ex.close()
    hf = hf_opt(torch.float32).to("cuda", dtype)
    refs: dict[str, Reference] = {str(i): hf_greedy_reference(hf, p, NEW_TOKENS, None) for i, p in enumerate(PROMPTS)}
    for job, ref in refs.items():
        for pos, (mine, theirs) in enumerate(zip(ours[job], ref.tokens, strict=True)):
            if mine != theirs:
                assert ref.top2_gaps[pos] < OPT_TIE_GAP[dtype], (
                    f"job {job}: token {pos}: ours {mine}, HF {theirs}, HF preferred it by {ref.top2_gaps[pos]:.3g}")
                break
