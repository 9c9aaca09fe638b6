"""Why a request is refused: ``ErrorCode`` (HTTP status and OpenAI error type, so the HTTP layer never
matches wording), the ``RequestError`` classes, and ``validate_request``, the one place a request's
own validity is decided. Stdlib only: the scheduler and the simulator import it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from fastserve.worker.messages import SamplingParams


class ErrorCode(enum.Enum):
    """A refusal's kind: ``(HTTP status, OpenAI error type, OpenAI error code, retry later)``."""

    INVALID_REQUEST = (400, "invalid_request_error", None, False)
    CONTEXT_LENGTH_EXCEEDED = (400, "invalid_request_error", "context_length_exceeded", False)
    ADMISSION_QUEUE_FULL = (429, "rate_limit_error", "admission_queue_full", True)
    ENGINE_UNAVAILABLE = (503, "service_unavailable", "engine_unavailable", True)

    def __init__(self, status: int, error_type: str, wire_code: str | None, retry: bool) -> None:
        self.status = status
        self.error_type = error_type
        self.wire_code = wire_code
        self.retry = retry   # the answer carries ``Retry-After``


class RequestError(Exception):

    code: ErrorCode = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidRequest(RequestError, ValueError):
    """The request can never be served (a bad value, or too long for the model or the KV pool)."""


class AdmissionQueueFull(RequestError, RuntimeError):

    code = ErrorCode.ADMISSION_QUEUE_FULL


class EngineUnavailable(RequestError, RuntimeError):

    code = ErrorCode.ENGINE_UNAVAILABLE


def validate_request(prompt_ids: Sequence[int], sampling: SamplingParams, vocab_size: int,
                     max_context: int) -> None:
    """``InvalidRequest`` naming the value; prompt + max_tokens must fit the context window."""
    if not prompt_ids:
        raise InvalidRequest("prompt is empty: at least one token id is required")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    try:
        sampling.validate()
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if len(prompt_ids) + sampling.max_tokens > max_context:
        raise InvalidRequest(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {sampling.max_tokens} exceeds the "
            f"model's context of {max_context} tokens", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
