"""What one HTTP client may ask (``RequestLimits``: the ``server.*`` limits with their defaults),
reading a body under its size limit, watching for the client leaving, and timeout errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from fastserve.config_server import ServerArgs
from fastserve.server.protocol import APIError


@dataclass(frozen=True)
class RequestLimits:

    max_request_bytes: int = ServerArgs.model_fields["max_request_bytes"].default
    max_stop_strings: int = ServerArgs.model_fields["max_stop_strings"].default
    max_stop_string_chars: int = ServerArgs.model_fields["max_stop_string_chars"].default
    request_timeout_s: float = ServerArgs.model_fields["request_timeout_s"].default
    admission_timeout_s: float = ServerArgs.model_fields["admission_timeout_s"].default
    allow_priority: bool = ServerArgs.model_fields["allow_priority"].default
    health_timeout_s: float = ServerArgs.model_fields["health_timeout_s"].default
    max_choices: int = ServerArgs.model_fields["max_choices"].default


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within {seconds:g} s (server.request_timeout_s)",
                    None, "request_timeout", "timeout_error")


async def wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns once the ASGI connection reports ``http.disconnect``."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(len(body), limit)
    return bytes(body)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size}+ bytes exceeds the limit of {limit} bytes "
                    "(server.max_request_bytes)", None, "request_too_large")
