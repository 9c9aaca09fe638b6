"""Between pipeline stages each TP rank sends only its 1/TP of the hidden states
(``fastserve.worker.worker.hidden_part``); the next stage's ranks all-gather the parts in rank
order (``TensorParallelGroup.all_gather``; the pipeline tests run it on gloo at TP 2 × PP 2)."""

from __future__ import annotations

import pickle

import pytest
import torch

from fastserve.worker.worker import hidden_part


@pytest.mark.parametrize("tp", [2, 4])
def test_the_parts_in_rank_order_rebuild_the_hidden_states(tp: int) -> None:
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(tp))
    parts = [hidden_part(hidden, rank, tp) for rank in range(tp)]
    assert {shape for _, shape in parts} == {(5, 64)}
    assert all(part.numel() == hidden.numel() // tp for part, _ in parts)
    assert torch.equal(torch.cat([part for part, _ in parts]).reshape(5, 64), hidden)


def test_a_part_is_serialised_without_the_rest_of_the_tensor() -> None:
    """Ray pickles what a worker returns: a view would carry its whole storage."""
    hidden = torch.randn(256, 64)
    part, _ = hidden_part(hidden, 1, 2)
    whole, half = len(pickle.dumps(hidden)), len(pickle.dumps(part))
    assert half < 0.55 * whole, (half, whole)   # half the elements plus the same small header


def test_one_rank_or_an_uneven_split_sends_the_whole_tensor() -> None:
    hidden = torch.randn(3, 5)
    part, shape = hidden_part(hidden, 0, 1)
    assert part is hidden and shape is None
    part, shape = hidden_part(hidden, 1, 2)   # 15 elements do not split in 2
    assert part is hidden and shape is None
