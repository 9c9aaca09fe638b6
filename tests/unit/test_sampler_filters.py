"""The batched filters and draw read only the tokens they need, and give exactly what sorting the
whole vocabulary gives: bit-equal probabilities, the same tokens.

The reference here is the definition written with full sorts (a stable descending sort for
top-p, so tied probabilities are kept lowest id first; the k-th value of a full sort for top-k,
so every token tied with it is kept) and a float64 running sum over the whole vocabulary for the
draw. Logits are bf16 values widened to float32, as the LM head gives them: ties are common.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from fastserve.kernels import cpu_draw
from fastserve.worker import sampler as S
from fastserve.worker.messages import SamplingParams


def full_sort_filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    rows, vocab = logits.shape
    scaled = logits / torch.tensor([p.temperature for p in params])[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params])[:, None]
        first = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill((first < min_p * first.max(dim=-1, keepdim=True).values) & (min_p > 0),
                                    float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k)[:, None]
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(min=0))
        scaled = scaled.masked_fill((scaled < kth) & (k > 0), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop[:, 0] = False
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = torch.where(top_p < 1.0, kept / kept.sum(dim=-1, keepdim=True), probs)
    return probs


def full_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    ok = (total > 0) & torch.isfinite(total)
    index = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True)[:, 0]
    return torch.minimum(index, torch.count_nonzero(cdf < total[:, None], dim=-1)), ok


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 1.5]),
                          top_p=rng.choice([1.0, 0.9, 0.5, 0.95, 0.999, 1e-6]),
                          top_k=rng.choice([0, 0, 1, 5, 50, vocab, vocab + 3]),
                          min_p=rng.choice([0.0, 0.0, 0.05]))


def bf16_logits(gen: torch.Generator, rows: int, vocab: int, scale: float) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=gen) * scale).bfloat16().float()


@pytest.mark.parametrize("window, growth", [(S.NUCLEUS_WINDOW, S.NUCLEUS_GROWTH), (2, 2)])
def test_filters_equal_the_full_sort_bit_for_bit(window: int, growth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any window (a tiny one makes every row widen it several times) gives the same probabilities."""
    monkeypatch.setattr(S, "NUCLEUS_WINDOW", window)
    monkeypatch.setattr(S, "NUCLEUS_GROWTH", growth)
    rng, gen = random.Random(window), torch.Generator().manual_seed(window)
    for case in range(60):
        vocab = rng.choice([5, 64, 1000])
        logits = bf16_logits(gen, 6, vocab, rng.choice([0.5, 2.0, 6.0]))
        if case % 3 == 0:
            logits = (logits * 2).round() / 2          # runs of tied probabilities
        logits[0, : vocab // 2] = float("-inf")          # an allowed_token_ids-style mask
        params = [random_params(rng, vocab) for _ in range(6)]
        assert torch.equal(S.batched_filtered_probs(logits, params), full_sort_filtered_probs(logits, params)), case


def test_filters_at_smollm2_vocabulary_equal_the_full_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = bf16_logits(gen, 4, 49_152, 3.0)
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.7, top_p=0.999)]
    assert torch.equal(S.batched_filtered_probs(logits, params), full_sort_filtered_probs(logits, params))


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_top_p_keeps_tied_tokens_lowest_id_first(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four tokens of 0.25 and top_p 0.5: the mass above the third reaches 0.5, so two are kept,
    and of equal probabilities a stable sort keeps the lowest ids; whatever window is sorted."""
    monkeypatch.setattr(S, "NUCLEUS_WINDOW", window)
    probs = torch.tensor([[0.1, 0.225, 0.225, 0.225, 0.225], [0.25, 0.25, 0.25, 0.25, 0.0]])
    keep = S.nucleus(probs, torch.tensor([[0.5], [0.5]]))
    assert keep.tolist() == [[False, True, True, True, False], [True, True, False, False, False]]
    assert S.nucleus(probs, torch.tensor([[1.0], [0.5]]))[0].all()   # top_p 1 keeps its whole row


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    kept = S.batched_filtered_probs(logits, [SamplingParams(top_k=2)])
    assert (kept[0] > 0).nonzero()[:, 0].tolist() == [1, 2, 4]


@pytest.mark.parametrize("kernel", [True, False])
def test_the_draw_equals_the_full_cdf_search(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C draw (where it builds) and torch's pick what searching the whole float64 CDF picks,
    on dense rows and rows of few tokens, at the ends of the unit interval too (0, and 1 where
    rounding puts the point at the total)."""
    if not kernel:
        monkeypatch.setattr(cpu_draw, "fits", lambda probs: False)
    elif not cpu_draw.fits(torch.zeros(1, 1)):
        pytest.skip("the C draw kernel did not build here")
    gen = torch.Generator().manual_seed(1)
    for case in range(30):
        probs = torch.rand(6, 3000, generator=gen) ** 4
        if case % 2:
            probs[probs < 0.9] = 0.0                       # few tokens, as after top-k or top-p
        probs[1] = 0.0                                     # a row without mass
        probs[2, 7] = 1e-30                                # mass that a float64 sum may not see
        probs[5, 11] = float("nan")                        # a row that is not a distribution
        uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
        uniforms[3], uniforms[4] = 0.0, 1.0
        got, ok = S.draw_rows(probs, uniforms)
        want, want_ok = full_cdf_draw(probs, uniforms)
        assert ok.tolist() == want_ok.tolist() == [True, False, True, True, True, False]
        assert torch.equal(got[ok], want[ok]), case
