"""The OpenAI-compatible server's request logic (the HTTP app is ``app.http_api``).

Owns the request path in front of the schedulers: authentication, parsing and validation
(``app.protocol``), tokenization and chat templating (``app.tokenizer``), the call to a
``Scheduler`` replica through a streaming ``DeploymentHandle``, detokenization with stop strings,
SSE streaming, turning every failure into an OpenAI error body with the right status, and
recording how each request ended for its client (``request_success{finished_reason}``).

``OpenAIServer`` holds the logic and talks to a ``Backend`` (the Serve handles in production,
``app.ingress_deployment.ServeBackend``; a fake in unit tests); ``app.http_api.make_api`` builds
the FastAPI app over it; ``app.ingress_deployment.Ingress`` is the Serve deployment class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.messages import SamplingParams
from app.chat_template import ChatTemplateError
from app.choices import LogprobFormatter, choice_job_id, choice_sampling, merge_logprobs, merged
from app.config import AppArgs
from app.delivery import DeltaStream
from app.errors import ErrorCode, RequestError, validate_request
from app.ingress_streams import DeliveryDelay, Replayed
from app.metrics import IngressMetrics
from app.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StopStringMatcher,
    bad_request,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    now_s,
    parse_request,
    usage,
)
from app.request_limits import RequestLimits, timed_out
from app.scheduler.job import JobRequest, TokenDelta
from app.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
#: Finish reasons that mean the server, not the model, ended the job.
SERVER_ENDED = {"abort": (503, "the server stopped the request (shutting down?)"),
                "error": (500, "generation failed inside the engine")}
#: How a refusal's message reads to the client, by its code (default: the message as is).
REFUSAL_MESSAGES = {ErrorCode.ADMISSION_QUEUE_FULL: "server busy: {}; retry later",
                    ErrorCode.ENGINE_UNAVAILABLE: "the model is unavailable: {}; retry later"}


#: A scheduler stream: an async iterator of ``TokenDelta``s that can be cancelled (a job's own
#: Serve stream, or ``app.delivery.JobStream`` reading it and its channel).
Stream = DeltaStream


class Backend(Protocol):
    def generate(self, req: JobRequest) -> Stream: ...

    async def metrics_text(self) -> str: ...

    async def engine_stats(self) -> dict[str, Any]: ...

    async def health(self) -> dict[str, Any]: ...

    async def reset_prefix_cache(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ServerContext:
    """What the HTTP layer knows about the served model."""

    model_name: str
    tokenizer: Tokenizer
    vocab_size: int
    context_len: int
    api_key: str | None = None
    retry_after_s: int = 1
    limits: RequestLimits = field(default_factory=lambda: RequestLimits())
    allow_reset_prefix_cache: bool = False
    created: int = field(default_factory=now_s)

    @classmethod
    def from_args(cls, args: AppArgs) -> ServerContext:
        tokenizer = args.model.tokenizer()
        srv = args.server
        limits = RequestLimits(srv.max_request_bytes, srv.max_stop_strings, srv.max_stop_string_chars,
                               srv.request_timeout_s, srv.admission_timeout_s, srv.allow_priority,
                               srv.health_timeout_s, srv.max_choices)
        return cls(args.model.name, tokenizer, args.model.hf_config().vocab_size,
                   args.model.context_len(), srv.resolved_api_key(), srv.retry_after_s, limits,
                   allow_reset_prefix_cache=srv.allow_reset_prefix_cache)


@dataclass
class Prepared:
    """A parsed HTTP request (what the response needs) and the ``JobRequest`` it asks for: one
    per choice (``n``), ``job`` being the first."""

    req: CompletionRequest | ChatCompletionRequest
    job: JobRequest
    chat: bool
    jobs: tuple[JobRequest, ...] = ()
    rid: str = ""

    @property
    def request_id(self) -> str:
        return self.rid or self.job.job_id

    @property
    def choices(self) -> tuple[JobRequest, ...]:
        return self.jobs or (self.job,)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.job.prompt_ids


def job_stats(delta: TokenDelta) -> dict[str, Any]:
    """A finishing event's ``job_stats`` as the response carries them ({} without stats)."""
    return {} if delta.stats is None else delta.stats.as_dict()


def cached_tokens(delta: TokenDelta) -> int:
    """Prompt tokens the prefix cache served the job (0 without stats)."""
    return 0 if delta.stats is None else delta.stats.cached_tokens


class OpenAIServer:
    def __init__(self, ctx: ServerContext, backend: Backend, metrics: IngressMetrics | None = None) -> None:
        self.ctx = ctx
        self.backend = backend
        self.metrics = metrics

    # ---- request preparation ---------------------------------------------------------------

    def check_auth(self, authorization: str | None) -> None:
        if self.ctx.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.ctx.api_key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           None, "invalid_api_key")

    def prepare_completion(self, raw: bytes) -> Prepared:
        req: CompletionRequest = parse_request(CompletionRequest, raw)
        self._check_request(req)
        ids = self.ctx.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        sampling = req.to_sampling(DEFAULT_COMPLETION_MAX_TOKENS)
        return self._prepared(req, f"cmpl-{uuid.uuid4().hex}", ids, sampling, False)

    def prepare_chat(self, raw: bytes) -> Prepared:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
        self._check_request(req)
        try:   # the model's own template (its specials written by it), or the OPT fallback
            ids = self.ctx.tokenizer.encode_chat([m.as_template_message() for m in req.messages])
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        room = self.ctx.context_len - len(ids)
        if room < 1:
            raise bad_request(
                f"messages of {len(ids)} tokens leave no room to generate within the model's "
                f"context of {self.ctx.context_len} tokens", "messages", "context_length_exceeded")
        sampling = req.to_sampling(room)
        return self._prepared(req, f"chatcmpl-{uuid.uuid4().hex}", ids, sampling, True)

    def _check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        limits = self.ctx.limits
        req.check_limits(limits.max_stop_strings, limits.max_stop_string_chars, limits.max_choices)
        if not limits.allow_priority:
            req.priority = 0   # any caller could jump the queue (server.allow_priority is off)

    def _check_model(self, model: str) -> None:
        if model != self.ctx.model_name:
            raise bad_request(f"the model '{model}' does not exist; this server serves "
                              f"'{self.ctx.model_name}'", "model", "model_not_found")

    def _prepared(self, req: CompletionRequest | ChatCompletionRequest, request_id: str, ids: list[int],
                  sampling: SamplingParams, chat: bool) -> Prepared:
        """The request's one validation (``validate_request``), then its ``JobRequest``."""
        try:
            validate_request(ids, sampling, self.ctx.vocab_size, self.ctx.context_len)
        except RequestError as exc:
            raise self.refusal(exc.code, str(exc), "messages" if chat else "prompt") from None
        bad = [t for t in sampling.stop_token_ids if not 0 <= t < self.ctx.vocab_size]
        if bad:
            raise bad_request(f"stop token id {bad[0]} is outside the vocabulary [0, {self.ctx.vocab_size})",
                              "stop_token_ids")
        n = req.num_choices
        jobs = tuple(JobRequest(choice_job_id(request_id, i, n), tuple(ids), choice_sampling(sampling, i),
                                priority=req.priority) for i in range(n))
        return Prepared(req, jobs[0], chat, jobs, request_id)

    def refusal(self, code: ErrorCode, message: str, param: str | None) -> APIError:
        """The HTTP answer to a refused request: status, type and code come from ``code``."""
        template = REFUSAL_MESSAGES.get(code, "{}")
        headers = {"Retry-After": str(self.ctx.retry_after_s)} if code.retry else None
        return APIError(code.status, template.format(message), param if code.status == 400 else None,
                        code.wire_code, code.error_type, headers)

    # ---- generation ------------------------------------------------------------------------

    async def start_all(self, prep: Prepared) -> list[Stream]:
        """Every choice's job handed to a scheduler; if one is refused, the others are cancelled."""
        if len(prep.choices) == 1:
            return [await self.start(prep)]
        started = await asyncio.gather(*(self.start(prep, job) for job in prep.choices),
                                       return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for r in started:
                if not isinstance(r, BaseException):
                    r.cancel()
            raise failed[0]
        return [r for r in started if not isinstance(r, BaseException)]

    async def start(self, prep: Prepared, job: JobRequest | None = None) -> Stream:
        """Hand the job to a scheduler; raise 429/400 if it refuses."""
        stream = self.backend.generate(prep.job if job is None else job)
        try:
            first = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        if first.error is not None:
            raise self.refusal(first.error, first.message, "messages" if prep.chat else "prompt")
        return await self._first_output(stream)

    async def _first_output(self, stream: Stream) -> Stream:
        """Wait (at most ``admission_timeout_s``) for the job's first output before answering, so
        a job stuck behind a backlog is refused with a 429 instead of holding its client."""
        wait = self.ctx.limits.admission_timeout_s
        try:
            first = await asyncio.wait_for(stream.__anext__(), wait)
        except TimeoutError:
            stream.cancel()   # the scheduler aborts the queued job
            raise APIError(429, f"server busy: no capacity for this request within {wait:g} s "
                           "(server.admission_timeout_s); retry later", None, "admission_timeout",
                           "rate_limit_error", {"Retry-After": str(self.ctx.retry_after_s)}) from None
        except StopAsyncIteration:
            return stream   # ended without output: reading it on reports the broken stream
        except BaseException:
            stream.cancel()
            raise
        return Replayed(first, stream)

    async def events(self, stream: Stream, prep: Prepared) -> AsyncIterator[tuple[TokenDelta, str]]:
        """The stream's events with their text (stop strings applied); the last has the finish.

        One event per read: an event carries every token since the previous one, so a lagging
        reader catches up in one event instead of one per token. A stop string ends the stream
        with a ``stop`` event of the tokens read so far. The finishing event's stats gain
        ``delivery_s``: the mean delay from the scheduler emitting an event to this replica
        reading it.
        """
        decoder = IncrementalDecoder(self.ctx.tokenizer, prep.prompt_ids, prep.req.skip_special_tokens)
        matcher = StopStringMatcher(prep.req.stop_strings())
        min_tokens = prep.req.min_tokens
        count = 0
        done = False
        outcome = "abort"   # unless it finishes: the client went away, or the stream broke (error)
        delay = DeliveryDelay()
        try:
            async for delta in stream:
                if not delta.token_ids and not delta.finished:
                    continue   # the accepted event
                delay.observe(delta.emitted_at)
                text, ids = [], []
                # A job the scheduler stopped on EOS or a stop token id: that token counts as
                # generated but is not text (vLLM).
                last_silent = delta.finish_reason == "stop"
                for k, token_id in enumerate(delta.token_ids):
                    ids.append(token_id)
                    count += 1
                    if last_silent and k == len(delta.token_ids) - 1:
                        break
                    # vLLM checks stop strings only once min_tokens tokens were generated.
                    text.append(matcher.push(decoder.step(token_id), check=count > min_tokens))
                    if matcher.stopped:
                        done, outcome = True, "stop"
                        stream.cancel()   # the scheduler aborts the job and frees its blocks
                        yield TokenDelta(delta.job_id, tuple(ids), "stop",
                                         logprobs=delta.logprobs[:len(ids)]), "".join(text)
                        return
                if not delta.finished:
                    yield delta, "".join(text)
                    continue
                done = True
                reason = outcome = delta.finish_reason or "stop"
                if reason in SERVER_ENDED:
                    status, message = SERVER_ENDED[reason]
                    raise APIError(status, message, None, reason, "internal_error")
                text.append(matcher.push(decoder.flush()))
                stats = delta.stats
                if stats is not None and (mean_delay := delay.mean()) is not None:
                    stats = replace(stats, delivery_s=mean_delay)   # a copy: in process it is the scheduler's
                yield replace(delta, finish_reason=reason, stats=stats), "".join(text) + matcher.flush()
                return
            outcome = "error"
            raise APIError(500, "the scheduler stream ended without a finish", None, "internal_error",
                           "internal_error")
        except Exception:
            if not done:
                outcome = "error"
            raise
        finally:
            if not done:
                stream.cancel()
            if self.metrics is not None:
                self.metrics.request_finished(outcome)

    async def complete(self, prep: Prepared, streams: Stream | list[Stream]) -> dict[str, Any]:
        """The non-streaming response: every choice read to its end, usage summed over choices
        (the prompt counted once, as vLLM)."""
        streams = streams if isinstance(streams, list) else [streams]
        results = await asyncio.gather(*(self._choice(prep, s, i) for i, s in enumerate(streams)))
        build = chat_response if prep.chat else completion_response
        first_extra: dict[str, Any] = {}
        if prep.req.return_token_ids:
            first_extra["prompt_token_ids"] = list(prep.prompt_ids)
        text, ids, last, choice_extra = results[0]
        body = build(prep.request_id, self.ctx.model_name, text, last.finish_reason,
                     usage(len(prep.prompt_ids), sum(len(r[1]) for r in results),
                           cached_tokens(last)),
                     {"job_stats": job_stats(last), "choice": choice_extra, **first_extra})
        template = body["choices"][0]
        for index, (text, _, last, extra) in enumerate(results[1:], start=1):
            choice = dict(template, index=index, finish_reason=last.finish_reason, **extra)
            if prep.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            body["choices"].append(choice)
        return body

    async def _choice(self, prep: Prepared, stream: Stream,
                      index: int) -> tuple[str, list[int], TokenDelta, dict[str, Any]]:
        """One choice read to its end: its text, token ids, finishing event, and the choice's
        extra fields (logprobs, token ids)."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[dict[str, Any]] = []
        fmt = LogprobFormatter(self.ctx.tokenizer, prep.chat) if prep.req.logprob_count() is not None else None
        last = TokenDelta(prep.request_id)
        async for delta, delta_text in self.events(stream, prep):
            text.append(delta_text)
            ids += delta.token_ids
            if fmt is not None:
                logprobs.append(fmt.format(delta.token_ids, delta.logprobs))
            last = delta
        extra: dict[str, Any] = {}
        if fmt is not None:
            extra["logprobs"] = merge_logprobs(logprobs, prep.chat)
        if prep.req.return_token_ids:
            extra["token_ids"] = ids
        return "".join(text), ids, last, extra

    async def sse(self, prep: Prepared, streams: Stream | list[Stream]) -> AsyncIterator[bytes]:
        streams = streams if isinstance(streams, list) else [streams]
        created, model, rid = now_s(), self.ctx.model_name, prep.request_id
        want_usage, want_ids = prep.req.include_usage, prep.req.return_token_ids
        base: dict[str, Any] = {"usage": None} if want_usage else {}
        fmts = [LogprobFormatter(self.ctx.tokenizer, prep.chat) for _ in streams] \
            if prep.req.logprob_count() is not None else None

        def chunk(index: int, text: str, reason: str | None, delta_: TokenDelta, extra: dict[str, Any]) -> bytes:
            more = {**base, **extra}
            ids = list(delta_.token_ids)
            choice: dict[str, Any] = {"index": index}
            if want_ids:
                choice["token_ids"] = ids
            if fmts is not None:
                choice["logprobs"] = fmts[index].format(ids, delta_.logprobs)
            more["choice"] = choice
            if prep.chat:
                delta = {"content": text} if text or reason is None else {}
                body = chat_chunk(rid, model, created, delta, reason, more)
            else:
                body = completion_chunk(rid, model, created, text, reason, more)
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        if prep.chat:
            for index in range(len(streams)):
                first = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                   {**base, "choice": {"index": index}})
                yield b"data: " + json.dumps(first).encode() + b"\n\n"
        n = cached = 0
        try:
            async with asyncio.timeout(self.ctx.limits.request_timeout_s):
                async for index, (delta, text) in merged([self.events(s, prep) for s in streams]):
                    n += len(delta.token_ids)
                    if delta.finish_reason is not None:
                        if index == 0:
                            cached = cached_tokens(delta)
                        yield chunk(index, text, delta.finish_reason, delta, {"job_stats": job_stats(delta)})
                    elif text or want_ids or (fmts is not None and delta.token_ids):
                        yield chunk(index, text, None, delta, {})
        except TimeoutError:   # ``events`` cancelled the stream on its way out: the job is aborted
            yield b"data: " + json.dumps(timed_out(self.ctx.limits.request_timeout_s).body()).encode() + b"\n\n"
            yield SSE_DONE
            return
        except APIError as exc:   # the 200 is already sent: the error travels as an event
            yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
            yield SSE_DONE
            return
        except Exception as exc:   # e.g. the scheduler replica died mid-stream
            log.exception("stream %s failed", rid)
            body = error_body(f"internal error: {type(exc).__name__}", "internal_error", None, "internal_error")
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
            yield SSE_DONE
            return
        if want_usage:
            u = {"usage": usage(len(prep.prompt_ids), n, cached)}
            tail = chat_chunk(rid, model, created, None, None, u) if prep.chat else \
                completion_chunk(rid, model, created, None, None, u)
            yield b"data: " + json.dumps(tail).encode() + b"\n\n"
        yield SSE_DONE

    async def handle(self, raw: bytes, chat: bool,
                     disconnected: Callable[[], Awaitable[Any]] | None = None) -> Response:
        """Serve one request. Tokenization runs off the event loop (a large prompt must not stall
        every other stream of this replica). Generation is bounded by ``request_timeout_s``, and a
        non-streaming request whose client goes away (``disconnected()`` completes) is aborted:
        both are ours to enforce, whatever headers the client sent the proxy."""
        prepare = self.prepare_chat if chat else self.prepare_completion
        prep = await asyncio.to_thread(prepare, raw)
        stream = await self.start_all(prep)
        if prep.req.stream:
            return StreamingResponse(self.sse(prep, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self._complete_unless_gone(prep, stream, disconnected))

    async def _complete_unless_gone(self, prep: Prepared, stream: list[Stream],
                                    disconnected: Callable[[], Awaitable[Any]] | None) -> dict[str, Any]:
        work = asyncio.ensure_future(self.complete(prep, stream))
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            done, _ = await asyncio.wait({work} | ({gone} if gone else set()),
                                         timeout=self.ctx.limits.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            if gone is not None and gone in done:
                raise APIError(499, "the client closed the connection", None, "client_closed_request")
            raise timed_out(self.ctx.limits.request_timeout_s)
        finally:
            for task in (work, gone):
                if task is not None and not task.done():
                    task.cancel()   # cancelling ``complete`` cancels the stream: the job is aborted
