"""The ``Ingress`` Serve deployment: the HTTP server in front of the Engine deployment.

Owns the production wiring of ``fastserve.server.ingress.OpenAIServer``: ``ServeBackend`` (the Engine
deployment's handle, Ray's metrics agents), this replica's delivery channels
(``channel_client``, ``fastserve.engine.delivery``), and ``Ingress``, the deployment class ``fastserve.main``
binds; its FastAPI app (``fastserve.server.http_api.make_api``) is built per replica.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI
from ray import serve

from fastserve.config import AppArgs
from fastserve.engine.delivery import ChannelClient, JobStream, Message, ServeStream
from fastserve.engine.metrics import IngressMetrics
from fastserve.logs import join_serve_logs
from fastserve.scheduler.job import JobRequest
from fastserve.server.http_api import make_api
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.server.metrics_export import AgentMetrics
from fastserve.server.routing import PIN_KWARG

log = logging.getLogger(__name__)


class ServeBackend:
    """The production ``Backend``: the Engine deployment's handle, Ray's metrics agents.

    With ``channels`` (``server.delivery_channels``), jobs' tokens come on this ingress replica's
    delivery channels (one message per step per engine replica, ``fastserve.engine.delivery``) once one is
    open to the replica a job landed on; without, each job's tokens come on its own stream."""

    def __init__(self, engine: Any, metrics: AgentMetrics, channels: ChannelClient | None,
                 reset_timeout_s: float) -> None:
        self._generate = engine.options(stream=True).generate
        self._stats = engine.stats
        self._engine = engine
        self._reset_timeout_s = reset_timeout_s
        self._health = engine.health
        self._metrics = metrics
        self.channels = channels

    def generate(self, req: JobRequest) -> JobStream:
        channels = self.channels
        if channels is None:
            return JobStream(req.job_id, self._generate.remote(req))
        return channels.submit(req.job_id, lambda: self._generate.remote(req, channels.ingress_id))

    async def metrics_text(self) -> str:
        return await self._metrics.text()

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """Every running engine replica forgets its cached blocks (Serve's broadcast: one call
        per replica; each model copy has its own cache). Raises TimeoutError past the bound."""
        replies = await self._engine.broadcast("reset_prefix_cache").results_async(
            timeout_s=self._reset_timeout_s)
        return {"reset_blocks": sum(int(r["reset_blocks"]) for r in replies), "replicas": len(replies)}

    async def engine_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self._stats.remote()
        return stats

    async def health(self) -> dict[str, Any]:
        state: dict[str, Any] = await self._health.remote()
        return state


def channel_client(engine: Any, ingress_id: str, open_timeout_s: float) -> ChannelClient:
    """This ingress replica's delivery channels over the Engine deployment's handle."""
    subscribe = engine.options(stream=True).subscribe

    def open_channel(ingress: str, replica_id: str, channel_id: str) -> ServeStream[Message]:
        stream: ServeStream[Message] = subscribe.remote(ingress_id=ingress, channel_id=channel_id,
                                                 **{PIN_KWARG: replica_id})
        return stream

    return ChannelClient(ingress_id, open_channel, open_timeout_s)


@serve.ingress()
class Ingress:
    """The HTTP entry point; ``fastserve.main`` applies its Serve options (autoscaling, ...)."""

    def __init__(self, engine: Any, args: dict[str, Any]) -> None:
        join_serve_logs()
        started = time.monotonic()
        app_args = AppArgs.model_validate(args)
        ctx = ServerContext.from_args(app_args)
        srv = app_args.server
        channels = channel_client(engine, _ingress_replica_id(), srv.channel_open_timeout_s) \
            if srv.delivery_channels else None
        backend = ServeBackend(engine, AgentMetrics(srv.metrics_agent_timeout_s), channels,
                               srv.reset_timeout_s)
        self.server = OpenAIServer(ctx, backend, IngressMetrics(ctx.model_name))
        log.info("ingress ready in %.1f s for model %s", time.monotonic() - started, ctx.model_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return make_api(self.server)


def _ingress_replica_id() -> str:
    """This Serve replica's unique id: the engine replicas key its delivery channel by it."""
    return str(serve.get_replica_context().replica_id.unique_id)
