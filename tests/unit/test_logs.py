"""``fastserve.logs.join_serve_logs``: our log lines reach the handlers Serve gives its own logger."""

from __future__ import annotations

import logging

from fastserve.logs import APP_LOGGER, SERVE_LOGGER, join_serve_logs


def test_app_records_reach_the_serve_loggers_handlers_once() -> None:
    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(f"{record.name}: {record.getMessage()}")

    serve, ours = logging.getLogger(SERVE_LOGGER), logging.getLogger(APP_LOGGER)
    saved = (list(ours.handlers), ours.level, ours.propagate)
    collect = Collect()
    serve.addHandler(collect)
    try:
        join_serve_logs()
        join_serve_logs()   # a second replica init in the same process adds nothing twice
        logging.getLogger("fastserve.engine.delivery").info("channel to %s open", "r1")
        assert collect.lines == ["fastserve.engine.delivery: channel to r1 open"]
    finally:
        serve.removeHandler(collect)
        ours.handlers[:] = saved[0]
        ours.setLevel(saved[1])
        ours.propagate = saved[2]
