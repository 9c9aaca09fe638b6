"""bfloat16 on the demo's real model, SmolLM2-135M-Instruct, against ``transformers`` in bfloat16.

Runs only on a CPU with native bf16 (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo, read by
``fastserve.kernels.cpu_features``): elsewhere ``dtype: auto`` serves float32 and bf16 would be emulated.

* ``dtype: auto`` resolves to bf16 here: weights, activations and the KV pool are bf16, the
  decoder linears and the LM head run on the ``fixed`` GEMM path (our bf16 kernel where it
  builds, else oneDNN's packed bf16 GEMM; fp32 accumulation either way) and decode attention on
  the C kernel's bf16-cache path. ``test_the_measured_paths_answer_as_the_fixed_ones`` runs a
  server's measured choice (``engine.gemm_choice: cached``).
* Logits, prefill and a decode step on the paged bf16 cache, are HF bf16's within
  ``LOGIT_ATOL`` for all eight parity prompts. For scale: HF bf16 differs from HF fp32 by up to
  0.71 on these prompts; bf16 spaces logits of magnitude 16-32 by 0.125.
* Greedy tokens equal HF bf16 ``generate`` for every job, except at most ``max_tied_jobs()`` of
  the 8 that leave it at a token where HF's top two logits were within ``BF16_TIE_GAP`` (a tie at
  bf16 precision — HF's own gaps there are 0 or one bf16 step — after which either continuation
  is the model's). How many leave depends on the linears' summation order: on oneDNN's (HF's
  own on CPU) 2; on our bf16 kernel's (``fastserve.kernels.cpu_linear``, where it builds) 5, every one at
  such a tie. For scale, over 64 tokens HF bf16 itself leaves HF fp32 on 3 of the 8 jobs, our
  kernel path on 5 and our oneDNN path on 4 (AMD EPYC Zen 4).
* The France prompt gets the fp32 model's answer, "The capital of France is Paris.", and stops at
  EOS: vLLM's CPU build at ``--dtype bfloat16`` answers it with unrelated French text here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from fastserve import kernels
from fastserve.kernels import cpu_linear
from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model import linear
from fastserve.worker.model.gemm_choice import GemmChoice
from fastserve.worker.model.linear import onednn_linear_available
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.greedy import greedy_until_stop
from tests.harness.hf_reference import Reference, hf_greedy_reference
from tests.harness.smollm2 import MAX_NEW_TOKENS

pytestmark = pytest.mark.skipif(not cpu_has_bf16(),
                                reason="this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag): "
                                       "dtype auto serves float32 here")

BLOCK_SIZE = 16
NUM_DEVICE_BLOCKS = 64
#: Largest |ours - HF| over the vocabulary, bf16 both sides (measured: see the module note).
LOGIT_ATOL = 1.0
#: HF's top two bf16 logits closer than this: either token is the model's answer.
BF16_TIE_GAP = 0.25
#: Parity prompts whose next token HF itself leaves tied (top two within BF16_TIE_GAP).
MAX_HF_TIES = 2
MAX_TIED_JOBS_ONEDNN = 2
MAX_TIED_JOBS_BF16_KERNEL = 5
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
FRANCE_ANSWER = "The capital of France is Paris."


def max_tied_jobs() -> int:
    """Jobs whose greedy tokens may leave HF bf16's at a tie, for the kernel the linears run on."""
    return MAX_TIED_JOBS_BF16_KERNEL if cpu_linear.available() else MAX_TIED_JOBS_ONEDNN


@pytest.fixture(scope="module")
def hf_bf16(smollm2_folder: Path) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def hf_refs(hf_bf16: transformers.PreTrainedModel, smollm2_prompts: list[list[int]],
            smollm2_llama: LlamaConfig) -> dict[str, Reference]:
    """HF bf16 ``generate`` on each prompt, with its top-2 gaps (made once for the module)."""
    return {str(i): hf_greedy_reference(hf_bf16, p, MAX_NEW_TOKENS, smollm2_llama.eos_token_id)
            for i, p in enumerate(smollm2_prompts)}


@pytest.fixture(scope="module")
def executor(smollm2_llama: LlamaConfig, smollm2_folder: Path) -> Iterator[InProcessExecutor]:
    ex = InProcessExecutor(ModelSpec(smollm2_llama, NUM_DEVICE_BLOCKS, 0, BLOCK_SIZE, dtype="auto",
                                     load_format="auto", model_path=str(smollm2_folder)))
    yield ex
    ex.close()


def test_auto_serves_bf16_on_the_fast_paths(executor: InProcessExecutor) -> None:
    model, pool = executor.model, executor.kv.device_pool
    assert pool.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Per layer four packed GEMM weights: q/k/v merged, o, gate/up merged, down; a merged
    # member keeps no packed copy of its own.
    merged = [g for layer in model.layers for g in (layer.self_attn.qkv, layer.mlp.gate_up)]
    alone = [m for layer in model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert len(merged) == len(alone) == 60
    assert all(g._packed is not None and all(m._packed is None for m in g.members) for g in merged)
    assert all(m._packed is not None for m in alone)
    assert model._head_packed is not None
    # Every one of them on our bf16 kernel where it built (the fixed choice), else on oneDNN's.
    packed = [p for p in (*(g._packed for g in merged), *(m._packed for m in alone), model._head_packed)
              if p is not None]
    want = (G.AMX if cpu_linear.amx_available() else G.DPBF16) if cpu_linear.available() else G.ONEDNN
    assert {p.choice for p in packed} == {G.GemmChoice.single(want)}
    assert all((p.ours is not None) == cpu_linear.available() for p in packed)
    query = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    assert kernels.paged_attention_backend(query, pool[:, 0, 0]) == kernels.CPU_BACKEND


def _logits(ex: InProcessExecutor, entry: BatchEntry) -> torch.Tensor:
    batch = ex.runner.build_batch(BatchPlan(0, (entry,)))
    with torch.inference_mode():
        return ex.model.logits(ex.runner.forward(batch, None, {}))[-1]


def test_prefill_and_decode_logits_match_transformers_bf16(executor: InProcessExecutor,
                                                          smollm2_prompts: list[list[int]],
                                                          hf_bf16: transformers.PreTrainedModel) -> None:
    worst: dict[str, float] = {}
    ties: list[int] = []
    for i, prompt in enumerate(smollm2_prompts):
        blocks = tuple(range(-(-(len(prompt) + 1) // BLOCK_SIZE)))
        with torch.inference_mode():
            hf = hf_bf16(torch.tensor([prompt])).logits[0, -1].float()
        # Prefill of the whole prompt; then the prompt less its last token, and that token as a
        # decode step over the paged bf16 cache (the C kernel).
        prefill = _logits(executor, BatchEntry("p", tuple(prompt), 0, blocks, True, GREEDY))
        _logits(executor, BatchEntry("d", tuple(prompt[:-1]), 0, blocks, True, GREEDY))
        decode = _logits(executor, BatchEntry("d", (prompt[-1],), len(prompt) - 1, blocks, False, GREEDY, 1))
        worst[f"{i} prefill"] = float((prefill - hf).abs().max())
        worst[f"{i} decode"] = float((decode - hf).abs().max())
        top2 = hf.topk(2).values
        if float(top2[0] - top2[1]) >= BF16_TIE_GAP:   # a clear choice: ours makes it too
            assert int(prefill.argmax()) == int(decode.argmax()) == int(hf.argmax()), (i, worst)
        else:
            ties.append(i)
    assert max(worst.values()) <= LOGIT_ATOL, worst
    assert len(ties) <= MAX_HF_TIES, ties


def test_greedy_matches_generate_bf16_up_to_ties(executor: InProcessExecutor, smollm2_prompts: list[list[int]],
                                                 hf_refs: dict[str, Reference], smollm2_llama: LlamaConfig,
                                                 smollm2_folder: Path) -> None:
    diverged = _greedy_against_generate(executor, smollm2_prompts, hf_refs, smollm2_llama, smollm2_folder)
    assert len(diverged) <= max_tied_jobs(), diverged


def test_every_gemm_path_mixed_answers_as_the_fixed_ones(smollm2_llama: LlamaConfig, smollm2_folder: Path,
                                                         smollm2_prompts: list[list[int]],
                                                         hf_refs: dict[str, Reference],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What a server's measured choice may come to (``engine.gemm_choice``; the timing itself is
    tested in test_gemm_choice and test_cpu_step): every path this CPU has, switching at row counts
    the prompts and decodes cross, oneDNN's and torch's called back from the step's run. Every job
    that leaves HF bf16 does so at a tie, and France is Paris."""
    ours = G.AMX if cpu_linear.amx_available() else G.DPBF16
    other = G.ONEDNN if onednn_linear_available(torch.bfloat16) else G.TORCH
    mixed = {"qkv": GemmChoice(((4, ours), (G.UNBOUNDED, other))),
             "o_proj": GemmChoice(((1, G.TORCH), (G.UNBOUNDED, ours))),
             "gate_up": GemmChoice(((2, other), (G.UNBOUNDED, ours))),
             "down_proj": GemmChoice(((8, ours), (G.UNBOUNDED, G.TORCH))),
             "lm_head": GemmChoice(((1, other), (G.UNBOUNDED, ours)))}
    if not cpu_linear.available():   # no kernel of ours: oneDNN and torch alone
        mixed = {name: GemmChoice.single(other) for name in mixed}
    monkeypatch.setattr(linear, "choose_for",
                        lambda role, policy: next(c for n, c in mixed.items() if role.label.split(" ")[0].endswith(n)))
    ex = InProcessExecutor(ModelSpec(smollm2_llama, NUM_DEVICE_BLOCKS, 0, BLOCK_SIZE, dtype="auto",
                                     load_format="auto", model_path=str(smollm2_folder)))
    try:
        assert ex.model._step_run is not None or not cpu_linear.available()
        _greedy_against_generate(ex, smollm2_prompts, hf_refs, smollm2_llama, smollm2_folder)
    finally:
        ex.close()


def _greedy_against_generate(executor: InProcessExecutor, smollm2_prompts: list[list[int]],
                             refs: dict[str, Reference], smollm2_llama: LlamaConfig,
                             smollm2_folder: Path) -> dict[str, int]:
    """Greedy tokens against HF bf16 ``generate``: each job that leaves it does so where HF was
    tied, and the France prompt answers as fp32 does; returns where each job left."""
    ours = greedy_until_stop(Driver(executor), smollm2_prompts, MAX_NEW_TOKENS, smollm2_llama.eos_token_id)
    diverged = {}
    for job, ref in refs.items():
        if ours[job] == ref.tokens:
            continue
        pos = next((k for k, (a, b) in enumerate(zip(ours[job], ref.tokens, strict=False)) if a != b),
                   min(len(ours[job]), len(ref.tokens)))
        assert pos < len(ref.tokens) and ref.top2_gaps[pos] < BF16_TIE_GAP, \
            f"job {job} leaves HF at token {pos}, where HF was not tied"
        diverged[job] = pos
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
    assert ours["0"][-1] == smollm2_llama.eos_token_id
    assert tokenizer.decode(ours["0"][:-1]) == FRANCE_ANSWER
    return diverged
