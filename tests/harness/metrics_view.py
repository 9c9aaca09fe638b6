"""Reading the app's ``/metrics`` in tests: parsed with ``prometheus_client``'s own parser."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class Scrape:
    """One ``/metrics`` answer: family types and every sample."""

    types: dict[str, str]
    samples: list[Sample]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        families = list(text_string_to_metric_families(text))
        return cls({f.name: f.type for f in families}, [s for f in families for s in f.samples])

    def series(self, name: str, **labels: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        """The sum over the series of ``name`` carrying ``labels`` (0 when there are none)."""
        return sum(s.value for s in self.series(name, **labels))

    def replicas(self, name: str) -> set[str]:
        return {s.labels["replica"] for s in self.series(name)}


def scrape(base_url: str) -> Scrape:
    resp = httpx.get(base_url + "/metrics", timeout=30)
    resp.raise_for_status()
    return Scrape.parse(resp.text)


def wait_metrics(base_url: str, ok: Callable[[Scrape], bool], timeout: float = 30.0) -> Scrape:
    """Scrape until ``ok`` holds or ``timeout`` passes; the caller asserts on the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base_url)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def quiet_metrics(base_url: str, name: str, settle_s: float, timeout: float) -> Scrape:
    """A scrape once nothing moves: two scrapes ``settle_s`` apart (a few of Ray's report
    intervals) agree on ``name``, so every earlier request has reached the export."""
    deadline = time.monotonic() + timeout
    last = scrape(base_url)
    while True:
        time.sleep(settle_s)
        now = scrape(base_url)
        if now.total(name) == last.total(name) or time.monotonic() > deadline:
            return now
        last = now
