"""The C grammar-mask kernel (``fastserve.kernels.cpu_token_mask``) against the sampler's torch path
(``masked_fill_`` over unpacked bits, then ``argmax``): the same -inf positions, the same
untouched values, the same "allows nothing" flags and greedy tokens, for masks shorter and
longer than the vocabulary, words that allow everything or nothing, and a subset of the rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastserve.kernels import cpu_token_mask
from fastserve.worker.sampler import _masked_fill_rows

pytestmark = pytest.mark.skipif(not cpu_token_mask.fits(torch.zeros((1, 1))), reason="no C compiler here")


@pytest.mark.parametrize("vocab,words", [(1000, 32), (1000, 30), (49_152, 1536), (33, 2)])
def test_the_kernel_masks_exactly_as_masked_fill(vocab: int, words: int) -> None:
    rng = np.random.default_rng(vocab + words)
    packed = rng.integers(0, 256, size=(5, 4 * words), dtype=np.uint8)
    packed[1, : 4 * (words // 2)] = 0xFF    # words that allow every token
    packed[2] = 0                           # allows nothing
    packed[3, ::8] = 0                      # a zero word every other one
    logits = torch.randn(7, vocab)
    rows = [0, 1, 2, 4, 6]
    ours, theirs = logits.clone(), logits.clone()
    allowed, tokens = cpu_token_mask.mask_rows(ours, rows, packed)
    assert allowed == _masked_fill_rows(theirs, rows, packed) == [True, True, False, True, True]
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[3, 5]], logits[[3, 5]])
    expected = theirs[rows].argmax(dim=-1).tolist()
    kept = [i for i, ok in enumerate(allowed) if ok]
    assert [tokens[i] for i in kept] == [expected[i] for i in kept]


def test_the_kernel_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="float32 CPU rows"):
        cpu_token_mask.mask_rows(torch.zeros((1, 8), dtype=torch.float64), [0], np.zeros((1, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        cpu_token_mask.mask_rows(torch.zeros((1, 8)), [0], np.zeros((1, 3), dtype=np.uint8))
