"""``free_port``: a TCP port that is free now and likely still free when bound a moment later.

Picking a port by binding port 0 and closing the socket (the usual trick) races with every other
process on the node that asks the kernel for a port: the kernel hands those out from the same
ephemeral range, so in the gap between the pick and the real bind one may take it. Starting a Ray
node is exactly such a burst (its node manager, object manager and metrics agent bind port 0, its
gRPC clients open outgoing connections), and CI saw it: Serve's proxy failed to bind the HTTP port
picked just before ``ray start`` with "Address already in use". Ports are therefore drawn at random
between Ray's worker ports and the kernel's ephemeral range, where nothing is handed out unasked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Just above Ray's default worker ports (``--min-worker-port`` 10002 .. ``--max-worker-port`` 19999).
RANGE_LOW = 20000
#: Linux's default ephemeral range starts here (where the kernel's setting cannot be read).
DEFAULT_EPHEMERAL_LOW = 32768
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Random draws before falling back to a kernel-chosen port.
ATTEMPTS = 64


def ephemeral_low(setting: Path = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``)."""
    try:
        return int(setting.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "", high: int | None = None) -> int:
    """A port on ``host`` ("" = every interface) free right now: one drawn from
    ``[RANGE_LOW, ephemeral_low())`` (``high`` overrides the end), or, where that range is empty
    or full, one the kernel picks."""
    end = ephemeral_low() if high is None else high
    if end > RANGE_LOW:
        draw = random.Random()
        for _ in range(ATTEMPTS):
            port = draw.randrange(RANGE_LOW, end)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
