"""The app's own ``GET /metrics``: our families as Ray's metrics agents export them.

Owns the single-machine view of the metrics (no Prometheus needed): the ingress fetches the
Prometheus text of every alive node's Ray metrics agent (the endpoint KubeRay's PodMonitor
scrapes), keeps the ``ray_fastserve_*`` families, and renames them ``fastserve:<suffix>`` (vLLM's
standalone naming). Samples and their labels pass through unchanged: series of different
replicas and nodes stay separate (a ``replica`` label tells them apart); nothing is summed.

What the agents show follows Ray's semantics: values lag by ``RAY_metrics_report_interval_ms``
(how often workers report); a replica that died keeps its last values in its node's export, so
the app-wide sum of a counter does not fall when a replica is replaced; Ray reports a histogram's
``_sum`` from bucket midpoints, not the exact observed values.
"""

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

#: Ray prepends this to every application-defined metric name.
RAY_PREFIX = "ray_"
#: The prefix families carry on the app's ``/metrics`` (vLLM's standalone form: ``vllm:``).
EXPOSED_PREFIX = "fastserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposed_name(ray_name: str) -> str | None:
    """``ray_fastserve_x`` → ``fastserve:x``; None for a family that is not ours."""
    ours = RAY_PREFIX + PREFIX
    return EXPOSED_PREFIX + ray_name[len(ours):] if ray_name.startswith(ours) else None


def our_families(texts: Iterable[str]) -> list[Metric]:
    """Our families from several agents' exports, renamed; samples of one family concatenated."""
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
    """Prometheus text format (0.0.4) of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def agent_urls() -> list[str]:
    """The ``/metrics`` URL of every alive node's Ray metrics agent (needs a Ray connection)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


async def fetch(urls: Sequence[str], timeout_s: float) -> list[str]:
    """Each agent's export; an agent that does not answer is logged and skipped."""
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
    """The ingress's ``/metrics`` source: Ray's metrics agents, read at request time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def text(self) -> str:
        urls = await asyncio.to_thread(agent_urls)
        return render(our_families(await fetch(urls, self.timeout_s)))
