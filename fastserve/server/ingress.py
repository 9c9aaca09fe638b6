"""The OpenAI-compatible server's generation logic: a prepared request's jobs on an ``Engine`` replica
(through a ``Backend``), detokenization with stop strings, the body or the SSE stream, each failure as
an OpenAI error, and how each request ended (``request_success``). No ray, no FastAPI: the app is
``fastserve.server.http_api``'s, the deployment ``fastserve.server.ingress_deployment``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

from fastserve.detokenizer import IncrementalDecoder
from fastserve.engine.delivery import DeliveryDelay, JobStream
from fastserve.engine.metrics import IngressMetrics
from fastserve.scheduler.job import Finish, JobRequest, TokenDelta
from fastserve.server.choices import LogprobFormatter, merge_logprobs, merged
from fastserve.server.ingress_requests import Prepared, RequestPreparer, ServerContext
from fastserve.server.protocol import APIError, CompletionRequest, error_body
from fastserve.server.protocol_output import (
    StopStringMatcher,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    now_s,
    usage,
)
from fastserve.server.request_limits import timed_out
from fastserve.server.tool_parsers import ToolCallParser
from fastserve.server.tool_parsers import parse as parse_tool_calls
from fastserve.server.tools import ToolPlan

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
#: Finish reasons that mean the server, not the model, ended the job.
SERVER_ENDED = {"abort": (503, "the server stopped the request (shutting down?)"),
                "error": (500, "generation failed inside the engine")}

class Backend(Protocol):
    def generate(self, req: JobRequest) -> JobStream: ...

    async def metrics_text(self) -> str: ...

    async def engine_stats(self) -> dict[str, Any]: ...

    async def health(self) -> dict[str, Any]: ...

    async def reset_prefix_cache(self) -> dict[str, Any]: ...


def job_stats(delta: TokenDelta) -> dict[str, Any]:
    """A finishing delta's ``job_stats`` as the response carries them ({} without stats)."""
    stats = None if delta.finish is None else delta.finish.stats
    return {} if stats is None else stats.as_dict()


def tool_fields(plan: ToolPlan, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A whole choice's ``message`` (content, and the calls read from it) and finish reason:
    ``tool_calls`` when the model ended by itself after calling (a call cut by ``length``
    keeps that reason: its arguments are incomplete)."""
    parser = plan.parser()
    assert parser is not None
    content, calls = parse_tool_calls(parser, text)
    if not calls:
        return {"message": {"role": "assistant", "content": content}}
    return {"message": {"role": "assistant", "content": content or None, "tool_calls": [c.wire() for c in calls]},
            "finish_reason": "tool_calls" if finish_reason == "stop" else finish_reason}


def chat_delta(parser: ToolCallParser | None, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A stream event's ``delta`` and finish reason; with a tool parser, the content and call
    deltas it releases (all it held, on the last event)."""
    if parser is None:
        return ({"content": text} if text or reason is None else {}), reason
    out = parser.push(text)
    if reason is not None:
        tail = parser.finish()
        out.content += tail.content
        out.calls += tail.calls
        if parser.called and reason == "stop":
            reason = "tool_calls"
    delta: dict[str, Any] = {}
    if out.content:
        delta["content"] = out.content
    if out.calls:
        delta["tool_calls"] = [c.wire() for c in out.calls]
    return delta, reason


def cached_tokens(delta: TokenDelta) -> int:
    """Prompt tokens the prefix cache served the job (0 without stats)."""
    stats = None if delta.finish is None else delta.finish.stats
    return 0 if stats is None else stats.cached_tokens


class OpenAIServer:
    """A prepared request's jobs started on the backend and their outputs answered: the
    non-streaming body (``complete``) or the SSE stream (``sse``). Its ``preparer`` makes a
    request body into those jobs (auth, parsing, validation) or refuses it."""

    def __init__(self, ctx: ServerContext, backend: Backend, metrics: IngressMetrics | None = None) -> None:
        self.ctx = ctx
        self.preparer = RequestPreparer(ctx)
        self.backend = backend
        self.metrics = metrics

    # ---- generation ------------------------------------------------------------------------

    async def start_all(self, prep: Prepared) -> list[JobStream]:
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

    async def start(self, prep: Prepared, job: JobRequest | None = None) -> JobStream:
        """Hand the job to an engine replica; raise 429/400 if it refuses."""
        stream = self.backend.generate(prep.job if job is None else job)
        try:
            refused = await stream.start()
        except BaseException:
            stream.cancel()
            raise
        if refused is not None:
            raise self.preparer.refusal(refused.code, refused.message, "messages" if prep.chat else "prompt")
        await self._first_output(stream)
        return stream

    async def _first_output(self, stream: JobStream) -> None:
        """Wait (at most ``admission_timeout_s``) for the job's first output before answering, so
        a job stuck behind a backlog is refused with a 429 instead of holding its client. (A
        stream that ends without output is left to its reader, who reports it broken.)"""
        wait = self.ctx.limits.admission_timeout_s
        try:
            await asyncio.wait_for(stream.peek(), wait)
        except TimeoutError:
            stream.cancel()   # the scheduler aborts the queued job
            raise APIError(429, f"server busy: no capacity for this request within {wait:g} s "
                           "(server.admission_timeout_s); retry later", None, "admission_timeout",
                           "rate_limit_error", {"Retry-After": str(self.ctx.retry_after_s)}) from None
        except BaseException:
            stream.cancel()
            raise

    async def events(self, stream: JobStream, prep: Prepared) -> AsyncIterator[tuple[TokenDelta, str]]:
        """The stream's events with their text (stop strings applied); the last has the finish.

        One event per read: an event carries every token since the previous one, so a lagging
        reader catches up in one event instead of one per token. A stop string ends the stream
        with a ``stop`` event of the tokens read so far. The finishing event's stats gain
        ``delivery_s``: the mean delay from the scheduler emitting an event to this replica
        reading it.
        """
        decoder = IncrementalDecoder(self.ctx.tokenizer, prep.prompt_ids, prep.req.skip_special_tokens)
        include_stop = prep.req.include_stop_str_in_output
        matcher = StopStringMatcher(prep.req.stop_strings(), include_stop)
        min_tokens = prep.req.min_tokens
        count = 0
        done = False
        outcome = "abort"   # unless it finishes: the client went away, or the stream broke (error)
        delay = DeliveryDelay()
        try:
            async for delta in stream:
                delay.observe(delta.emitted_at)
                text, ids = [], []
                # A stop token counts as generated but is no text, unless include_stop_str_in_output.
                last_silent = delta.finish_reason == "stop" and not include_stop
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
                        yield replace(delta, token_ids=tuple(ids), finish=Finish("stop"),
                                      logprobs=delta.logprobs[:len(ids)]), "".join(text)
                        return
                if delta.finish is None:
                    yield delta, "".join(text)
                    continue
                done = True
                reason = outcome = delta.finish.reason
                if reason in SERVER_ENDED:
                    status, message = SERVER_ENDED[reason]
                    raise APIError(status, message, None, reason, "internal_error")
                text.append(matcher.push(decoder.flush()))
                stats = delta.finish.stats
                if stats is not None and (mean_delay := delay.mean()) is not None:
                    stats = replace(stats, delivery_s=mean_delay)   # a copy: in process it is the scheduler's
                yield replace(delta, finish=Finish(reason, stats)), "".join(text) + matcher.flush()
                return
            outcome = "error"
            raise APIError(500, "the job's stream ended without a finish", None, "internal_error",
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

    async def complete(self, prep: Prepared, streams: JobStream | list[JobStream]) -> dict[str, Any]:
        """The non-streaming response: every choice read to its end, usage summed over choices
        (the prompt counted once, as vLLM)."""
        streams = streams if isinstance(streams, list) else [streams]
        results = await asyncio.gather(*(self._choice(prep, s, i) for i, s in enumerate(streams)))
        build = chat_response if prep.chat else completion_response
        first_extra: dict[str, Any] = {}
        if prep.req.return_token_ids:
            first_extra["prompt_token_ids"] = list(prep.prompt_ids)
        text, ids, last, choice_extra = results[0]
        if prep.chat and "prompt_logprobs" in choice_extra:   # vLLM's chat: once, beside the choices
            first_extra["prompt_logprobs"] = choice_extra["prompt_logprobs"]
            for result in results:
                del result[3]["prompt_logprobs"]
        body = build(prep.request_id, self.ctx.model_name, text, last.finish_reason,
                     usage(len(prep.prompt_ids), sum(len(r[1]) for r in results),
                           cached_tokens(last)),
                     {"job_stats": job_stats(last), "choice": choice_extra, **first_extra})
        template = body["choices"][0]
        for index, (text, _, last, extra) in enumerate(results[1:], start=1):
            choice = dict(template, index=index, finish_reason=last.finish_reason)
            if prep.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(extra)
            body["choices"].append(choice)
        return body

    async def _choice(self, prep: Prepared, stream: JobStream,
                      index: int) -> tuple[str, list[int], TokenDelta, dict[str, Any]]:
        """One choice read to its end: its text, token ids, finishing event, and the choice's
        extra fields (logprobs, token ids, prompt logprobs)."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[dict[str, Any]] = []
        fmt = LogprobFormatter(self.ctx.tokenizer, prep.chat, prep.req.return_tokens_as_token_ids)
        want = prep.req.logprob_count() is not None
        last = TokenDelta(prep.request_id)
        extra: dict[str, Any] = {}
        first = True
        async for delta, delta_text in self.events(stream, prep):
            if first:   # the echoed prompt goes first; the prompt's logprobs come with this event
                first = False
                head, head_logprobs = self._echo(prep, fmt, delta)
                text.append(head)
                logprobs += head_logprobs
                if delta.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = fmt.prompt_logprobs(prep.prompt_ids, delta.prompt_logprobs)
            ids += delta.token_ids
            if not self._echo_only(prep):
                text.append(delta_text)
                if want:
                    logprobs.append(fmt.format(delta.token_ids, delta.logprobs))
            last = delta
        if want:
            extra["logprobs"] = merge_logprobs(logprobs, prep.chat)
        if prep.req.return_token_ids:
            extra["token_ids"] = ids
        if prep.tools is not None:
            extra.update(tool_fields(prep.tools, "".join(text), last.finish_reason))
        return "".join(text), ids, last, extra

    @staticmethod
    def _echo_only(prep: Prepared) -> bool:
        return isinstance(prep.req, CompletionRequest) and prep.req.echo_only

    @staticmethod
    def _echo(prep: Prepared, fmt: LogprobFormatter | None, first: TokenDelta) -> tuple[str, list[dict[str, Any]]]:
        """What a completion with ``echo`` sends before its own text: the prompt, and (with
        ``logprobs``) the prompt's tokens and logprobs from its first event; nothing otherwise."""
        if not isinstance(prep.req, CompletionRequest) or not prep.req.echo:
            return "", []
        if prep.req.logprob_count() is None:
            return prep.prompt_text, []
        if fmt is None or first.prompt_logprobs is None:
            raise APIError(500, "the job's first event came without the prompt's logprobs", None,
                           "internal_error", "internal_error")
        return prep.prompt_text, [fmt.format_prompt(prep.prompt_ids, first.prompt_logprobs)]

    async def sse(self, prep: Prepared, streams: JobStream | list[JobStream]) -> AsyncIterator[bytes]:
        streams = streams if isinstance(streams, list) else [streams]
        created, model, rid = now_s(), self.ctx.model_name, prep.request_id
        want_usage, want_ids = prep.req.include_usage, prep.req.return_token_ids
        base: dict[str, Any] = {"usage": None} if want_usage else {}
        fmts = [LogprobFormatter(self.ctx.tokenizer, prep.chat, prep.req.return_tokens_as_token_ids) for _ in streams] \
            if prep.req.logprob_count() is not None else None

        parsers = [prep.tools.parser() for _ in streams] if prep.tools is not None else None
        echo_only = self._echo_only(prep)
        echoed = [False] * len(streams)

        def chunk(index: int, text: str, reason: str | None, delta_: TokenDelta, extra: dict[str, Any]) -> bytes | None:
            """The event for a delta; None when it has nothing to say (text a tool parser holds)."""
            more = {**base, **extra}
            ids = list(delta_.token_ids)
            choice: dict[str, Any] = {"index": index}
            if want_ids:
                choice["token_ids"] = ids
            fmt = fmts[index] if fmts is not None else None
            parts: list[dict[str, Any]] = []
            if not echoed[index]:   # the choice's first chunk: the echoed prompt goes first
                echoed[index] = True
                head, parts = self._echo(prep, fmt, delta_)
                text = head + ("" if echo_only else text)
            elif echo_only:
                text = ""
            if fmt is not None:
                if not echo_only:
                    parts.append(fmt.format(ids, delta_.logprobs))
                choice["logprobs"] = merge_logprobs(parts, prep.chat) if parts else None
            more["choice"] = choice
            if prep.chat:
                delta, reason = chat_delta(parsers[index] if parsers else None, text, reason)
                if not delta and reason is None and not want_ids and not (fmts is not None and ids):
                    return None
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
                    event = None
                    if delta.finish_reason is not None:
                        if index == 0:
                            cached = cached_tokens(delta)
                        event = chunk(index, text, delta.finish_reason, delta, {"job_stats": job_stats(delta)})
                    elif text or want_ids or (fmts is not None and delta.token_ids):
                        event = chunk(index, text, None, delta, {})
                    if event is not None:
                        yield event
        except TimeoutError:   # ``events`` cancelled the stream on its way out: the job is aborted
            yield b"data: " + json.dumps(timed_out(self.ctx.limits.request_timeout_s).body()).encode() + b"\n\n"
            yield SSE_DONE
            return
        except APIError as exc:   # the 200 is already sent: the error travels as an event
            yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
            yield SSE_DONE
            return
        except Exception as exc:   # e.g. the engine replica died mid-stream
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

    async def complete_unless_gone(self, prep: Prepared, stream: list[JobStream],
                                   disconnected: Callable[[], Awaitable[Any]] | None) -> dict[str, Any]:
        """The non-streaming body, bounded by ``request_timeout_s``; a client that goes away
        (``disconnected()`` completes) aborts its jobs: both are ours to enforce, whatever
        headers the client sent the proxy."""
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
