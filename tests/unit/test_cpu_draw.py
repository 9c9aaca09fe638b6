"""The inverse-CDF draw in fastserve/kernels/cpu/draw.c against torch's float64 cumsum and search."""

from __future__ import annotations

import shutil

import pytest
import torch

from fastserve.kernels import cpu_draw

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")


def torch_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[list[int], list[bool]]:
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    index = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True)[:, 0]
    limit = torch.count_nonzero(cdf < total[:, None], dim=-1)
    return torch.minimum(index, limit).tolist(), ((total > 0) & torch.isfinite(total)).tolist()


@pytest.mark.parametrize("vocab", [1, 2, 1023, 1024, 1025, 3000, 49_152])
@pytest.mark.parametrize("threads", [1, 2])
def test_tokens_are_the_first_index_past_the_point(vocab: int, threads: int) -> None:
    """Block edges (1,024 tokens a block) included; sparse and dense rows; u = 0 and u = 1."""
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(8, vocab, generator=gen) ** 4
    probs[1][probs[1] < 0.95] = 0.0
    probs[2] = 0.0
    probs[2, vocab - 1] = 0.5                  # all the mass on the last token
    uniforms = torch.rand(8, generator=gen, dtype=torch.float64)
    uniforms[3], uniforms[4] = 0.0, 1.0
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, ok = cpu_draw.draw_rows(probs, uniforms)
    finally:
        torch.set_num_threads(previous)
    want, want_ok = torch_draw(probs, uniforms)
    assert ok.tolist() == want_ok
    assert [t for t, good in zip(tokens.tolist(), want_ok, strict=True) if good] == [
        t for t, good in zip(want, want_ok, strict=True) if good]
    assert tokens[2] == vocab - 1


def test_rows_without_a_distribution_are_not_ok() -> None:
    probs = torch.ones(4, 100)
    probs[0] = 0.0
    probs[1, 5] = float("nan")
    probs[2, 9] = float("inf")
    tokens, ok = cpu_draw.draw_rows(probs, torch.full((4,), 0.5, dtype=torch.float64))
    assert ok.tolist() == [False, False, False, True]
    assert tokens[3] == 50   # the running sum passes 50.0 at the 51st token


def test_rows_of_a_wider_matrix_and_what_it_refuses() -> None:
    wide = torch.rand(3, 2000)
    rows = wide[:, :1500]
    uniforms = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    assert cpu_draw.fits(rows)
    assert cpu_draw.draw_rows(rows, uniforms)[0].tolist() == torch_draw(rows.contiguous(), uniforms)[0]
    empty = cpu_draw.draw_rows(torch.empty(0, 10), torch.empty(0, dtype=torch.float64))
    assert empty[0].numel() == 0 and empty[1].numel() == 0
    for bad in (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2).t(), torch.zeros(3)):
        assert not cpu_draw.fits(bad)
        with pytest.raises(ValueError, match="draw_rows takes float32 CPU rows"):
            cpu_draw.draw_rows(bad, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="one variate per row"):
        cpu_draw.draw_rows(torch.zeros(2, 3), torch.zeros(3, dtype=torch.float64))
