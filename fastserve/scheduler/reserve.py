"""``ArrivalReserve``: the burst slots, device blocks kept free for arrivals (paper §4.2), optionally
sized from recent arrivals ("tuned on historical arrival patterns")."""

from __future__ import annotations

import math
from collections import deque

from fastserve.scheduler.config import KVCacheConfig


class ArrivalReserve:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self._arrivals: deque[tuple[float, int]] = deque()   # (time, prompt blocks)
        self._blocks = 0

    def note_arrival(self, now: float, prompt_blocks: int) -> None:
        if self.config.adaptive_reserve:
            self._arrivals.append((now, prompt_blocks))
            self._blocks += prompt_blocks
            self._forget(now)

    def _forget(self, now: float) -> None:
        horizon = now - self.config.adaptive_window_s
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._blocks -= self._arrivals.popleft()[1]

    def blocks(self, now: float) -> int:
        cfg = self.config
        if not cfg.adaptive_reserve:
            return cfg.reserved_blocks
        self._forget(now)
        if cfg.adaptive_blocks_per_arrival is None:
            adaptive = float(self._blocks)
        else:
            adaptive = len(self._arrivals) * cfg.adaptive_blocks_per_arrival
        cap = math.floor(cfg.adaptive_max_fraction * cfg.num_device_blocks)
        return min(cfg.reserved_blocks + min(math.ceil(adaptive), cap), cfg.num_device_blocks - 1)
