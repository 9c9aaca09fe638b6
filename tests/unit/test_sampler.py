"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from fastserve.worker.messages import SamplingParams
from fastserve.worker.sampler import Sampler, filtered_probs

LOGITS = torch.tensor([[0.1, 2.0, 1.5, -1.0, 0.3], [3.0, 0.0, 0.0, 0.0, 2.9]])


def test_greedy_takes_the_argmax() -> None:
    p = SamplingParams(temperature=0.0)
    assert Sampler().sample(LOGITS, [p, p], [0, 0]) == [1, 0]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    k1 = SamplingParams(temperature=1.0, top_k=1)
    p0 = SamplingParams(temperature=1.0, top_p=1e-6)
    for _ in range(20):
        assert Sampler().sample(LOGITS, [k1, p0], [0, 0]) == [1, 0]


def test_top_k_and_top_p_keep_exactly_the_expected_support() -> None:
    probs = filtered_probs(LOGITS[0], SamplingParams(top_k=2))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 2]
    soft = torch.softmax(LOGITS[0], -1)  # sorted mass: 0.486 (id 1), 0.295 (id 2), ...
    probs = filtered_probs(LOGITS[0], SamplingParams(top_p=0.6))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 2]
    torch.testing.assert_close(probs[[1, 2]], soft[[1, 2]] / soft[[1, 2]].sum())


def test_same_seed_same_tokens_whatever_shares_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    alone = [Sampler(0).sample(LOGITS[:1], [seeded], [s])[0] for s in range(30)]
    mixed = [Sampler(s).sample(LOGITS, [seeded, other], [s, 0])[0] for s in range(30)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_give_different_streams() -> None:
    a = [Sampler().sample(LOGITS[:1], [SamplingParams(seed=1)], [s])[0] for s in range(40)]
    b = [Sampler().sample(LOGITS[:1], [SamplingParams(seed=2)], [s])[0] for s in range(40)]
    assert a != b


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (SamplingParams(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (SamplingParams(top_k=-3), "top_k must be >= 0 .*got -3"),
])
def test_bad_params_name_the_value(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_finish_reasons() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    assert p.finish_reason(2, 1, eos_token_ids=frozenset({2})) == "stop"
    assert p.finish_reason(7, 1, eos_token_ids=frozenset({2})) == "stop"
    assert p.finish_reason(5, 2, eos_token_ids=frozenset({2})) is None
    assert p.finish_reason(5, 3, eos_token_ids=frozenset({2})) == "length"
    assert SamplingParams(ignore_eos=True).finish_reason(2, 1, eos_token_ids=frozenset({2})) is None


def test_a_row_with_non_finite_logits_gets_none_and_the_others_are_unchanged() -> None:
    logits = LOGITS.clone()
    logits[0, 1] = float("nan")
    p = SamplingParams(temperature=0.0)
    assert Sampler().sample(logits, [p, p], [0, 0]) == [None, 0]


def test_top_p_that_underflows_float32_keeps_the_most_likely_token() -> None:
    p = SamplingParams(temperature=1.0, top_p=1e-300, seed=3)
    assert [Sampler().sample(LOGITS, [p, p], [s, s]) for s in range(5)] == [[1, 0]] * 5


def test_draw_follows_the_distribution_and_never_picks_zero_mass() -> None:
    from fastserve.worker.sampler import draw

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(4000)]), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    torch.testing.assert_close(counts.double() / 4000, probs.double(), atol=0.03, rtol=0)
    # Unnormalised mass is fine (top-p renormalises in float32); none at all is an error.
    assert draw(torch.tensor([0.0, 0.0, 2.5]), gen) == 2
    with pytest.raises(ValueError, match="probabilities sum to 0.0"):
        draw(torch.zeros(3), gen)


#: Every filter, alone and combined, seeded and not: rows of one batch with different params.
MIXED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5, seed=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, seed=11),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=1e-9, seed=5),
    SamplingParams(temperature=2.0, top_k=1),
]


@pytest.mark.parametrize("vocab", [7, 1000])
def test_the_batched_draw_equals_the_row_by_row_one(vocab: int) -> None:
    """One batched pass gives exactly the tokens of sampling each row on its own (same generators,
    same order), over many steps and random logits with ties."""
    gen = torch.Generator().manual_seed(vocab)
    batched, per_row = Sampler(9), Sampler(9)
    for step in range(40):
        logits = torch.randn(len(MIXED_PARAMS), vocab, generator=gen) * 3
        logits[:, vocab // 2] = logits[:, 0]          # ties, for the stable sort
        steps = [step] * len(MIXED_PARAMS)
        got = batched.sample(logits, MIXED_PARAMS, steps)
        want = [int(logits[i].argmax()) if p.greedy else per_row.sample_row(logits[i], p, step)
                for i, p in enumerate(MIXED_PARAMS)]
        assert got == want, f"step {step}"


def test_a_row_without_mass_fails_alone_in_the_batched_draw() -> None:
    """Temperature so small that the scaled logits overflow: that row is None, the others sampled."""
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    tiny = SamplingParams(temperature=1e-45, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=2)
    tokens = Sampler().sample(logits, [tiny, seeded], [0, 0])
    assert tokens == [None, Sampler().sample_row(logits[1], seeded, 0)]
