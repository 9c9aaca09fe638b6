"""The FastAPI app of the OpenAI-compatible server (``make_api``): its routes, and the handlers that
turn every failure into an OpenAI error body with its status."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastserve.server.metrics_export import CONTENT_TYPE
from fastserve.server.protocol import APIError, error_body
from fastserve.server.request_limits import read_body, wait_for_disconnect
from fastserve.server.tokenize_api import add_routes as add_info_routes

if TYPE_CHECKING:
    from fastserve.server.ingress import OpenAIServer

log = logging.getLogger(__name__)


async def respond(server: OpenAIServer, raw: bytes, chat: bool,
                  disconnected: Callable[[], Awaitable[Any]] | None = None) -> Response:
    """Serve one generation request; tokenization runs off the loop (a large prompt must not stall
    this replica's other streams)."""
    prepare = server.preparer.prepare_chat if chat else server.preparer.prepare_completion
    prep = await asyncio.to_thread(prepare, raw)
    streams = await server.start_all(prep)
    if prep.req.stream:
        return StreamingResponse(server.sse(prep, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await server.complete_unless_gone(prep, streams, disconnected))


def make_api(server: OpenAIServer) -> FastAPI:
    api = FastAPI(title="FastServe on Ray", docs_url=None, redoc_url=None)

    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code)

    @api.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"),
                            status_code=500)

    def guarded(chat: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            server.preparer.check_auth(request.headers.get("authorization"))
            raw = await read_body(request, server.ctx.limits.max_request_bytes)
            return await respond(server, raw, chat, lambda: wait_for_disconnect(request.receive))
        return endpoint

    api.add_api_route("/v1/completions", guarded(False), methods=["POST"])
    api.add_api_route("/v1/chat/completions", guarded(True), methods=["POST"])

    add_info_routes(api, server)

    @api.get("/health")
    async def health() -> Response:
        """200 while an engine replica answers healthy, else 503 naming the problem; no API key
        (load balancers and KubeRay probes call it)."""
        try:
            state = await asyncio.wait_for(server.backend.health(), server.ctx.limits.health_timeout_s)
        except Exception as exc:   # unhealthy, whatever the cause
            state = {"healthy": False, "problem": f"no engine replica answered: {type(exc).__name__}"}
        if state.get("healthy"):
            return PlainTextResponse("ok")
        return JSONResponse(error_body(f"unhealthy: {state.get('problem')}", "service_unavailable", None,
                                       "unhealthy"), status_code=503)

    @api.get("/debug/engine")
    async def engine_stats(request: Request) -> JSONResponse:
        server.preparer.check_auth(request.headers.get("authorization"))
        return JSONResponse(await server.backend.engine_stats())

    if server.ctx.allow_reset_prefix_cache:
        @api.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> JSONResponse:
            """vLLM's endpoint: every engine replica forgets its unused cached KV blocks."""
            server.preparer.check_auth(request.headers.get("authorization"))
            try:
                return JSONResponse(await server.backend.reset_prefix_cache())
            except TimeoutError as exc:
                return JSONResponse(error_body(f"reset_prefix_cache: {exc}", "service_unavailable", None,
                                               "timeout"), status_code=503)

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.backend.metrics_text(), media_type=CONTENT_TYPE)

    return api
