"""``fastserve.worker.ports.free_port``: drawn between Ray's worker ports and the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fastserve.worker import ports


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_the_ephemeral_range_is_read_from_the_kernels_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ports.ephemeral_low(setting) == 40000
    assert ports.ephemeral_low(tmp_path / "missing") == 32768
    setting.write_text("garbage")
    assert ports.ephemeral_low(setting) == 32768


def test_a_port_is_drawn_below_the_ephemeral_range_and_binds() -> None:
    drawn = {ports.free_port("127.0.0.1", high=ports.RANGE_LOW + 500) for _ in range(20)}
    assert all(ports.RANGE_LOW <= p < ports.RANGE_LOW + 500 for p in drawn)
    assert len(drawn) > 1                     # drawn at random, not the first free one each time
    _bind(drawn.pop())


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ports.free_port("127.0.0.1", high=ports.RANGE_LOW) >= 1024   # empty range
    monkeypatch.setattr(ports, "_bindable", lambda host, port: False)   # every draw taken
    port = ports.free_port("127.0.0.1", high=ports.RANGE_LOW + 10)
    assert not ports.RANGE_LOW <= port < ports.RANGE_LOW + 10
    _bind(port)
