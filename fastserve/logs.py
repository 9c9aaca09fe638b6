"""Our log lines in Serve replicas.

Serve writes its own logger (``ray.serve``) to each replica's log file, with the replica and
request ids, and does not propagate it; our ``fastserve.*`` loggers would otherwise go to Python's
last-resort stderr handler, warnings only. ``join_serve_logs`` gives them Serve's handlers.
"""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"
APP_LOGGER = "fastserve"


def join_serve_logs(level: int = logging.INFO) -> None:
    """Send ``fastserve.*`` records to this replica's Serve log (call once per replica, in its init)."""
    ours = logging.getLogger(APP_LOGGER)
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False
