"""How a job's events reach the ingress: its own Serve stream, and the delivery channels.

A job's stream opens with ``Accepted`` or ``Refused``; its ``TokenDelta``s then travel on the
ingress replica's channel to the engine replica (one message per step for all its jobs) or, with
none, on the job's own stream, which stays open either way so cancelling it aborts the job.
Owns both ends (``Channel`` in the engine replica; ``ChannelClient`` and ``JobStream`` at the
ingress); neither imports ray. Why a channel and when it closes: docs/design.md, docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from fastserve.errors import ErrorCode
from fastserve.scheduler.job import TokenDelta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """A job's first event: ``replica_id`` took it; deltas follow on ``channel_id`` or, if
    empty, on this stream."""

    job_id: str
    replica_id: str = ""
    channel_id: str = ""


@dataclass(frozen=True)
class Refused:
    """A job's only event when the engine would not take it; ``code`` picks the HTTP status."""

    job_id: str
    code: ErrorCode
    message: str


JobEvent = Accepted | Refused | TokenDelta
Message = tuple[TokenDelta, ...]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ServeStream(Protocol[T_co]):
    """A Serve streaming call's response: an async iterator whose ``cancel`` cancels the call."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def cancel(self) -> None: ...


class LocalStream(Generic[T]):
    """An engine replica's stream in this process, cancellable like a Serve stream."""

    def __init__(self, gen: AsyncGenerator[T, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> LocalStream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        # aclose() runs the generator's cleanup, which aborts the job and frees its blocks.
        asyncio.ensure_future(self._gen.aclose())


@dataclass
class DeliveryDelay:
    """Mean seconds from an engine replica emitting a delta to the ingress reading it."""

    total: float = 0.0
    count: int = 0

    def observe(self, emitted_at: float) -> None:
        if emitted_at > 0:
            self.total += max(time.time() - emitted_at, 0.0)
            self.count += 1

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class Channel:
    """One ingress replica's channel in an engine replica (one ``subscribe`` call)."""

    def __init__(self, channel_id: str, idle_close_s: float | None = None) -> None:
        self.channel_id = channel_id
        #: Idle this long, the channel ends: Serve's drain waits for an open ``subscribe``.
        self.idle_close_s = idle_close_s
        self._pending: list[TokenDelta] = []
        self._wake = asyncio.Event()
        self._open: dict[str, asyncio.Event] = {}
        self.closed = False

    def open(self, job_id: str) -> None:
        """``job_id``'s deltas will be put here; ``wait_done`` waits for its last."""
        if self.closed:
            raise RuntimeError(f"channel {self.channel_id} is closed")
        self._open[job_id] = asyncio.Event()

    def forget(self, job_id: str) -> None:
        self._open.pop(job_id, None)

    @property
    def job_ids(self) -> list[str]:
        return list(self._open)

    def put_nowait(self, delta: TokenDelta) -> None:
        self._pending.append(delta)
        self._wake.set()
        if delta.finished and (done := self._open.pop(delta.job_id, None)) is not None:
            done.set()

    async def wait_done(self, job_id: str) -> None:
        done = self._open.get(job_id)
        if done is not None:
            await done.wait()

    async def messages(self) -> AsyncIterator[Message]:
        """Every delta put, one message per wake-up (the engine puts a whole step's deltas
        between wake-ups); ends on ``close()`` or after ``idle_close_s`` idle."""
        while not self.closed:
            if not await self._woken():
                self.close()
                return
            self._wake.clear()
            pending, self._pending = self._pending, []
            if pending:
                yield merged_by_job(pending, emitted_at=time.time())
        if self._pending:   # put before close() (an engine stop's aborts): still delivered
            pending, self._pending = self._pending, []
            yield merged_by_job(pending, emitted_at=time.time())

    async def _woken(self) -> bool:
        """True once something is put or the channel closes; False after ``idle_close_s`` idle."""
        if self.idle_close_s is None or self._open or self._pending:
            await self._wake.wait()
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), self.idle_close_s)
        except TimeoutError:
            return bool(self._open or self._pending)
        return True

    def close(self) -> None:
        """No more jobs or messages; whoever waits on a job is released."""
        self.closed = True
        self._wake.set()
        for done in self._open.values():
            done.set()
        self._open.clear()


def merged_by_job(deltas: list[TokenDelta], emitted_at: float) -> Message:
    """One delta per job (its deltas merged in order), in the order jobs first appear."""
    by_job: dict[str, list[TokenDelta]] = {}
    for delta in deltas:
        by_job.setdefault(delta.job_id, []).append(delta)
    return tuple(replace(TokenDelta.merge(group), emitted_at=emitted_at) for group in by_job.values())


#: (ingress replica id, engine replica id, channel id) → the channel's message stream.
OpenChannel = Callable[[str, str, str], ServeStream[Message]]


class ChannelClient:
    """An ingress replica's channels, one per engine replica, and its jobs' routes. A channel
    that fails to open within ``open_timeout_s`` is not retried for as long."""

    def __init__(self, ingress_id: str, open_channel: OpenChannel, open_timeout_s: float) -> None:
        self.ingress_id = ingress_id
        self._open_channel = open_channel
        self._open_timeout_s = open_timeout_s
        self._routes: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._live: dict[str, str] = {}
        self._current: dict[str, str] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._on_channel: dict[str, set[str]] = {}
        self._failed_at: dict[str, float] = {}
        self.messages = 0

    @property
    def live_channels(self) -> dict[str, str]:
        return dict(self._live)

    def submit(self, job_id: str, submit: Callable[[], ServeStream[JobEvent]]) -> JobStream:
        """Submit ``job_id``; the stream its HTTP request reads. The route exists first: a
        channel may carry its tokens before its own stream brings ``Accepted``."""
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._routes[job_id] = queue
        try:
            job_stream = submit()
        except BaseException:
            self.drop(job_id)
            raise
        return JobStream(job_id, job_stream, self, queue)

    def drop(self, job_id: str) -> None:
        self._routes.pop(job_id, None)
        for jobs in self._on_channel.values():
            jobs.discard(job_id)

    def adopt(self, job_id: str, replica_id: str, channel_id: str) -> bool:
        """True if ``channel_id`` is the channel open or opening here (jobs may precede its ack)."""
        if self._current.get(replica_id) != channel_id:
            return False
        self._on_channel.setdefault(channel_id, set()).add(job_id)
        return True

    def want(self, replica_id: str) -> None:
        """Open a channel to ``replica_id`` unless one is open, opening, or recently failed."""
        if not replica_id or replica_id in self._readers:
            return
        failed_at = self._failed_at.get(replica_id)
        if failed_at is not None and time.monotonic() - failed_at < self._open_timeout_s:
            return
        # A fresh context: Serve cancels a call with the request in whose context it was made.
        self._readers[replica_id] = asyncio.get_running_loop().create_task(
            self._read(replica_id, uuid.uuid4().hex), name=f"channel-{replica_id}",
            context=contextvars.Context())

    async def _read(self, replica_id: str, channel_id: str) -> None:
        stream = self._open_channel(self.ingress_id, replica_id, channel_id)
        self._current[replica_id] = channel_id
        try:
            await asyncio.wait_for(stream.__anext__(), self._open_timeout_s)
            self._live[replica_id] = channel_id
            self._failed_at.pop(replica_id, None)
            async for message in stream:
                self.messages += 1
                for delta in message:
                    queue = self._routes.get(delta.job_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            log.debug("delivery channel to engine replica %s closed by it", replica_id)
        except BaseException as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # ours: close()
                raise
            log.warning("delivery channel to engine replica %s ended: %r", replica_id, exc)
            self._failed_at[replica_id] = time.monotonic()
        finally:
            stream.cancel()
            self._readers.pop(replica_id, None)
            for ids in (self._live, self._current):
                if ids.get(replica_id) == channel_id:
                    del ids[replica_id]
            for job_id in self._on_channel.pop(channel_id, set()):
                queue = self._routes.get(job_id)
                if queue is not None:
                    queue.put_nowait(TokenDelta.ended(job_id, "error"))

    async def close(self) -> None:
        readers = list(self._readers.values())
        for reader in readers:
            reader.cancel()
        for reader in readers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


class JobStream:
    """One job's stream as its HTTP request reads it: ``start``, then its ``TokenDelta``s from
    the channel or its own stream."""

    def __init__(self, job_id: str, own: ServeStream[JobEvent], client: ChannelClient | None = None,
                 queue: asyncio.Queue[TokenDelta] | None = None) -> None:
        self.job_id = job_id
        self._own = own
        self._client = client
        self._queue = queue
        self._started = False
        self._on_channel = False
        self._held: TokenDelta | None = None
        self._done = False

    async def start(self) -> Refused | None:
        """Read the first event: None if accepted, else its ``Refused``."""
        self._started = True
        try:
            event = await self._own.__anext__()
        except BaseException:
            self._end()
            raise
        if isinstance(event, Refused):
            self._end()
            return event
        if not isinstance(event, Accepted):
            self._end()
            raise RuntimeError(f"job {self.job_id}: its stream opened with {event!r}, not Accepted or Refused")
        self._accepted(event)
        return None

    @property
    def on_channel(self) -> bool:
        return self._on_channel

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if not self._started and await self.start() is not None:
            raise StopAsyncIteration
        if self._held is not None:
            delta, self._held = self._held, None
            return delta
        return await self._next()

    async def peek(self) -> TokenDelta | None:
        """The next delta, kept for the next read; None at the end."""
        if self._held is None:
            try:
                self._held = await self.__anext__()
            except StopAsyncIteration:
                return None
        return self._held

    async def _next(self) -> TokenDelta:
        if self._done:
            raise StopAsyncIteration
        if self._on_channel:
            assert self._queue is not None
            delta = await self._queue.get()
        else:
            try:
                event = await self._own.__anext__()
            except BaseException:
                self._end()
                raise
            if not isinstance(event, TokenDelta):
                self._end()
                raise RuntimeError(f"job {self.job_id}: {event!r} after its stream opened")
            delta = event
        if delta.finished:
            self._end()
        return delta

    def _accepted(self, event: Accepted) -> None:
        client = self._client
        if client is None:
            return
        if not event.channel_id:
            client.drop(self.job_id)
            client.want(event.replica_id)
            return
        self._on_channel = True
        if not client.adopt(self.job_id, event.replica_id, event.channel_id):
            # Accepted on a channel that broke before we read this: the scheduler aborts it.
            assert self._queue is not None
            self._queue.put_nowait(TokenDelta.ended(self.job_id, "error"))

    def _end(self) -> None:
        self._done = True
        if self._client is not None:
            self._client.drop(self.job_id)

    def cancel(self) -> None:
        self._own.cancel()
        self._end()
