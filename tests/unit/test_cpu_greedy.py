"""The greedy reductions in fastserve/kernels/cpu/greedy.c against torch: argmax and the finiteness flag."""

from __future__ import annotations

import shutil

import pytest
import torch

from fastserve.kernels import cpu_greedy

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49_152, 50_265])
@pytest.mark.parametrize("threads", [1, 2])
def test_tokens_are_torch_argmax(vocab: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen)
    logits[1] = -torch.inf                    # all masked: argmax is the first index
    logits[1, vocab // 2] = 3.0 if vocab > 2 else -torch.inf
    logits[2, :] = 1.0                        # a tie everywhere: the first index
    if vocab > 3:
        logits[3, vocab - 1] = logits[3, 2] = 50.0   # a tie: the first of the two
        logits[4, ::2] = -torch.inf           # min_tokens-style masks
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokens, finite = cpu_greedy.greedy_rows(logits)
    finally:
        torch.set_num_threads(previous)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert finite == [True, False, True, True, vocab <= 4, True, True]


def test_nan_and_positive_infinity_rows_are_not_finite() -> None:
    logits = torch.zeros(4, 1_000)
    logits[0, 999] = torch.nan
    logits[1, 3] = torch.inf
    logits[2, 17] = torch.nan
    logits[2, 18] = torch.inf
    tokens, finite = cpu_greedy.greedy_rows(logits)
    assert finite == [False, False, False, True]
    assert tokens[1] == 3 and tokens[3] == 0


def test_rows_of_a_wider_matrix_and_what_it_refuses() -> None:
    wide = torch.randn(5, 300)
    rows = wide[:, :256]                      # rows 300 floats apart
    assert cpu_greedy.fits(rows)
    assert cpu_greedy.greedy_rows(rows)[0] == rows.argmax(dim=-1).tolist()
    assert cpu_greedy.greedy_rows(torch.empty(0, 10)) == ([], [])
    for bad in (torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(3, 2).t(), torch.zeros(3)):
        assert not cpu_greedy.fits(bad)
        with pytest.raises(ValueError, match="greedy_rows takes float32 CPU rows"):
            cpu_greedy.greedy_rows(bad)
