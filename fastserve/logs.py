"""Our log lines in Serve replicas: Serve's ``ray.serve`` logger does not propagate, so ``fastserve.*``
would reach only Python's last-resort stderr handler; ``join_serve_logs`` gives them Serve's handlers."""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"
APP_LOGGER = "fastserve"


def join_serve_logs(level: int = logging.INFO) -> None:
    """Call once per replica, in its init."""
    ours = logging.getLogger(APP_LOGGER)
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False
