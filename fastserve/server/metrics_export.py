"""The app's own ``GET /metrics`` without Prometheus: every alive node's Ray metrics agent export,
our families renamed ``fastserve:<suffix>`` (vLLM's standalone naming), series unchanged and never
summed. Ray's lag and histogram semantics: docs/operations.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from fastserve.engine.metrics import PREFIX

log = logging.getLogger(__name__)

RAY_PREFIX = "ray_"
EXPOSED_PREFIX = "fastserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposed_name(ray_name: str) -> str | None:
    """``ray_fastserve_x`` → ``fastserve:x``; None for a family that is not ours."""
    ours = RAY_PREFIX + PREFIX
    return EXPOSED_PREFIX + ray_name[len(ours):] if ray_name.startswith(ours) else None


def our_families(texts: Iterable[str]) -> list[Metric]:
    """Our families from several agents' exports, renamed; one family's samples concatenated."""
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            name = exposed_name(family.name)
            if name is None:
                continue
            target = merged.get(name)
            if target is None:
                target = merged[name] = Metric(name, family.documentation, family.type)
            offset = len(family.name)
            for s in family.samples:   # e.g. ray_fastserve_x_bucket → fastserve:x_bucket
                target.samples.append(s._replace(name=name + s.name[offset:]))
    return [merged[k] for k in sorted(merged)]


class _Families(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def render(families: Sequence[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def agent_urls() -> list[str]:
    """Every alive node's metrics agent URL (needs a Ray connection)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


async def fetch(urls: Sequence[str], timeout_s: float) -> list[str]:
    """Each agent's export; one that does not answer is logged and skipped."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url) as resp:
                resp.raise_for_status()
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("metrics agent %s did not answer: %r", url, exc)
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        texts = await asyncio.gather(*(one(session, u) for u in urls))
    return [t for t in texts if t is not None]


class AgentMetrics:

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def text(self) -> str:
        urls = await asyncio.to_thread(agent_urls)
        return render(our_families(await fetch(urls, self.timeout_s)))
