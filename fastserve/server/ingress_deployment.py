"""The ``Ingress`` Serve deployment: ``OpenAIServer`` wired to the Engine deployment's handle, Ray's
metrics agents and this replica's delivery channels; its FastAPI app is built per replica."""

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
    """The production ``Backend``. With ``channels``, jobs' tokens come on this ingress replica's
    delivery channels (one message per step per engine replica); without, on each job's stream."""

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
        """Every engine replica forgets its cached blocks (one call each); TimeoutError past the bound."""
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
    subscribe = engine.options(stream=True).subscribe

    def open_channel(ingress: str, replica_id: str, channel_id: str) -> ServeStream[Message]:
        stream: ServeStream[Message] = subscribe.remote(ingress_id=ingress, channel_id=channel_id,
                                                 **{PIN_KWARG: replica_id})
        return stream

    return ChannelClient(ingress_id, open_channel, open_timeout_s)


@serve.ingress()
class Ingress:

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
    """This replica's unique id: the engine replicas key its delivery channel by it."""
    return str(serve.get_replica_context().replica_id.unique_id)
