"""The job profile as the scheduler reads it (paper §3.2): ``t_init(prompt_len)``, ``t_dec(batch)``,
``q1`` and the levels, interpolated from ``python -m fastserve.engine.profiler``'s output."""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from fastserve.worker.messages import DEFAULT_BLOCK_SIZE


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); linear extrapolation on the outer segments."""
    if len(xs) == 1:
        return ys[0]
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]   # exactly the measurement, not a rounded interpolation
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_grid(name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"profile {name}: {len(xs)} grid points but {len(ys)} timings")
    if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError(f"profile {name}: grid must be strictly ascending, got {list(xs)}")
    if any(not (y > 0 and math.isfinite(y)) for y in ys):
        raise ValueError(f"profile {name}: timings must be finite and > 0, got {list(ys)}")


@dataclass(frozen=True)
class Profile:
    """Iteration times of one (model, hardware, tp, pp) configuration."""

    model: str
    hardware: str
    init_lens: tuple[int, ...]
    init_seconds: tuple[float, ...]
    dec_batch_sizes: tuple[int, ...]
    dec_seconds: tuple[float, ...]
    swap_bytes_per_block: int = 0
    swap_seconds_per_block: float = 0.0
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        _check_grid("t_init", self.init_lens, self.init_seconds)
        _check_grid("t_dec", self.dec_batch_sizes, self.dec_seconds)
        if self.swap_seconds_per_block < 0:
            raise ValueError(
                f"profile swap.seconds_per_block must be >= 0, got {self.swap_seconds_per_block}"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Profile:
        swap = raw.get("swap", {})
        return cls(
            model=str(raw.get("model", "unknown")),
            hardware=str(raw.get("hardware", "unknown")),
            init_lens=tuple(int(x) for x in raw["t_init"]["prompt_lens"]),
            init_seconds=tuple(float(x) for x in raw["t_init"]["seconds"]),
            dec_batch_sizes=tuple(int(x) for x in raw["t_dec"]["batch_sizes"]),
            dec_seconds=tuple(float(x) for x in raw["t_dec"]["seconds"]),
            swap_bytes_per_block=int(swap.get("bytes_per_block", 0)),
            swap_seconds_per_block=float(swap.get("seconds_per_block", 0.0)),
            tp=int(raw.get("tp", 1)),
            pp=int(raw.get("pp", 1)),
            dtype=str(raw.get("dtype", "float32")),
            block_size=int(raw.get("block_size", 16)),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def t_init(self, prompt_len: int) -> float:
        """First-iteration time for ``prompt_len`` tokens; never below the smallest measured."""
        value = _interpolate(self.init_lens, self.init_seconds, float(prompt_len))
        return max(value, min(self.init_seconds))

    def t_dec(self, batch_size: int) -> float:
        """Decode-iteration time for ``batch_size`` jobs; never below the smallest measured."""
        value = _interpolate(self.dec_batch_sizes, self.dec_seconds, float(batch_size))
        return max(value, min(self.dec_seconds))

    def longest_prompt_within(self, seconds: float, upper: int) -> int:
        """Largest n in [1, upper] with t_init(n) ≤ ``seconds`` (at least 1)."""
        lo, hi = 1, max(upper, 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.t_init(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @cached_property
    def q1(self) -> float:
        """The highest level's quantum: the smallest decode-iteration time (§4.1)."""
        return min(self.dec_seconds)

    @property
    def max_t_init(self) -> float:
        return max(self.init_seconds)

    def num_levels(self, growth: float, q1: float | None = None) -> int:
        """Fewest levels with q1·growth^(n-1) ≥ the largest profiled t_init."""
        base = self.q1 if q1 is None else q1
        n = 1
        while base * growth ** (n - 1) < self.max_t_init:
            n += 1
        return n
