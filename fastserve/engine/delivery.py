"""How a job's events reach the ingress: its own Serve stream, and the delivery channels.

A job's stream (``EngineReplica.generate``) opens with ``Accepted``, or its only event,
``Refused`` (with the ``ErrorCode`` that picks the HTTP answer); then come its ``TokenDelta``s,
the last with its ``Finish``. Once an ingress replica has a channel open to the engine replica
(``EngineReplica.subscribe``, routed to it by ``fastserve.server.routing``), its jobs' deltas
travel there instead, every job's in one message per engine step; their own streams stay open,
silent, so cancelling one still aborts its job (client gone, stop string), and Serve still routes,
counts and drains by them. One stream per job for everything would cost one stream item per job
per step: several times the engine replica's CPU per step, and a delay that grows with the batch
(measured by ``fastserve.bench.delivery_bench``; docs/benchmarks.md).

Owns both ends, and neither imports ray:

- the stream's events (``Accepted``, ``Refused``; the scheduler's ``TokenDelta``), ``ServeStream``
  (what a Serve streaming call looks like; ``LocalStream`` is one over an engine replica in this
  process) and ``DeliveryDelay`` (emitting to reading, measured at the ingress);
- ``Channel`` (engine replica): where the engine puts the deltas of the jobs on it (a
  ``DeltaSink``), sent as one message per wake-up (one per job, merged), and which jobs are still
  open on it;
- ``ChannelClient`` (ingress replica): its open channels (one per engine replica) and the routes
  from job id to the queue its request reads;
- ``JobStream`` (ingress replica): the one stream an HTTP request reads — ``start`` reads the
  accepted or refused event, then the job's deltas come from its channel or its own stream.

A job is put on a channel when it is accepted, or never: its deltas then all travel on one
ordered stream. A channel that breaks fails the jobs on it (``error``) at both ends: the
scheduler aborts them, the ingress ends their requests. A channel with no job on it for
``server.channel_idle_close_s`` is ended by the engine replica (its ``subscribe`` call returns),
so an idle channel never holds a replica that Serve is draining; the ingress opens a new one with
the next job accepted there.
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
    """A job's first event: the engine replica ``replica_id`` took it. Its deltas follow on the
    caller's delivery channel ``channel_id`` or, with none (empty), on this stream."""

    job_id: str
    replica_id: str = ""
    channel_id: str = ""


@dataclass(frozen=True)
class Refused:
    """A job's only event when the engine would not take it: why, and the ``ErrorCode`` that
    picks the HTTP answer (admission queue full → 429, invalid → 400, ...)."""

    job_id: str
    code: ErrorCode
    message: str


#: What a job's own stream carries: ``Accepted`` or ``Refused`` first, then ``TokenDelta``s.
JobEvent = Accepted | Refused | TokenDelta
#: One channel message: the deltas of one or more steps, one per job.
Message = tuple[TokenDelta, ...]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ServeStream(Protocol[T_co]):
    """A Serve streaming call's response (a handle's ``generate`` or ``subscribe``): an async
    iterator that can be cancelled (which cancels the call on the replica)."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def __anext__(self) -> Awaitable[T_co]: ...

    def cancel(self) -> None: ...


class LocalStream(Generic[T]):
    """An engine replica's stream (``generate``, ``subscribe``) in this process, cancellable like
    a Serve stream."""

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


# ---- the engine replica's end ---------------------------------------------------------------

class Channel:
    """One ingress replica's channel in an engine replica (one ``subscribe`` call)."""

    def __init__(self, channel_id: str, idle_close_s: float | None = None) -> None:
        self.channel_id = channel_id
        #: With no job open and nothing to send for this long, the channel ends (``messages``
        #: returns): an open ``subscribe`` call is a request in flight on the engine replica,
        #: and Serve's drain waits for every one. None = only ``close()`` ends it.
        self.idle_close_s = idle_close_s
        self._pending: list[TokenDelta] = []
        self._wake = asyncio.Event()
        self._open: dict[str, asyncio.Event] = {}   # job id → set when its last delta is put
        self.closed = False

    def open(self, job_id: str) -> None:
        """``job_id``'s deltas will be put here (``put_nowait``, the engine's ``DeltaSink``);
        ``wait_done(job_id)`` waits for the last."""
        if self.closed:
            raise RuntimeError(f"channel {self.channel_id} is closed")
        self._open[job_id] = asyncio.Event()

    def forget(self, job_id: str) -> None:
        """A job that was opened here but never submitted (the engine refused it)."""
        self._open.pop(job_id, None)

    @property
    def job_ids(self) -> list[str]:
        """The jobs on this channel that have not ended."""
        return list(self._open)

    def put_nowait(self, delta: TokenDelta) -> None:
        self._pending.append(delta)
        self._wake.set()
        if delta.finished and (done := self._open.pop(delta.job_id, None)) is not None:
            done.set()

    async def wait_done(self, job_id: str) -> None:
        """Until ``job_id``'s last delta is put, or the channel closes."""
        done = self._open.get(job_id)
        if done is not None:
            await done.wait()

    async def messages(self) -> AsyncIterator[Message]:
        """Every delta put, as one message per wake-up: the engine puts a whole step's deltas
        before this task runs again, so that is one message per step (more when it lags).

        Ends when the channel is closed, after sending what was put before; or by itself (it
        closes) once no job has been open on it and nothing was put for ``idle_close_s``."""
        while not self.closed:
            if not await self._woken():
                self.close()   # idle: no job can be put on it from here on
                return
            self._wake.clear()
            pending, self._pending = self._pending, []
            if pending:
                yield merged_by_job(pending, emitted_at=time.time())
        if self._pending:   # put before close() (an engine stop's aborts): still delivered
            pending, self._pending = self._pending, []
            yield merged_by_job(pending, emitted_at=time.time())

    async def _woken(self) -> bool:
        """Until something is put or the channel closes (True); False once it stayed idle —
        no job open, nothing pending — for ``idle_close_s``."""
        if self.idle_close_s is None or self._open or self._pending:
            await self._wake.wait()
            return True
        try:
            await asyncio.wait_for(self._wake.wait(), self.idle_close_s)
        except TimeoutError:
            return bool(self._open or self._pending)   # a job opened meanwhile keeps it
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


# ---- the ingress replica's end -----------------------------------------------------------------

#: Opens a channel: (ingress replica id, engine replica id, channel id) → its message stream.
OpenChannel = Callable[[str, str, str], ServeStream[Message]]


class ChannelClient:
    """An ingress replica's channels, one per engine replica, and its jobs' routes.

    ``open_timeout_s`` bounds how long a new channel may take to answer; a channel that failed
    to open is not tried again for as long (its jobs travel on their own streams meanwhile).
    """

    def __init__(self, ingress_id: str, open_channel: OpenChannel, open_timeout_s: float) -> None:
        self.ingress_id = ingress_id
        self._open_channel = open_channel
        self._open_timeout_s = open_timeout_s
        self._routes: dict[str, asyncio.Queue[TokenDelta]] = {}   # job id → its request's queue
        self._live: dict[str, str] = {}          # engine replica id → id of its open channel
        self._current: dict[str, str] = {}       # … → id of its channel, open or opening
        self._readers: dict[str, asyncio.Task[None]] = {}   # engine replica id → reader task
        self._on_channel: dict[str, set[str]] = {}   # channel id → its jobs here
        self._failed_at: dict[str, float] = {}   # engine replica id → when opening failed
        self.messages = 0                        # channel messages read (tests, operators)

    @property
    def live_channels(self) -> dict[str, str]:
        return dict(self._live)

    def submit(self, job_id: str, submit: Callable[[], ServeStream[JobEvent]]) -> JobStream:
        """Submit ``job_id`` (``submit()`` sends it, returning its own stream); the stream its
        HTTP request reads. Its route exists first: a channel may carry its tokens before the
        job's own stream brings its accepted event."""
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
        """The job was accepted on ``channel_id``: True if that channel is the one open here, or
        opening (the engine replica takes jobs on a channel before its ack reaches us)."""
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
        # A context of its own: the request that happens to open the channel must not own it.
        # Serve ties a call to the request in whose context it is made, and cancels it when that
        # request is cancelled (measured: a client that closed its finished stream took the
        # channel, and the 17 jobs on it, down with it).
        self._readers[replica_id] = asyncio.get_running_loop().create_task(
            self._read(replica_id, uuid.uuid4().hex), name=f"channel-{replica_id}",
            context=contextvars.Context())

    async def _read(self, replica_id: str, channel_id: str) -> None:
        stream = self._open_channel(self.ingress_id, replica_id, channel_id)
        self._current[replica_id] = channel_id
        try:
            await asyncio.wait_for(stream.__anext__(), self._open_timeout_s)   # the channel's ack
            self._live[replica_id] = channel_id
            self._failed_at.pop(replica_id, None)
            async for message in stream:
                self.messages += 1
                for delta in message:
                    queue = self._routes.get(delta.job_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            # Ended by the engine replica: idle (no job of ours left on it) or replaced by a
            # newer channel. The next job accepted there without one opens another.
            log.debug("delivery channel to engine replica %s closed by it", replica_id)
        except BaseException as exc:   # the replica died, never answered, or Serve cancelled the call
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
    """One job's stream as its HTTP request reads it: ``start`` reads whether the engine took
    the job; then its ``TokenDelta``s, from its ingress replica's channel or its own stream;
    ``peek`` waits for the next without taking it; ``cancel`` aborts the job."""

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
        """Read the job's first event: None once the engine accepted it (its deltas' route is
        then set), else its ``Refused`` (the stream is over)."""
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
        """Its deltas come on its ingress replica's delivery channel (known once started)."""
        return self._on_channel

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if not self._started and await self.start() is not None:
            raise StopAsyncIteration   # refused: nothing to read
        if self._held is not None:
            delta, self._held = self._held, None
            return delta
        return await self._next()

    async def peek(self) -> TokenDelta | None:
        """The next delta, kept for the next read (None: the stream ended without one)."""
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
            client.drop(self.job_id)      # its deltas follow on its own stream
            client.want(event.replica_id)   # for the jobs after it
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
        """Abort the job (its own stream's cancellation reaches the engine replica)."""
        self._own.cancel()
        self._end()
