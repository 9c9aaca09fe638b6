"""Our LLaMA-family stage against transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

Tiny random models with grouped-query attention (4 query heads, 2 KV heads): a Llama-3-style one
(llama3 rope scaling, untied LM head, sharded safetensors checkpoint) and a Qwen2-style one (q/k/v
biases, tied embeddings). Logits agree on prefill and on a mixed decode + prefill step; greedy
generation of a batch gives exactly ``generate``'s tokens, also when a job is swapped to the host
pool and back midway; and the same at tensor-parallel size 2 on CPU (two processes, gloo), where
KV heads are split (2 KV heads) or replicated (1 KV head). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.hf_reference import hf_greedy, hf_logits
from tests.harness.tensor_parallel import RankPools, run_tensor_parallel

LLAMA3_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
TINY_LLAMA = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny-llama")
TINY_QWEN2 = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2",
                         name="tiny-qwen2")
#: Multi-query attention: at TP 2 the single KV head is replicated on both ranks.
TINY_MQA = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                       rope_theta=500000.0, rope_scaling=RopeScaling("linear", factor=2.0), name="tiny-mqa")
CONFIGS = [TINY_LLAMA, TINY_QWEN2]
HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
PROMPTS = [[1, 11, 57, 100, 7], [1, 300, 4], [1] + list(range(20, 61)), [1, 99, 98, 97, 96, 95, 94, 93]]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4
#: Small enough that the tiny checkpoint is written as several safetensors shards plus an index.
SHARD_SIZE = "40KB"
#: Random weights wider than HF's 0.02 init, so that biases and norms actually matter.
WEIGHT_STD = 0.08
NORM_STD = 0.1
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
#: Each TP rank's KV store: the same pools as ``executor_for``'s.
TP_POOLS = RankPools(BLOCK_SIZE, num_device_blocks=96, num_host_blocks=48)


def hf_model(config: LlamaConfig) -> transformers.PreTrainedModel:
    config_cls, model_cls = HF_CLASSES[config.model_type]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**config.to_hf_dict()))
    with torch.no_grad():  # HF zero-initialises biases and ones norms: randomise them all
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, NORM_STD)
            else:
                param.normal_(0.0, WEIGHT_STD)
    return model.eval()


def save_checkpoint(hf: transformers.PreTrainedModel, path: Path) -> Path:
    hf.save_pretrained(path, max_shard_size=SHARD_SIZE)
    return path


def executor_for(config: LlamaConfig, path: Path, num_device_blocks: int = 96,
                 num_host_blocks: int = 48) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(config, num_device_blocks, num_host_blocks, BLOCK_SIZE,
                                       load_format="auto", model_path=str(path)))


Event = Callable[[Driver, list[str]], tuple[list[str], tuple[Any, ...], tuple[Any, ...]]]


def generate(driver: Driver, events: dict[int, Event] | None = None) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        driver.add(str(i), p, GREEDY)
    active = [str(i) for i in range(len(PROMPTS))]
    step = 0
    while any(len(driver.jobs[j].generated) < NEW_TOKENS for j in active):
        run = [j for j in active if len(driver.jobs[j].generated) < NEW_TOKENS]
        swap_out: tuple[Any, ...] = ()
        swap_in: tuple[Any, ...] = ()
        if events and step in events:
            run, swap_out, swap_in = events[step](driver, run)
        driver.step(run, swap_out, swap_in)
        step += 1
    return {j: driver.jobs[j].generated for j in active}


def swap_events() -> dict[int, Event]:
    """Job 2 (the long prompt) goes to the host pool at step 8, stays out two steps, comes back
    at step 11 in the same step it runs (the forward waits for the copy)."""
    def out(d: Driver, run: list[str]) -> tuple[list[str], tuple[Any, ...], tuple[Any, ...]]:
        return [j for j in run if j != "2"], (d.swap_out("2"),), ()

    def stay_out(d: Driver, run: list[str]) -> tuple[list[str], tuple[Any, ...], tuple[Any, ...]]:
        return [j for j in run if j != "2"], (), ()

    def back(d: Driver, run: list[str]) -> tuple[list[str], tuple[Any, ...], tuple[Any, ...]]:
        return run, (), (d.swap_in("2"),)

    return {8: out, 9: stay_out, 10: stay_out, 11: back}


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[LlamaConfig, transformers.PreTrainedModel, Path]:
    config: LlamaConfig = request.param
    hf = hf_model(config)
    return config, hf, save_checkpoint(hf, tmp_path_factory.mktemp(config.name))


@pytest.fixture(scope="module")
def hf_tokens(pair: tuple[LlamaConfig, transformers.PreTrainedModel, Path]) -> dict[str, list[int]]:
    _, hf, _ = pair
    return {str(i): hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}


def test_checkpoint_is_sharded_with_an_index(pair: tuple[LlamaConfig, Any, Path]) -> None:
    _, _, path = pair
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_prefill_and_decode_logits_match(pair: tuple[LlamaConfig, Any, Path]) -> None:
    config, hf, path = pair
    ex = executor_for(config, path)
    runner = ex.runner
    assert ex.kv.device_pool.shape[-2] == config.num_kv_heads  # the cache holds KV heads only
    tables = {0: (0, 1), 1: tuple(range(2, 13))}
    prompts = {0: PROMPTS[0], 1: PROMPTS[2]}
    entries = tuple(BatchEntry(str(i), tuple(p), 0, tables[i], True, GREEDY) for i, p in prompts.items())
    batch = runner.build_batch(BatchPlan(0, entries))
    with torch.inference_mode():
        logits = runner.model.logits(runner.forward(batch, None, {}))
    ref = torch.cat([hf_logits(hf, p) for p in prompts.values()])
    torch.testing.assert_close(logits, ref, **TOLERANCE)
    # A mixed step: job 0 decodes one token over its paged KV, job 2 prefills.
    nxt = int(ref[len(PROMPTS[0]) - 1].argmax())
    decode = BatchEntry("0", (nxt,), len(PROMPTS[0]), tables[0], False, GREEDY, 1)
    fresh = BatchEntry("2", tuple(PROMPTS[1]), 0, (13,), True, GREEDY)
    batch = runner.build_batch(BatchPlan(1, (decode, fresh)))
    with torch.inference_mode():
        logits = runner.model.logits(runner.forward(batch, None, {})[batch.sample_index])
    torch.testing.assert_close(logits[0], hf_logits(hf, PROMPTS[0] + [nxt])[-1], **TOLERANCE)
    torch.testing.assert_close(logits[1], hf_logits(hf, PROMPTS[1])[-1], **TOLERANCE)
    ex.close()


def test_greedy_batch_matches_generate(pair: tuple[LlamaConfig, Any, Path], hf_tokens: dict[str, list[int]]) -> None:
    config, _, path = pair
    assert generate(Driver(executor_for(config, path))) == hf_tokens


def test_greedy_matches_with_swap_out_and_in_midway(pair: tuple[LlamaConfig, Any, Path],
                                                    hf_tokens: dict[str, list[int]]) -> None:
    config, _, path = pair
    driver = Driver(executor_for(config, path))
    assert generate(driver, swap_events()) == hf_tokens
    assert driver.swaps == {"out": 1, "in": 1}
    assert driver.ex.kv.swapped_out_blocks == driver.ex.kv.swapped_in_blocks > 0


# ---------------------------------------------------------------- tensor parallel (gloo, 2 processes)


def _generate_with_swaps(driver: Driver) -> dict[str, list[int]]:
    """A TP rank's work (module level, so it pickles into the spawned rank processes)."""
    return generate(driver, swap_events())


@pytest.mark.parametrize(("config", "local_heads"), [(TINY_LLAMA, (2, 1)), (TINY_QWEN2, (2, 1)), (TINY_MQA, (2, 1))],
                         ids=["llama-kv-split", "qwen2-kv-split", "mqa-kv-replicated"])
def test_tensor_parallel_2_matches_generate_with_swaps(config: LlamaConfig, local_heads: tuple[int, int],
                                                       tmp_path: Path) -> None:
    hf = hf_model(config)
    expected = {str(i): hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}
    ranks = run_tensor_parallel(config, save_checkpoint(hf, tmp_path), _generate_with_swaps, TP_POOLS)
    for rank, result in ranks.items():
        assert result.local_heads == local_heads, f"rank {rank}"
        assert result.result == expected, f"rank {rank}"


def test_chunked_prefill_matches_hf_logits_and_greedy_tokens(pair: tuple[LlamaConfig, Any, Path],
                                                             hf_tokens: dict[str, list[int]]) -> None:
    """The long prompt (42 tokens) prefilled in chunks of 16, 16 and 10 — each chunk attends to
    the KV its earlier chunks cached, with rotary positions continuing — then decoded greedily:
    every chunk's logits are HF's rows and the tokens are HF's ``generate``."""
    config, hf, path = pair
    ex = executor_for(config, path)
    prompt, table = tuple(PROMPTS[2]), tuple(range(20, 40))
    ref = hf_logits(hf, list(prompt))
    runner = ex.runner
    for start, end in ((0, 16), (16, 32), (32, len(prompt))):
        last = end == len(prompt)
        entry = BatchEntry("2", prompt[start:end], start, table, True, GREEDY, 0, last)
        batch = runner.build_batch(BatchPlan(start, (entry,)))
        with torch.inference_mode():
            logits = runner.model.logits(runner.forward(batch, None, {}))
        torch.testing.assert_close(logits, ref[start:end], **TOLERANCE)
    tokens = [int(ref[-1].argmax())]
    while len(tokens) < NEW_TOKENS:
        pos = len(prompt) + len(tokens) - 1
        entry = BatchEntry("2", (tokens[-1],), pos, table, False, GREEDY, len(tokens))
        tokens.append(ex.execute(BatchPlan(100 + pos, (entry,))).tokens["2"])
    assert tokens == hf_tokens["2"]
    ex.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_are_transformers_formulas_bit_for_bit(dtype: torch.dtype) -> None:
    # The torch reference's RMSNorm runs F.rms_norm and its rotary a roll with a signed sin:
    # fewer ops per layer, the same bits as transformers' pow/mean/rsqrt and rotate_half formulas.
    # (The C kernels that replace them for bf16 are held to this reference in test_cpu_elementwise.)
    from fastserve.kernels import reference
    from fastserve.worker.model.rope import Rotary

    torch.manual_seed(3)
    weight = torch.randn(576).to(dtype)
    rotary = Rotary(64, 10000.0, None)
    for rows, magnitude in ((1, 0.1), (7, 1.0), (33, 40.0)):
        x = (torch.randn(rows, 576) * magnitude).to(dtype)
        h = x.to(torch.float32)
        hf_norm = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        positions = torch.randint(0, 8192, (rows,))
        angles = positions.float()[:, None] * rotary.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        q = torch.randn(rows, 9, 64).to(dtype)
        rotate_half = torch.cat((-q[..., 32:], q[..., :32]), dim=-1)
        hf_rotated = q * angles.cos().to(dtype) + rotate_half * angles.sin().to(dtype)
        assert torch.equal(reference.rms_norm(x, weight, 1e-5)[1], hf_norm)
        assert torch.equal(reference.rotate(q, *rotary.cos_sin(positions, dtype)), hf_rotated)
