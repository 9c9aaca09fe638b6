"""The KV store: bit-exact swap round-trips, and a step never reads a block still in flight."""

from __future__ import annotations

import threading

import pytest
import torch

from fastserve import kernels
from fastserve.worker.kv_store import DeviceStalls, KVStore
from fastserve.worker.messages import SwapCommand


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


class TimedEvent:
    """A CUDA timing event's part ``DeviceStalls`` reads: when the device reached it (ms), once
    it has (``reached`` None = not yet). CUDA's own events are used in tests/gpu."""

    def __init__(self, reached: float | None) -> None:
        self.reached = reached

    def query(self) -> bool:
        return self.reached is not None

    def elapsed_time(self, end_event: TimedEvent) -> float:
        assert self.reached is not None and end_event.reached is not None, "not both completed"
        return end_event.reached - self.reached


def test_device_stalls_sum_the_waits_the_device_passed_and_keep_the_rest() -> None:
    stalls = DeviceStalls()
    assert stalls.collect_s() == 0.0
    stalls.add(TimedEvent(10.0), TimedEvent(35.0))     # a 25 ms stall, passed
    pending = TimedEvent(None)
    stalls.add(TimedEvent(40.0), pending)              # the device is still inside this wait
    stalls.add(TimedEvent(50.0), TimedEvent(50.5))     # passed: 0.5 ms
    assert stalls.collect_s() == pytest.approx(0.0255)
    assert stalls.pending == 1
    assert stalls.collect_s() == 0.0                   # not yet passed, not read twice either
    pending.reached = 47.0
    assert stalls.collect_s() == pytest.approx(0.007)
    assert stalls.pending == 0 and stalls.collect_s() == 0.0


def test_a_steps_swap_wait_takes_the_device_stalls_read_after_it() -> None:
    """``StageRunner.finish_swaps`` adds what the device stalled (a GPU's ``wait_for``) to the
    step's ``swap_wait``, beside what the host waited; on CPU there is none to add."""
    from fastserve.worker.stage import StageRunner

    store = make_store()
    runner = StageRunner(model=None, kv=store)   # type: ignore[arg-type]   # finish_swaps needs no model
    timings = {"swap_wait": 0.002}
    runner.finish_swaps([], timings)
    assert timings["swap_wait"] == 0.002 and store.device_wait_s() == 0.0
    store.device_stalls.add(TimedEvent(0.0), TimedEvent(30.0))
    runner.finish_swaps([], timings)
    assert timings["swap_wait"] == pytest.approx(0.032)
    fresh: dict[str, float] = {}
    runner.finish_swaps([], fresh)
    assert "swap_wait" not in fresh
    store.close()
