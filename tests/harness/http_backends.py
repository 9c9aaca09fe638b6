"""Scripted engine backends for the HTTP layer's tests (no Ray, no model).

``FakeBackend`` answers every request with fixed tokens (or refuses it); ``ScriptedBackend``
answers each job with what a script makes of its request; both hand out ``JobStream``s over
``FakeStream``s (a job's own stream, scripted), which record whether the ingress cancelled them.
``post`` sends one request to an ``OpenAIServer`` over a backend, ``sse_events`` reads a stream's
events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from fastserve.engine.delivery import Accepted, JobEvent, JobStream, Refused
from fastserve.errors import ErrorCode
from fastserve.scheduler.job import Finish, JobRequest, JobStats, TokenDelta
from fastserve.server.http_api import make_api
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.tokenizer import Tokenizer

MODEL = "opt-125m"
VOCAB = 50272
CONTEXT = 2048
TOK = Tokenizer.default()
TEXT_IDS = TOK.encode(" Hello world. STOP here", add_special_tokens=False)
#: The stats a ``ScriptedBackend`` script attaches to a finish.
STATS = JobStats("j", arrival=0.0, prompt_len=2)
#: The stats ``FakeBackend`` attaches to every finish.
FAKE_STATS = JobStats("j", arrival=0.0, prompt_len=2, queueing_s=0.5, execution_s=1.0, demotions=2)


class FakeStream:
    """A job's own stream of scripted events; it yields to the loop before each item, as a real
    stream does, and ends once cancelled."""

    def __init__(self, items: list[JobEvent]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[JobEvent]:
        return self

    async def __anext__(self) -> JobEvent:
        await asyncio.sleep(0)
        if self.cancelled or not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True

    def read(self, job_id: str = "j") -> JobStream:
        """The stream the ingress reads over this one."""
        return JobStream(job_id, self)


class FakeBackend:
    """Answers every request with ``tokens`` then ``reason``, or refuses with ``first``."""

    def __init__(self, tokens: list[int], reason: str = "length", first: str = "accepted",
                 per_item: int = 1) -> None:
        self.tokens, self.reason, self.first, self.per_item = tokens, reason, first, per_item
        self.healthy = True
        self.requests: list[JobRequest] = []
        self.streams: list[FakeStream] = []

    def generate(self, req: JobRequest) -> JobStream:
        self.requests.append(req)
        if self.first != "accepted":
            code = {"rejected": ErrorCode.ADMISSION_QUEUE_FULL, "unavailable": ErrorCode.ENGINE_UNAVAILABLE}[self.first]
            stream = FakeStream([Refused("j", code, "2 jobs already wait for admission")])
        else:
            k = self.per_item
            items: list[JobEvent] = [
                Accepted("j"), *(TokenDelta("j", tuple(self.tokens[i:i + k])) for i in range(0, len(self.tokens), k)),
                TokenDelta("j", finish=Finish(self.reason, FAKE_STATS))]   # type: ignore[arg-type]
            stream = FakeStream(items)
        self.streams.append(stream)
        return stream.read()

    async def metrics_text(self) -> str:
        return "fastserve:num_requests_running 0.0\n"

    async def engine_stats(self) -> dict[str, Any]:
        return {"steps": 0}

    async def health(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "problem": None if self.healthy else "stuck"}


class ScriptedBackend:
    """Each job's stream from ``script(request)``: its deltas after the accepted event."""

    def __init__(self, script: Callable[[JobRequest], list[TokenDelta]]) -> None:
        self.script = script
        self.requests: list[JobRequest] = []
        self.resets = 0

    def generate(self, req: JobRequest) -> JobStream:
        self.requests.append(req)
        return FakeStream([Accepted(req.job_id), *self.script(req)]).read(req.job_id)

    async def metrics_text(self) -> str:
        return ""

    async def engine_stats(self) -> dict[str, Any]:
        return {}

    async def health(self) -> dict[str, Any]:
        return {"healthy": True}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        self.resets += 1
        return {"reset_blocks": 0}


def post(backend: ScriptedBackend, path: str, body: Any, **context: Any) -> Any:
    """POST ``body`` to an ``OpenAIServer`` over ``backend``; the httpx response. ``context``:
    ``ServerContext`` fields beyond the model's."""
    async def run() -> httpx.Response:
        ctx = ServerContext(MODEL, TOK, VOCAB, CONTEXT, **context)
        app = make_api(OpenAIServer(ctx, backend))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, content=json.dumps(body).encode())
    return asyncio.run(run())


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
