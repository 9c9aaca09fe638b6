"""The engine replica's periodic stats line, as vLLM logs one every 5 s: throughput since the last
line, the scheduler's state now, and the prefix-cache hit rate of the prompt tokens looked up since.
An idle replica's second idle line and after go to DEBUG. Imports no torch, no ray.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StatsLine:

    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    running: int
    waiting: int
    swapped: int
    kv_usage: float
    prefix_hit_rate: float

    @property
    def idle(self) -> bool:
        return not (self.prompt_tokens_per_s or self.generation_tokens_per_s
                    or self.running or self.waiting or self.swapped)

    def __str__(self) -> str:
        return (f"Avg prompt throughput: {self.prompt_tokens_per_s:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens_per_s:.1f} tokens/s, "
                f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, Swapped: {self.swapped} reqs, "
                f"KV cache usage: {self.kv_usage:.1%}, Prefix cache hit rate: {self.prefix_hit_rate:.1%}")


class StatsLog:
    """Accumulates tokens between lines; ``observe`` makes the line once ``interval_s`` passed."""

    def __init__(self, interval_s: float, now: float) -> None:
        if interval_s < 0:
            raise ValueError(f"stats log interval must be >= 0 s, got {interval_s}")
        self.interval_s = interval_s
        self._since = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._hits = self._queries = 0
        self._was_idle = False

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens

    def observe(self, gauges: Mapping[str, float], prefix_hits: int, prefix_queries: int,
                now: float) -> StatsLine | None:
        """The line for the interval ending ``now``, or None when not due (or off). ``gauges``:
        ``scheduler_gauges``' keys; ``prefix_*``: cumulative totals."""
        elapsed = now - self._since
        if not self.interval_s or elapsed < self.interval_s:
            return None
        queries = prefix_queries - self._queries
        line = StatsLine(
            prompt_tokens_per_s=self._prompt_tokens / elapsed,
            generation_tokens_per_s=self._generation_tokens / elapsed,
            running=int(gauges["num_requests_running"]),
            waiting=int(gauges["admission_queue_jobs"]),
            swapped=int(gauges["num_requests_swapped"]),
            kv_usage=float(gauges["kv_cache_usage_perc"]),
            prefix_hit_rate=(prefix_hits - self._hits) / queries if queries else 0.0)
        self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0
        self._hits, self._queries = prefix_hits, prefix_queries
        return line

    def level(self, line: StatsLine) -> int:
        """INFO, or DEBUG for the second idle interval in a row and after."""
        quiet = line.idle and self._was_idle
        self._was_idle = line.idle
        return logging.DEBUG if quiet else logging.INFO
