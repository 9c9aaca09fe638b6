"""Our Gemma 3 stage against transformers' ``Gemma3ForCausalLM``, on a tiny random model whose
sliding window (8 tokens) every prompt and generation outgrows.

The tiny config has every Gemma 3 feature the real one has or may have: sliding and global layers
interleaved (local and global rotary bases, linear rope scaling on the global ones), QK norm,
``query_pre_attn_scalar`` unlike ``head_dim``, grouped-query attention, the four norms per layer,
final logit soft-capping. Logits agree on a prefill, on a mixed decode + prefill step and on
chunked prefills that continue a cached prefix across the window; greedy generation of a batch
gives exactly ``generate``'s tokens, also through a swap to the host pool and back, and at tensor
parallel size 2 over gloo (2 query heads and 1 of the 2 KV heads per rank). The windowed
kernels are checked apart against a dense mask. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from fastserve.kernels import reference
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model.config import load_model_config
from fastserve.worker.model.gemma3_config import FULL, SLIDING, Gemma3Config
from fastserve.worker.model.llama_config import RopeScaling
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.hf_reference import hf_greedy, hf_logits
from tests.harness.tensor_parallel import RankPools, run_tensor_parallel

WINDOW = 8
TINY_GEMMA3 = Gemma3Config(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, layer_types=(SLIDING, SLIDING, FULL, SLIDING), sliding_window=WINDOW,
    query_pre_attn_scalar=24, max_position_embeddings=256, local_rope_theta=10000.0,
    global_rope_theta=1000000.0, global_rope_scaling=RopeScaling("linear", factor=2.0),
    final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, name="tiny-gemma3")
#: Every prompt but the second is longer than the window; the generations all outgrow it.
PROMPTS = [[2, 11, 57, 100, 7, 8, 9, 10, 11, 12, 13], [2, 300, 4], [2] + list(range(20, 61)),
           [2, 99, 98, 97, 96, 95, 94, 93, 92]]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4
#: Random weights wider than HF's 0.02 init; norm offsets around 0 (Gemma scales by 1 + weight).
WEIGHT_STD = 0.08
NORM_STD = 0.1
#: fp32 on both sides, the same ops in a different grouping: agreement to float32 rounding
#: accumulated over 4 layers and a 320-wide head.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
#: Each TP rank's KV store: the same pools as ``executor_for``'s.
TP_POOLS = RankPools(BLOCK_SIZE, num_device_blocks=96, num_host_blocks=48)


def hf_model(config: Gemma3Config) -> transformers.PreTrainedModel:
    torch.manual_seed(1234)
    hf_config = transformers.Gemma3TextConfig(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(hf_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, NORM_STD if "norm" in name else WEIGHT_STD)
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.PreTrainedModel, Path]:
    hf = hf_model(TINY_GEMMA3)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf.save_pretrained(path)
    return hf, path


def executor_for(path: Path) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY_GEMMA3, 96, 48, BLOCK_SIZE, load_format="auto", model_path=str(path)))


def test_config_round_trips_through_the_saved_folder(pair: tuple[Any, Path]) -> None:
    assert load_model_config(pair[1]) == dataclasses.replace(TINY_GEMMA3, name=pair[1].name)


def test_config_refuses_fields_it_does_not_honour() -> None:
    raw = {**TINY_GEMMA3.to_hf_dict(), "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3Config.from_dict(raw)
    with pytest.raises(ValueError, match="hidden_activation"):
        Gemma3Config.from_dict({**TINY_GEMMA3.to_hf_dict(), "hidden_activation": "silu"})


def test_older_config_spelling_gives_the_same_layers_and_bases() -> None:
    raw = {k: v for k, v in TINY_GEMMA3.to_hf_dict().items() if k not in ("layer_types", "rope_parameters")}
    raw.update(sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    old = Gemma3Config.from_dict(raw, name="tiny-gemma3")
    assert old.layer_types == (SLIDING, SLIDING, FULL, SLIDING)
    assert (old.local_rope_theta, old.global_rope_theta, old.global_rope_scaling) == \
        (10000.0, 1000000.0, RopeScaling("linear", factor=2.0))


def test_windowed_reference_kernels_match_a_dense_mask() -> None:
    torch.manual_seed(0)
    length, heads, kv_heads, dim, window = 21, 4, 2, 16, 5
    q, k, v = torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    pos = torch.arange(length)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed, scale=0.3).transpose(0, 1)
    got = reference.prefill_attention(q, k, v, [0, length], 0.3, window)
    torch.testing.assert_close(got, dense)
    # The same rows through the paged cache: a chunk continuing a 9-token prefix, and decode.
    blocks = torch.zeros(8, BLOCK_SIZE, kv_heads, dim), torch.zeros(8, BLOCK_SIZE, kv_heads, dim)
    table = torch.tensor([[3, 0, 5, 1, 7, 2]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
    reference.write_kv(blocks[0], blocks[1], k, v, slots)
    chunk = reference.context_prefill_attention(q[9:], k[9:], v[9:], blocks[0], blocks[1], [0, length - 9], [9],
                                                table, 0.3, window)
    torch.testing.assert_close(chunk, dense[9:])
    decode = reference.paged_attention(q[-1:], blocks[0], blocks[1], table, torch.tensor([length], dtype=torch.int32),
                                       0.3, window)
    torch.testing.assert_close(decode, dense[-1:])


def test_prefill_decode_and_chunked_logits_match(pair: tuple[transformers.PreTrainedModel, Path]) -> None:
    hf, path = pair
    ex = executor_for(path)
    runner = ex.runner
    tables = {0: (0, 1, 2), 2: tuple(range(3, 14))}
    entries = tuple(BatchEntry(str(i), tuple(PROMPTS[i]), 0, tables[i], True, GREEDY) for i in tables)
    batch = runner.build_batch(BatchPlan(0, entries))
    with torch.inference_mode():
        logits = runner.model.logits(runner.forward(batch, None, {}))
    ref = torch.cat([hf_logits(hf, PROMPTS[i]) for i in tables])
    torch.testing.assert_close(logits, ref, **TOLERANCE)
    # A mixed step: job 0 decodes one token (context 12 > window), job 1 prefills.
    nxt = int(ref[len(PROMPTS[0]) - 1].argmax())
    decode = BatchEntry("0", (nxt,), len(PROMPTS[0]), tables[0], False, GREEDY, 1)
    fresh = BatchEntry("1", tuple(PROMPTS[1]), 0, (14,), True, GREEDY)
    batch = runner.build_batch(BatchPlan(1, (decode, fresh)))
    with torch.inference_mode():
        logits = runner.model.logits(runner.forward(batch, None, {})[batch.sample_index])
    torch.testing.assert_close(logits[0], hf_logits(hf, PROMPTS[0] + [nxt])[-1], **TOLERANCE)
    torch.testing.assert_close(logits[1], hf_logits(hf, PROMPTS[1])[-1], **TOLERANCE)
    # Job 3's prompt in chunks of 5, 5 and 31: the later chunks' windows reach into the cached prefix.
    prompt, table = PROMPTS[2], tuple(range(20, 31))
    cuts = [0, 5, 10, len(prompt)]
    for step, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        chunk = BatchEntry("3", tuple(prompt[a:b]), a, table, True, GREEDY, samples=b == len(prompt))
        batch = runner.build_batch(BatchPlan(2 + step, (chunk,)))
        with torch.inference_mode():
            hidden = runner.forward(batch, None, {})
        torch.testing.assert_close(runner.model.logits(hidden), hf_logits(hf, prompt[:b])[a:], **TOLERANCE)
    ex.close()


def test_greedy_batch_matches_generate_through_a_swap(pair: tuple[transformers.PreTrainedModel, Path]) -> None:
    hf, path = pair
    expected = {str(i): hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}
    plain = Driver(executor_for(path))
    swapped = Driver(executor_for(path))
    for driver in (plain, swapped):
        for i, p in enumerate(PROMPTS):
            driver.add(str(i), p, GREEDY)
    for step in range(NEW_TOKENS):
        plain.step(list(plain.jobs))
        run = [j for j in swapped.jobs if not (step in (8, 9, 10) and j == "2")]
        out = (swapped.swap_out("2"),) if step == 8 else ()
        back = (swapped.swap_in("2"),) if step == 11 else ()
        swapped.step(run, out, back)
    swapped.step(["2"])
    swapped.step(["2"])
    swapped.step(["2"])
    assert {j: job.generated for j, job in plain.jobs.items()} == expected
    assert {j: job.generated for j, job in swapped.jobs.items()} == expected
    assert swapped.swaps == {"out": 1, "in": 1}


def _greedy_batch(driver: Driver) -> dict[str, list[int]]:
    """A TP rank's work (module level, so it pickles into the spawned rank processes)."""
    for i, p in enumerate(PROMPTS):
        driver.add(str(i), p, GREEDY)
    for _ in range(NEW_TOKENS):
        driver.step(list(driver.jobs))
    return {j: job.generated for j, job in driver.jobs.items()}


def test_tensor_parallel_2_matches_generate(pair: tuple[transformers.PreTrainedModel, Path]) -> None:
    hf, path = pair
    expected = {str(i): hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}
    ranks = run_tensor_parallel(TINY_GEMMA3, path, _greedy_batch, TP_POOLS)
    for rank, result in ranks.items():
        assert result.local_heads == (2, 1), f"rank {rank}"
        assert result.result == expected, f"rank {rank}"
