"""Our OPT against transformers' ``OPTForCausalLM`` on the same weights.

Logits agree on prefill and decode; greedy generation of a mixed batch gives exactly the tokens
``generate`` gives — also when a job is swapped to the host pool and back, or dropped and
recomputed, midway. Models are small and random (nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.model.weights import dummy_weights
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import Driver
from tests.harness.hf_reference import hf_logits

ROOT = Path(__file__).resolve().parents[2]
TINY = OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 ffn_dim=128, max_position_embeddings=256, name="tiny")
# opt-350m's shape of architecture: post-LayerNorm, projected word embeddings, no final norm.
TINY_POST_LN = OPTConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=32,
                         do_layer_norm_before=False, name="tiny-post-ln")
PROMPTS = [[2, 11, 57, 100, 7], [2, 300, 4], [2] + list(range(20, 61)), [2, 99, 98, 97, 96, 95, 94, 93]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
NEW_TOKENS = 32


def hf_model(config: OPTConfig) -> transformers.OPTForCausalLM:
    torch.manual_seed(1234)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**config.to_hf_dict()))
    return model.eval()


def our_executor_from(hf: transformers.OPTForCausalLM, config: OPTConfig, tmp_path: Path,
                      num_device_blocks: int = 64, num_host_blocks: int = 64,
                      block_size: int = 4, safe: bool = True) -> InProcessExecutor:
    if safe:
        hf.save_pretrained(tmp_path)
    else:  # transformers 5 writes only safetensors; older OPT checkpoints ship a torch pickle
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    return InProcessExecutor(ModelSpec(config, num_device_blocks, num_host_blocks, block_size,
                             load_format="auto", model_path=str(tmp_path)))


def hf_greedy(hf: transformers.OPTForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=1)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", [TINY, TINY_POST_LN], ids=lambda c: c.name)
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_prefill_and_decode_logits_match(config: OPTConfig, safe: bool, tmp_path: Path) -> None:
    hf = hf_model(config)
    ex = our_executor_from(hf, config, tmp_path, safe=safe)
    runner = ex.runner
    # One mixed batch: two prefills.
    tables = {0: (0, 1), 1: (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)}
    prompts = {0: PROMPTS[0], 1: PROMPTS[2]}
    entries = tuple(BatchEntry(str(i), tuple(p), 0, tables[i], True, GREEDY) for i, p in prompts.items())
    plan = BatchPlan(0, entries)
    batch = runner.build_batch(plan)
    with torch.inference_mode():
        hidden = runner.forward(batch, None, {})
        logits = runner.model.logits(hidden)
    ref = torch.cat([hf_logits(hf, p) for p in prompts.values()])
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    # Then a mixed decode + prefill step: job 0 decodes one token, job 1 keeps its KV.
    nxt = int(ref[len(PROMPTS[0]) - 1].argmax())
    decode = BatchEntry("0", (nxt,), len(PROMPTS[0]), tables[0], False, GREEDY, 1)
    fresh = BatchEntry("2", tuple(PROMPTS[1]), 0, (13,), True, GREEDY)
    plan = BatchPlan(1, (decode, fresh))
    batch = runner.build_batch(plan)
    with torch.inference_mode():
        hidden = runner.forward(batch, None, {})
        logits = runner.model.logits(hidden[batch.sample_index])
    torch.testing.assert_close(logits[0], hf_logits(hf, PROMPTS[0] + [nxt])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(hf, PROMPTS[1])[-1], rtol=1e-4, atol=1e-4)


def _generate(driver: Driver, events: dict[int, callable] | None = None) -> dict[str, list[int]]:  # type: ignore[valid-type]
    for i, p in enumerate(PROMPTS):
        driver.add(str(i), p, GREEDY)
    active = [str(i) for i in range(len(PROMPTS))]
    step = 0
    swap_out: tuple = ()
    swap_in: tuple = ()
    while any(len(driver.jobs[j].generated) < NEW_TOKENS for j in active):
        run = [j for j in active if len(driver.jobs[j].generated) < NEW_TOKENS]
        if events and step in events:
            run, swap_out, swap_in = events[step](driver, run)
        driver.step(run, swap_out, swap_in)
        swap_out, swap_in = (), ()
        step += 1
    return {j: driver.jobs[j].generated for j in active}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.OPTForCausalLM, Path]:
    hf = hf_model(TINY)
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def hf_tokens(tiny_pair: tuple[transformers.OPTForCausalLM, Path]) -> dict[str, list[int]]:
    hf, _ = tiny_pair
    return {str(i): hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}


def _tiny_executor(path: Path, **kw: int) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY, kw.get("dev", 96), kw.get("host", 32), 4,
                             load_format="auto", model_path=str(path)))


def test_greedy_batch_matches_generate(tiny_pair: tuple, hf_tokens: dict[str, list[int]]) -> None:
    assert _generate(Driver(_tiny_executor(tiny_pair[1]))) == hf_tokens


def test_greedy_matches_with_swap_out_and_in_midway(tiny_pair: tuple, hf_tokens: dict[str, list[int]]) -> None:
    def out(d: Driver, run: list[str]) -> tuple:
        # Job 2 (the long prompt) leaves the batch and its KV goes to the host pool.
        return [j for j in run if j != "2"], (d.swap_out("2"),), ()

    def stay_out(d: Driver, run: list[str]) -> tuple:
        return [j for j in run if j != "2"], (), ()

    def back(d: Driver, run: list[str]) -> tuple:
        # Swapped in and run in the same step: the forward must wait for the copy (reactive).
        return run, (), (d.swap_in("2"),)

    driver = Driver(_tiny_executor(tiny_pair[1]))
    events = {10: out, 11: stay_out, 12: stay_out, 13: back}
    assert _generate(driver, events) == hf_tokens
    assert driver.swaps == {"out": 1, "in": 1}
    assert driver.ex.kv.swapped_out_blocks == driver.ex.kv.swapped_in_blocks > 0


def test_greedy_matches_with_drop_and_recompute_midway(tiny_pair: tuple, hf_tokens: dict[str, list[int]]) -> None:
    def drop(d: Driver, run: list[str]) -> tuple:
        d.drop("1")
        return [j for j in run if j != "1"], (), ()

    driver = Driver(_tiny_executor(tiny_pair[1]))
    assert _generate(driver, {7: drop}) == hf_tokens


def test_opt125m_shaped_dummy_model_matches_transformers() -> None:
    config = OPTConfig.from_file(ROOT / "config/models/opt-125m")
    ex = InProcessExecutor(ModelSpec(config, num_device_blocks=8, num_host_blocks=0, block_size=16, seed=7))
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**config.to_hf_dict())).eval()
    state = {f"model.decoder.{n}": t for n, t in dummy_weights(ex.model, seed=7)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    prompt = [2, 5625, 16, 10, 2721, 183, 8, 38, 236]
    entry = BatchEntry("a", tuple(prompt), 0, (0,), True, GREEDY)
    batch = ex.runner.build_batch(BatchPlan(0, (entry,)))
    with torch.inference_mode():
        logits = ex.model.logits(ex.runner.forward(batch, None, {}))
    torch.testing.assert_close(logits, hf_logits(hf, prompt), rtol=1e-4, atol=2e-4)
    nxt = int(logits[-1].argmax())
    step = BatchEntry("a", (nxt,), len(prompt), (0,), False, GREEDY, 1)
    batch = ex.runner.build_batch(BatchPlan(1, (step,)))
    with torch.inference_mode():
        logits = ex.model.logits(ex.runner.forward(batch, None, {}))
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt + [nxt])[-1], rtol=1e-4, atol=2e-4)


def test_serving_linear_packed_path_equals_f_linear_for_every_row_count() -> None:
    from fastserve.worker.model import linear as L

    torch.manual_seed(0)
    lin = L.ServingLinear(48, 80)
    x_rows = [1, 2, 7, 256, 259]   # across the timed grid's steps (gemm_choice may switch path at any)
    inputs = {n: torch.randn(n, 48) for n in x_rows}
    expected = {n: F.linear(x, lin.weight, lin.bias) for n, x in inputs.items()}
    assert lin.pack() == L.onednn_linear_available()
    for n, x in inputs.items():
        torch.testing.assert_close(lin(x), expected[n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin.multiply(x, with_bias=False), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
    assert not L.ServingLinear(4, 4).to(torch.float64).pack()   # float32 / bf16 CPU only


def test_merged_linear_gives_each_members_output() -> None:
    # q/k/v (with biases, as OPT) and gate/up (without, as LLaMA) merged into one packed GEMM:
    # each output is its member's own F.linear, before packing and after, at every row count.
    from fastserve.worker.model import linear as L

    torch.manual_seed(0)
    for bias in (True, False):
        members = [L.ServingLinear(48, width, bias=bias) for width in (32, 16, 16)]
        merged = L.MergedLinear(*members)
        for n in (1, 7, 259):
            x = torch.randn(n, 48)
            expected = [F.linear(x, m.weight, m.bias) for m in members]
            for out, want in zip(merged(x), expected, strict=True):
                torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            if n == 1:
                assert merged.pack() == L.onednn_linear_available()
        root = torch.nn.Module()
        root.parts = torch.nn.ModuleList(members)
        root.extra = L.ServingLinear(16, 8)
        root.qkv = L.MergedLinear(*members)
        # One packed weight for the three members, one for the other linear; no member packs alone.
        assert L.pack_linears(root)[0] == (2 if L.onednn_linear_available() else 0)
        assert all(m._packed is None for m in members)
    # Members that disagree on a bias are not merged: each packs alone.
    mixed = [L.ServingLinear(48, 16, bias=True), L.ServingLinear(48, 16, bias=False)]
    assert not L.MergedLinear(*mixed).pack()
    root = torch.nn.Module()
    root.parts = torch.nn.ModuleList(mixed)
    root.pair = L.MergedLinear(*mixed)
    assert L.pack_linears(root)[0] == (2 if L.onednn_linear_available() else 0)


def test_every_float32_path_gives_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    # Which path runs which row counts is measured per CPU (gemm_choice); each one is F.linear.
    from fastserve.worker.model import gemm_choice as G
    from fastserve.worker.model import linear as L

    torch.manual_seed(0)
    lin = L.ServingLinear(48, 32)
    inputs = {n: torch.randn(n, 48) for n in (1, 2, 300)}
    paths = [G.ONEDNN, G.TORCH] if L.onednn_linear_available() else []
    for path in paths:
        monkeypatch.setattr(L, "choose_for", lambda role, policy, p=path: G.GemmChoice.single(p))
        assert lin.pack()
        for x in inputs.values():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    split = G.GemmChoice(((1, G.TORCH), (G.UNBOUNDED, G.ONEDNN)))
    if paths:
        monkeypatch.setattr(L, "choose_for", lambda role, policy: split)
        assert lin.pack() and lin._packed is not None
        assert lin._packed.plain is not None and lin._packed.onednn is not None and lin._packed.ours is None


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag)")
def test_serving_linear_packs_bf16_and_equals_f_linear() -> None:
    from fastserve.worker.model import linear as L

    torch.manual_seed(0)
    lin = L.ServingLinear(48, 80).to(torch.bfloat16)
    assert lin.pack() and L.onednn_linear_available(torch.bfloat16)
    for n in (1, 2, 33, 300):
        x = torch.randn(n, 48).to(torch.bfloat16)
        # Both accumulate in fp32 and round once to bf16: within one bf16 ulp of each other.
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=2e-2, rtol=1e-2)


def test_packed_lm_head_gives_the_unpacked_logits(tiny_pair: tuple) -> None:
    # The executor packs the tied LM head (CPU float32); its logits for a decode-sized batch must
    # be the plain projection's to float32 rounding, and a lone row takes the plain path.
    from fastserve.worker.model import linear as L

    ex = _tiny_executor(tiny_pair[1])
    model = ex.model
    assert (model._head_packed is not None) == L.onednn_linear_available()
    hidden = torch.randn(5, TINY.hidden_size)
    with torch.inference_mode():
        packed = model.logits(hidden)
        plain = F.linear(model.final_layer_norm(hidden), model.embed_tokens.weight)
        lone = model.logits(hidden[:1])
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lone, plain[:1], atol=1e-5, rtol=1e-5)
