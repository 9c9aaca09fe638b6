"""The KV store: bit-exact swap round-trips, and a step never reads a block still in flight."""

from __future__ import annotations

import threading

import pytest
import torch

import kernels
from actors.kv_store import KVStore
from actors.messages import SwapCommand


def make_store(**kw: int) -> KVStore:
    return KVStore(num_layers=3, num_heads=2, head_dim=8, block_size=4,
                   num_device_blocks=kw.get("dev", 8), num_host_blocks=kw.get("host", 6))


def fill_random(store: KVStore, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    store.device_pool.copy_(torch.randn(store.device_pool.shape, generator=gen))
    return store.device_pool.clone()


def out(pairs: list[tuple[int, int]]) -> SwapCommand:
    """device -> host, as a plan carries it: [(device_block, host_block), ...]."""
    return SwapCommand("out", "j", tuple(s for s, _ in pairs), tuple(d for _, d in pairs))


def back(pairs: list[tuple[int, int]]) -> SwapCommand:
    """host -> device: [(host_block, device_block), ...]."""
    return SwapCommand("in", "j", tuple(s for s, _ in pairs), tuple(d for _, d in pairs))


def test_swap_round_trip_is_bit_exact() -> None:
    store = make_store()
    original = fill_random(store)
    store.swap(out([(1, 0), (2, 1), (5, 4)])).wait()
    store.device_pool[[1, 2, 5]] = 0.0  # the blocks are reused by someone else meanwhile
    store.swap(back([(0, 6), (1, 7), (4, 3)])).wait()
    assert torch.equal(store.device_pool[6], original[1])
    assert torch.equal(store.device_pool[7], original[2])
    assert torch.equal(store.device_pool[3], original[5])
    assert store.swapped_out_blocks == 3 and store.swapped_in_blocks == 3


def test_layer_view_addresses_one_layer_of_every_block() -> None:
    store = make_store()
    original = fill_random(store)
    assert torch.equal(store.layer(2)[5], original[5, 2])
    assert store.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4


def test_a_block_in_flight_is_not_read_before_its_copy_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    original = fill_random(store)
    store.swap(out([(3, 2)])).wait()
    gate = threading.Event()
    real_copy = kernels.copy_blocks

    def gated_copy(*args: object, **kw: object) -> None:
        gate.wait(timeout=30)
        real_copy(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "copy_blocks", gated_copy)
    handle = store.swap(back([(2, 6)]))
    # A step over other blocks does not wait for this swap.
    store.wait_for([0, 1, 7])
    assert not handle.done()
    assert not torch.equal(store.device_pool[6], original[3])
    # A step that uses block 6 waits until the copy has landed.
    threading.Timer(0.1, gate.set).start()
    waited = store.wait_for([6])
    assert handle.done() and waited > 0.0
    assert torch.equal(store.device_pool[6], original[3])
    store.close()


def test_swaps_complete_in_issue_order() -> None:
    """A swap-in issued after the swap-out that fills the host block reads the new data."""
    store = make_store()
    original = fill_random(store)
    store.swap(out([(4, 0)]))
    handle = store.swap(back([(0, 7)]))
    handle.wait()
    assert torch.equal(store.device_pool[7], original[4])


@pytest.mark.parametrize("pairs, message", [
    ([(8, 0)], "device block 8 out of range"),
    ([(0, 6)], "host block 6 out of range"),
    ([(0, 1), (2, 1)], "writes one host block twice"),
])
def test_bad_swaps_name_the_block(pairs: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_store().swap(out(pairs))


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_device_blocks must be >= 1, got 0"):
        make_store(dev=0)
