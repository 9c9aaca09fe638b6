"""HTTP load client: replays a workload against any OpenAI-compatible server, streaming.

Each ``fastserve.bench.workloads.Request`` is sent at its arrival time: ``completions`` mode posts a
prompt of exactly ``prompt_len`` tokens with ``max_tokens`` and ``ignore_eos`` (fixed lengths make runs
comparable); ``chat`` mode posts the text as one user message (``fastserve.bench.chat``). Every streamed
chunk is timestamped; records (``fastserve.bench.metrics.RequestRecord``) are saved as JSONL. Loopback
only unless ``allow_remote``; the run is bounded by ``max_total_s``. Last output line: one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from fastserve.bench import chat as C
from fastserve.bench import prompts as P
from fastserve.bench import workloads as W
from fastserve.bench.metrics import STATUS_OK, RequestRecord, summarize

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
SSE_DATA = "data:"
SSE_DONE = "[DONE]"
LOCALHOST_NAMES = frozenset({"localhost", "localhost.localdomain"})
STATUS_HTTP_ERROR = "http_error"
STATUS_TIMEOUT = "timeout"
STATUS_SHORT = "short"          # stream ended before max_tokens tokens
STATUS_STREAM_ERROR = "error"   # the server sent an error body inside the stream
DEFAULT_MAX_TOTAL_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: Server accounting keys (ours: ``job_stats``) mapped onto RequestRecord's breakdown fields.
SERVER_STATS_KEY = "job_stats"
STATS_FIELDS = {"queue_s": "queue_s", "exec_s": "exec_s", "swap_s": "swap_blocked_s"}

PromptMode = Literal["ids", "text"]
RequestMode = Literal["completions", "chat"]
REQUEST_MODES: tuple[RequestMode, ...] = ("completions", "chat")


class RemoteHostRefused(ValueError):
    """The base URL is not a loopback address and ``allow_remote`` was not given."""


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOCALHOST_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_base_url(base_url: str, allow_remote: bool = False) -> str:
    """The base URL without a trailing slash; refuses non-loopback hosts unless allowed."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base URL must be http(s)://host[:port], got {base_url!r}")
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise RemoteHostRefused(f"{parts.hostname} is not a loopback host; pass allow_remote (--allow-remote) "
                                "to load-test another machine")
    return base_url.rstrip("/")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None            # None: the first id /v1/models lists
    prompt_mode: PromptMode = "ids"
    mode: RequestMode = "completions"   # "chat": real EOS, prompt text as one user message
    system_prompt: str | None = None    # chat mode only
    allow_remote: bool = False
    max_total_s: float = DEFAULT_MAX_TOTAL_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


@dataclass
class _Observed:
    """One request in flight: what the stream has shown so far."""

    request: W.Request
    arrival: float = math.nan
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float | None = None
    status: str = STATUS_TIMEOUT
    http_status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    server: dict[str, Any] | None = None
    retry_after: str | None = None
    #: Chat mode: the streamed answer (a multi-turn conversation sends it back with the next turn).
    text: list[str] = field(default_factory=list)
    #: ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` when reported.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        server = self.server or {}
        # A request cancelled before it was sent keeps its scheduled arrival (JSON has no NaN).
        arrival = self.request.arrival_s if math.isnan(self.arrival) else self.arrival
        record = RequestRecord(
            arrival=arrival, first_token=self.token_times[0] if self.token_times else None,
            end=self.end, output_tokens=self.tokens, status=self.status, token_times=tuple(self.token_times),
            **{ours: _maybe_float(server.get(theirs)) for ours, theirs in STATS_FIELDS.items()})
        return {"request_id": self.request.request_id, "scheduled_arrival": self.request.arrival_s,
                "prompt_len": self.request.prompt_len, "expected_output_len": self.request.output_len,
                **record.to_dict(), "http_status": self.http_status, "finish_reason": self.finish_reason,
                "error": self.error, "server": self.server, "retry_after": self.retry_after,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


def _maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def request_body(req: W.Request, model: str, config: ClientConfig) -> dict[str, Any]:
    """The body for ``req``; in chat mode ``req.output_len`` is already the cap (``fastserve.bench.chat``)."""
    # A stable per-request seed (str hashes are salted per process).
    seed = config.seed + zlib.crc32(req.request_id.encode())
    if config.mode == "chat":
        text = req.prompt_text or W.synthesize_prompt_text(req.prompt_len, seed=seed)
        body = C.chat_body(text, model, req.output_len, config.temperature, config.system_prompt, seed)
        body.update(config.extra_body)
        return body
    if config.prompt_mode == "ids":
        prompt: str | list[int] = W.synthesize_prompt_ids(req.prompt_len, seed=seed)
    else:
        prompt = req.prompt_text or W.synthesize_prompt_text(req.prompt_len, seed=seed)
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_len, "ignore_eos": True,
            "temperature": config.temperature, "stream": True, "stream_options": {"include_usage": True}}
    body.update(config.extra_body)
    return body


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens a chunk carries: its token ids when the server returns them, else one per choice."""
    count = 0
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        count += len(ids) if isinstance(ids, list) else 1
    return count


async def _stream_one(client: httpx.AsyncClient, obs: _Observed, body: dict[str, Any],
                      clock: Callable[[], float], mode: RequestMode = "completions") -> None:
    obs.arrival = clock()
    path, count_tokens = ((C.CHAT_COMPLETIONS_PATH, C.chat_chunk_tokens) if mode == "chat"
                          else (COMPLETIONS_PATH, _chunk_tokens))
    async with client.stream("POST", path, json=body) as resp:
        obs.http_status = resp.status_code
        if resp.status_code != httpx.codes.OK:
            obs.status, obs.error, obs.end = STATUS_HTTP_ERROR, (await resp.aread()).decode(errors="replace"), clock()
            obs.retry_after = resp.headers.get("retry-after")
            return
        usage_tokens = None
        async for line in resp.aiter_lines():
            if not line.startswith(SSE_DATA):
                continue
            data = line[len(SSE_DATA):].strip()
            if data == SSE_DONE:
                break
            chunk = json.loads(data)
            now = clock()
            n = count_tokens(chunk)
            if n:
                obs.token_times.append(now)
                obs.tokens += n
            for choice in chunk.get("choices") or ():
                obs.finish_reason = choice.get("finish_reason") or obs.finish_reason
                if mode == "chat" and (choice.get("delta") or {}).get("content"):
                    obs.text.append(choice["delta"]["content"])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
                obs.prompt_tokens = chunk["usage"].get("prompt_tokens")
                details = chunk["usage"].get("prompt_tokens_details") or {}
                if "cached_tokens" in details:
                    obs.cached_tokens = int(details["cached_tokens"])
            if chunk.get(SERVER_STATS_KEY):
                obs.server = chunk[SERVER_STATS_KEY]
            if "error" in chunk:
                obs.error = json.dumps(chunk["error"])
        obs.end = clock()
        if usage_tokens is not None:
            obs.tokens = int(usage_tokens)
        if obs.error is not None:
            obs.status = STATUS_STREAM_ERROR
        elif mode == "chat":   # ending before max_tokens is the point: the model stopped
            obs.status = STATUS_OK if obs.tokens > 0 and obs.finish_reason is not None else STATUS_SHORT
        else:
            obs.status = STATUS_OK if obs.tokens >= obs.request.output_len else STATUS_SHORT


class _Progress:
    """tqdm when installed, else a line every tenth of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", file=sys.stderr)
            except ImportError:
                self._bar = None

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        elif self.done == self.total or self.done % max(self.total // 10, 1) == 0:
            print(f"  {self.done}/{self.total} requests done", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


HEALTH_PATH = "/health"
HEALTH_POLL_S = 1.0
#: Bound on one /health answer: a server still loading its model may hold the request.
HEALTH_REQUEST_TIMEOUT_S = 5.0


async def wait_healthy(base_url: str, timeout_s: float,
                       transport: httpx.AsyncBaseTransport | None = None) -> float:
    """Poll ``GET /health`` until it answers 200; the seconds waited. Both vLLM and our ingress
    answer 200 only once an engine serves (our ``/v1/models`` answers as soon as the ingress is
    up, seconds before the engine: a run started then times the engine's start-up)."""
    start = time.monotonic()
    last = "no answer"
    async with httpx.AsyncClient(base_url=check_base_url(base_url), timeout=HEALTH_REQUEST_TIMEOUT_S,
                                 transport=transport) as client:
        while True:
            try:
                resp = await client.get(HEALTH_PATH)
                if resp.status_code == httpx.codes.OK:
                    return time.monotonic() - start
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{base_url}{HEALTH_PATH} not healthy after {timeout_s:g} s (last: {last})")
            await asyncio.sleep(HEALTH_POLL_S)


async def resolve_model(client: httpx.AsyncClient) -> str:
    resp = await client.get(MODELS_PATH)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_requests(requests: Sequence[W.Request], config: ClientConfig,
                       transport: httpx.AsyncBaseTransport | None = None) -> list[dict[str, Any]]:
    """Replay ``requests`` at their arrival times; one record dict per request, in request order.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``).
    """
    base = check_base_url(config.base_url, config.allow_remote)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    observed = [_Observed(r) for r in requests]
    progress = _Progress(len(observed), config.progress)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, limits=limits,
                                 transport=transport) as client:
        model = config.model or await resolve_model(client)
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        async def one(obs: _Observed) -> None:
            try:
                await asyncio.sleep(max(obs.request.arrival_s - clock(), 0.0))
                await _stream_one(client, obs, request_body(obs.request, model, config), clock, config.mode)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                obs.status, obs.error, obs.end = STATUS_HTTP_ERROR, repr(exc), clock()
            finally:
                progress.step()

        tasks = [asyncio.create_task(one(o)) for o in observed]
        _, pending = await asyncio.wait(tasks, timeout=config.max_total_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    progress.close()
    return [o.to_dict() for o in observed]


def save_jsonl(records: Sequence[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")


def _requests_from_args(args: argparse.Namespace) -> list[W.Request]:
    if args.mode == "chat":   # real prompt texts; max_tokens capped from the reference length
        samples = P.load_prompts(args.dataset)
        reqs = P.text_requests(samples, args.num_requests, args.rate, args.seed)
        return C.cap_requests(reqs, C.eos_cap_from_args(args))
    source = W.load_alpaca_lengths() if args.dataset == "alpaca" else W.load_sharegpt_lengths()
    reqs = W.workload(source, args.num_requests, args.rate, seed=args.seed)
    return W.scale_lengths(reqs, args.length_scale) if args.length_scale != 1.0 else reqs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback server")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", choices=("sharegpt", "alpaca"), default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate (req/s)")
    parser.add_argument("--length-scale", type=float, default=1.0, help="scale every length (slow CPUs)")
    parser.add_argument("--prompt-mode", choices=("ids", "text"), default="ids")
    C.add_mode_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-total-s", type=float, default=DEFAULT_MAX_TOTAL_S)
    parser.add_argument("--slo", type=float, default=None, help="per-token latency SLO (s)")
    parser.add_argument("--out", type=Path, default=Path("results/client.jsonl"))
    args = parser.parse_args(argv)
    config = ClientConfig(base_url=args.base_url, model=args.model, prompt_mode=args.prompt_mode,
                          allow_remote=args.allow_remote, max_total_s=args.max_total_s, seed=args.seed,
                          mode=args.mode, temperature=args.temperature, system_prompt=args.system_prompt)
    records = asyncio.run(run_requests(_requests_from_args(args), config))
    save_jsonl(records, args.out)
    summary = summarize([RequestRecord.from_dict(r) for r in records], slo=args.slo)
    lengths = C.output_lengths(records)
    print(f"wrote {len(records)} records to {args.out}")
    print(C.format_output_lengths(lengths))
    print(json.dumps({**summary.to_dict(), "output_lengths": lengths.to_dict()}))


if __name__ == "__main__":
    main()
