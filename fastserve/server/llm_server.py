"""Ray Serve LLM integration: ``FastServeLLMServer``, a ``server_cls`` for ``ray.serve.llm.LLMConfig``.
``engine_kwargs`` are our ``AppArgs``; each replica runs an ``EngineReplica`` in process behind our
``OpenAIServer``, while ``LLMServer`` keeps Ray's request ids, stream batching and error format.
Needs the ``serve-llm`` extra (docs/operations.md)."""

from __future__ import annotations

import copy
from collections.abc import AsyncGenerator
from typing import Any, cast

from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeResponse,
)
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
from ray.serve.llm import LLMServer

from fastserve.config import AppArgs
from fastserve.engine.delivery import JobEvent, JobStream, LocalStream
from fastserve.engine.metrics import IngressMetrics
from fastserve.engine.replica import EngineReplica
from fastserve.scheduler.job import JobRequest
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import Prepared, ServerContext
from fastserve.server.protocol import APIError
from fastserve.server.tokenize_api import detokenize_response, tokenize_response


def app_args(llm_config: LLMConfig) -> AppArgs:
    """``engine_kwargs`` as our ``AppArgs``; the served name is the config's ``model_id``."""
    kwargs = copy.deepcopy(dict(llm_config.engine_kwargs))
    model = kwargs.setdefault("model", {})
    name = model.setdefault("name", llm_config.model_id)
    if name != llm_config.model_id:
        raise ValueError(f"engine_kwargs.model.name={name!r} differs from model_id={llm_config.model_id!r}: "
                         "Ray Serve LLM routes requests by model_id")
    return AppArgs.model_validate(kwargs)


class LocalBackend:
    """``OpenAIServer``'s backend: the engine replica in this Serve replica."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica

    def generate(self, req: JobRequest) -> JobStream:
        return JobStream(req.job_id, LocalStream(cast(AsyncGenerator[JobEvent, None], self.replica.generate(req))))

    async def metrics_text(self) -> str:
        return ""   # Ray Serve LLM has no /metrics route; metrics go to Ray's agents

    async def engine_stats(self) -> dict[str, Any]:
        return await self.replica.stats()

    async def health(self) -> dict[str, Any]:
        return await self.replica.health()

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return await self.replica.reset_prefix_cache()


def _client_fields(request: Any) -> bytes:
    """Only the fields the client sent (vLLM's model filled defaults in); Ray's own request_id is
    not the client's, and our models refuse one."""
    raw: bytes = request.model_dump_json(exclude_unset=True, exclude={"request_id"}).encode()
    return raw


def error_response(exc: APIError) -> ErrorResponse:
    """Ray Serve LLM's error shape: the HTTP status travels in ``error.code``."""
    err = exc.body()["error"]
    return ErrorResponse.model_validate(
        {"error": {"message": err["message"], "type": err["type"], "param": err["param"], "code": exc.status}})


class FastServeEngine(LLMEngine):
    """One model copy: our scheduler, executor and OpenAI layer, in process. Request methods are
    async generators as ``LLMServer`` calls them (``LLMEngine`` annotates coroutines: the ignores)."""

    def __init__(self, llm_config: LLMConfig) -> None:
        self.llm_config = llm_config
        self.args = app_args(llm_config)
        self.replica: EngineReplica | None = None
        self.server: OpenAIServer | None = None

    async def start(self) -> None:
        self.replica = await EngineReplica.create(self.args)
        ctx = ServerContext.from_args(self.args)
        self.server = OpenAIServer(ctx, LocalBackend(self.replica), IngressMetrics(ctx.model_name))

    async def shutdown(self) -> None:
        if self.replica is not None:
            await self.replica.close()

    async def check_health(self) -> None:
        if self.replica is None:
            raise RuntimeError("the engine has not started")
        await self.replica.check_health()

    async def completions(  # type: ignore[override]
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        async for item in self._generate(request, chat=False):
            yield item

    async def chat(  # type: ignore[override]
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        async for item in self._generate(request, chat=True):
            yield item

    async def _generate(self, request: Any, chat: bool) -> AsyncGenerator[Any, None]:
        """Our validation and scheduling on the client's fields; SSE strings or one response."""
        assert self.server is not None, "start() first"
        raw = _client_fields(request)
        server = self.server
        try:
            prep = server.preparer.prepare_chat(raw) if chat else server.preparer.prepare_completion(raw)
            streams = await server.start_all(prep)
            if not prep.req.stream:
                body = await server.complete(prep, streams)
        except APIError as exc:
            yield error_response(exc)
            return
        if prep.req.stream:
            async for chunk in self._sse(prep, streams):
                yield chunk
            return
        yield (ChatCompletionResponse if chat else CompletionResponse).model_validate(body)

    async def tokenize(
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        """``/tokenize`` as our server answers it; Ray's router refuses a chat body first (400)."""
        assert self.server is not None, "start() first"
        try:
            yield TokenizeResponse.model_validate(tokenize_response(self.server.ctx, _client_fields(request)))
        except APIError as exc:
            yield error_response(exc)

    async def detokenize(
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        assert self.server is not None, "start() first"
        try:
            yield DetokenizeResponse.model_validate(detokenize_response(self.server.ctx, _client_fields(request)))
        except APIError as exc:
            yield error_response(exc)

    async def _sse(self, prep: Prepared, streams: list[JobStream]) -> AsyncGenerator[str, None]:
        assert self.server is not None
        async for chunk in self.server.sse(prep, streams):
            yield chunk.decode()

    def routing_stats(self) -> dict[str, Any]:
        return {}

    async def resolve_lora(self, lora_model: Any) -> None:
        raise NotImplementedError("FastServe serves one model per replica: no LoRA adapters")

    async def embeddings(  # type: ignore[override]
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        raise NotImplementedError("FastServe serves generation only: no embeddings")
        yield   # pragma: no cover  (makes this an async generator like the protocol's)

    async def transcriptions(  # type: ignore[override]
            self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        raise NotImplementedError("FastServe serves text generation only: no transcriptions")
        yield   # pragma: no cover

    async def reset_prefix_cache(self) -> None:
        if self.replica is not None:
            await self.replica.reset_prefix_cache()


class FastServeLLMServer(LLMServer):

    # LLMServer declares it None (then imports vLLM's engine); ours replaces that default.
    _default_engine_cls = FastServeEngine  # type: ignore[assignment]

    @classmethod
    def get_deployment_options(cls, llm_config: LLMConfig) -> dict[str, Any]:  # type: ignore[override]
        """Our Engine deployment's defaults and placement group, under ``deployment_config``'s."""
        args = app_args(llm_config)
        options = copy.deepcopy(dict(llm_config.deployment_config))
        for key in ("placement_group_bundles", "placement_group_strategy"):
            if key in options:
                raise ValueError(f"deployment_config.{key} is derived from engine_kwargs.parallel; do not set it")
        defaults = args.engine_deployment_defaults()
        options.setdefault("ray_actor_options", defaults["ray_actor_options"])
        return {**defaults, **options}
