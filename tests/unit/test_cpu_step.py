"""``fastserve.kernels.cpu_step``: a bf16 decode step's layers as one run of C calls, bit for bit the
module path (``fastserve.worker.model.llama``) it replaces where it applies. Skipped where the kernels did
not build with AVX-512 BF16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastserve.kernels import cpu_linear, cpu_step
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model import linear
from fastserve.worker.model.batch import ForwardBatch
from fastserve.worker.model.gemm_choice import GemmChoice, GemmPolicy, GemmRole
from fastserve.worker.model.linear import onednn_linear_available
from fastserve.worker.model.llama import LlamaStage
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.spec import ModelSpec

pytestmark = pytest.mark.skipif(not cpu_step.available(),
                                reason="the C compiler does not target AVX-512 BF16 on this machine")

#: Head width 32 and every linear's out features a multiple of 32: the kernels' shapes.
CONFIG = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, name="tiny-llama-bf16")
BLOCK_SIZE = 16
BLOCKS_PER_JOB = 4
PROMPT_LENS = (5, 17, 40, 1)
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
DECODE_STEPS = 8


def _executor(dtype: str = "bfloat16", gemm_choice: str = "fixed") -> InProcessExecutor:
    ex = InProcessExecutor(ModelSpec(CONFIG, BLOCKS_PER_JOB * len(PROMPT_LENS) + 2, 0, BLOCK_SIZE, dtype=dtype,
                                     gemm_choice=gemm_choice))
    torch.manual_seed(0)
    with torch.no_grad():   # dummy norms are ones: give the norms' scales something to do
        for layer in ex.runner.model.layers:
            layer.input_layernorm.weight.normal_(1.0, 0.2)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
    return ex


def _table(job: int) -> tuple[int, ...]:
    return tuple(range(job * BLOCKS_PER_JOB, (job + 1) * BLOCKS_PER_JOB))


def _prefilled(ex: InProcessExecutor) -> list[int]:
    """Each job's prompt prefilled; returns each job's first token."""
    first = []
    for job, n in enumerate(PROMPT_LENS):
        draw = torch.Generator().manual_seed(job)
        prompt = tuple(int(t) for t in torch.randint(3, CONFIG.vocab_size, (n,), generator=draw))
        entry = BatchEntry(str(job), prompt, 0, _table(job), True, GREEDY)
        first.append(ex.execute(BatchPlan(0, (entry,))).tokens[str(job)])
    return first


@pytest.fixture
def executor() -> Iterator[InProcessExecutor]:
    ex = _executor()
    yield ex
    ex.close()


def _model(ex: InProcessExecutor) -> LlamaStage:
    model = ex.runner.model
    assert isinstance(model, LlamaStage)
    return model


def _decode_batch(tokens: list[int], step: int) -> tuple[BatchEntry, ...]:
    return tuple(BatchEntry(str(job), (tokens[job],), n + step, _table(job), False, GREEDY, step + 1)
                 for job, n in enumerate(PROMPT_LENS))


def _both_paths(model: LlamaStage, batch: ForwardBatch, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The run's hidden rows, the pool after it, and the module path's rows from the same pool
    (the pool left as the module path wrote it)."""
    before = pool.clone()
    with torch.no_grad():
        fast = model(batch, pool, None)
        after_fast = pool.clone()
        pool.copy_(before)
        run, model._step_run = model._step_run, None
        try:
            module = model(batch, pool, None)
        finally:
            model._step_run = run
    return fast, after_fast, module


def test_a_decode_step_equals_the_module_path_bit_for_bit(executor: InProcessExecutor) -> None:
    model, pool = _model(executor), executor.runner.kv.device_pool
    assert model._step_run is not None            # a bf16 stage on the bf16 kernels takes the run
    batch = ForwardBatch.build(_decode_batch(_prefilled(executor), 0), BLOCK_SIZE)
    before = pool.clone()
    fast, after_fast, module = _both_paths(model, batch, pool)
    assert fast.dtype == torch.bfloat16 and fast.shape == (len(PROMPT_LENS), CONFIG.hidden_size)
    assert torch.equal(fast, module)
    assert torch.equal(after_fast, pool)             # the same K/V rows written to the same slots
    assert not torch.equal(before, pool)


def test_greedy_steps_give_the_module_paths_tokens_and_cache(executor: InProcessExecutor) -> None:
    model, pool = _model(executor), executor.runner.kv.device_pool
    first = _prefilled(executor)
    start = pool.clone()
    outputs: dict[bool, tuple[list[list[int]], torch.Tensor]] = {}
    run = model._step_run
    for fast in (True, False):
        model._step_run = run if fast else None
        pool.copy_(start)
        tokens, steps = list(first), []
        for step in range(DECODE_STEPS):
            out = executor.execute(BatchPlan(step + 1, _decode_batch(tokens, step))).tokens
            tokens = [out[str(job)] for job in range(len(PROMPT_LENS))]
            steps.append(tokens)
        outputs[fast] = (steps, pool.clone())
    assert outputs[True][0] == outputs[False][0]
    assert torch.equal(outputs[True][1], outputs[False][1])
    assert len({tuple(s) for s in outputs[True][0]}) > 1     # the jobs moved on, not one token repeated


def test_the_module_path_runs_where_the_run_does_not_apply(executor: InProcessExecutor,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the run was taken")

    tokens = _prefilled(executor)
    monkeypatch.setattr(cpu_step, "run_layers", refuse)
    monkeypatch.setenv("FASTSERVE_KERNEL_BACKEND", "torch")   # the reference forced
    assert len(executor.execute(BatchPlan(1, _decode_batch(tokens, 0))).tokens) == len(PROMPT_LENS)
    fp32 = _executor("float32")
    try:
        assert _model(fp32)._step_run is None
    finally:
        fp32.close()


def test_tables_and_slots_outside_the_pool_are_refused(executor: InProcessExecutor) -> None:
    model, pool = _model(executor), executor.runner.kv.device_pool
    assert model._step_run is not None
    dims, layers = model._step_run
    x = torch.zeros(1, CONFIG.hidden_size, dtype=torch.bfloat16)
    cos = torch.ones(1, 1, dims.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros(1, 1, dims.head_dim, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    slots, lens = torch.tensor([3], dtype=torch.int64), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs more than the table's 2 blocks of 16"):
        cpu_step.run_layers(x, layers, dims, pool, cos, sin, slots, table, torch.tensor([33], dtype=torch.int32))
    with pytest.raises(IndexError, match="outside the cache's 18 blocks"):
        cpu_step.run_layers(x, layers, dims, pool, cos, sin, slots, torch.tensor([[0, 18]], dtype=torch.int32),
                                 torch.tensor([20], dtype=torch.int32))
    with pytest.raises(IndexError, match="slot 288 lies past the cache's 18 blocks of 16"):
        cpu_step.run_layers(x, layers, dims, pool, cos, sin, torch.tensor([288], dtype=torch.int64), table, lens)
    with pytest.raises(ValueError, match=r"context_lens \(1,\) torch.int64"):
        cpu_step.run_layers(x, layers, dims, pool, cos, sin, slots, table, lens.long())
    no_decodes, no_lens = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    outside = cpu_step.PrefillRows.of([0, 1], [0], torch.tensor([[18]]))
    with pytest.raises(IndexError, match="sequence 0's table does not hold its 1 blocks inside the pool of 18"):
        cpu_step.run_layers(x, layers, dims, pool, cos, sin, slots, no_decodes, no_lens, outside)


def test_a_step_with_prefill_chunks_beside_decodes_equals_the_module_path(executor: InProcessExecutor) -> None:
    """Job 1 decodes; job 2's prompt goes in as a first chunk (start 0) and job 0 continues a
    chunk after its 5 cached tokens (start 5): prefill rows first, as the batch puts them."""
    model, pool = _model(executor), executor.runner.kv.device_pool
    tokens = _prefilled(executor)
    entries = (BatchEntry("0", tuple(range(40, 52)), 5, _table(0), True, GREEDY),
               BatchEntry("2", tuple(range(60, 90)), 0, _table(2), True, GREEDY),
               BatchEntry("1", (tokens[1],), 17, _table(1), False, GREEDY, 1))
    batch = ForwardBatch.build(entries, BLOCK_SIZE)
    assert batch.num_prefill_tokens == 42 and batch.prefill_start_pos == (5, 0) and batch.num_decode == 1
    fast, after_fast, module = _both_paths(model, batch, pool)
    assert torch.equal(fast, module) and fast.shape == (43, CONFIG.hidden_size)
    assert torch.equal(after_fast, pool)


def _repacked(ex: InProcessExecutor, monkeypatch: pytest.MonkeyPatch, choices: dict[str, GemmChoice]) -> LlamaStage:
    """The model packed again with ``choices`` per shape's user (``qkv``, ``o_proj``, ``gate_up``,
    ``down_proj``, ``lm_head``: the end of its role label) instead of timing."""
    def scripted(role: GemmRole, policy: GemmPolicy) -> GemmChoice:
        return next(c for name, c in choices.items() if role.label.split(" ")[0].endswith(name))

    monkeypatch.setattr(linear, "choose_for", scripted)
    model = _model(ex)
    model.pack_linear_weights()
    return model


def _mixed_choices() -> dict[str, GemmChoice]:
    """Every path in one model: oneDNN and torch handed to the run as calls back, beside our
    kernel's paths, switching at row counts the tests cross."""
    ours = G.AMX if cpu_linear.amx_available() else G.UNIFORM
    other = G.ONEDNN if onednn_linear_available(torch.bfloat16) else G.TORCH
    return {"qkv": GemmChoice(((2, G.DPBF16), (G.UNBOUNDED, other))),
            "o_proj": GemmChoice(((4, other), (G.UNBOUNDED, ours))),
            "gate_up": GemmChoice(((1, ours), (8, G.TORCH), (G.UNBOUNDED, other))),
            "down_proj": GemmChoice.single(G.TORCH),
            "lm_head": GemmChoice(((3, other), (G.UNBOUNDED, G.DPBF16)))}


def test_the_run_takes_every_gemm_path_and_equals_the_module_path(executor: InProcessExecutor,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMMs the run hands back to oneDNN or torch (``cpu_step.OTHER``) beside our kernel's:
    still one run, the same bits as the module path making the same choices, for 4 decode rows
    and for a mixed step of 43 rows."""
    model = _repacked(executor, monkeypatch, _mixed_choices())
    assert model._step_run is not None
    layer = model._step_run[1][0]
    assert layer.qkv.path(1) == cpu_linear.DPBF16 and layer.qkv.path(3) == cpu_step.OTHER
    assert layer.down.packed is None and layer.down.other is not None
    pool = executor.runner.kv.device_pool
    tokens = _prefilled(executor)
    fast, after_fast, module = _both_paths(model, ForwardBatch.build(_decode_batch(tokens, 0), BLOCK_SIZE), pool)
    assert torch.equal(fast, module) and torch.equal(after_fast, pool)
    entries = (BatchEntry("0", tuple(range(40, 52)), 5, _table(0), True, GREEDY),
               BatchEntry("2", tuple(range(60, 90)), 0, _table(2), True, GREEDY),
               BatchEntry("1", (tokens[1],), 17, _table(1), False, GREEDY, 1))
    fast, after_fast, module = _both_paths(model, ForwardBatch.build(entries, BLOCK_SIZE), pool)
    assert torch.equal(fast, module) and torch.equal(after_fast, pool)


def test_the_paths_this_cpu_measures_run_as_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's choice (``cached``: timed here, on these shapes): whatever it picked, the step
    is one run and equals the module path bit for bit; the choice is reported."""
    monkeypatch.setenv(G.CACHE_DIR_ENV, str(tmp_path))
    ex = _executor(gemm_choice=G.CACHED)
    try:
        model, pool = _model(ex), ex.runner.kv.device_pool
        assert model._step_run is not None
        batch = ForwardBatch.build(_decode_batch(_prefilled(ex), 0), BLOCK_SIZE)
        fast, after_fast, module = _both_paths(model, batch, pool)
        assert torch.equal(fast, module) and torch.equal(after_fast, pool)
        shapes = G.report()["shapes"].values()
        assert {e["shape"] for e in shapes if e["dtype"] == "bfloat16"} >= {"256x128", "128x128", "512x128", "128x256",
                                                                          "320x128"}
    finally:
        ex.close()
