"""Delivery channels (``fastserve.engine.delivery``) at both ends, without Ray: the engine replica's
``Channel`` with a real ``Engine`` over a fake executor, and the ingress replica's
``ChannelClient`` with fake Serve streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from fastserve.engine.delivery import Accepted, Channel, ChannelClient, JobEvent, Message, Refused, merged_by_job
from fastserve.errors import ErrorCode
from fastserve.scheduler.job import Finish, TokenDelta


def test_merged_by_job_keeps_each_jobs_tokens_in_order_and_its_finish() -> None:
    deltas = [TokenDelta.token("a", 1), TokenDelta.token("b", 7), TokenDelta.token("a", 2),
              TokenDelta.token("b", 8, Finish("length"))]
    assert merged_by_job(deltas, emitted_at=5.0) == (
        TokenDelta("a", (1, 2), emitted_at=5.0), TokenDelta("b", (7, 8), Finish("length"), emitted_at=5.0))


def test_a_channel_sends_what_was_put_between_wakeups_as_one_message() -> None:
    async def run() -> list[Message]:
        channel = Channel("c1")
        for job in ("a", "b", "c"):
            channel.open(job)
        got: list[Message] = []

        async def read() -> None:
            async for message in channel.messages():
                got.append(message)

        reader = asyncio.create_task(read())
        for step in range(3):   # three engine steps, each putting every job's delta at once
            for job in ("a", "b", "c"):
                channel.put_nowait(TokenDelta.token(job, step, Finish("length") if step == 2 and job == "b" else None))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert channel.job_ids == ["a", "c"]
        await asyncio.wait_for(channel.wait_done("b"), 1)   # b's last delta was put
        channel.close()
        await asyncio.wait_for(channel.wait_done("a"), 1)   # closing releases every waiter
        await asyncio.wait_for(reader, 1)
        return got

    got = asyncio.run(run())
    assert [[(d.job_id, d.token_ids, d.finish_reason) for d in m] for m in got] == [
        [("a", (0,), None), ("b", (0,), None), ("c", (0,), None)],
        [("a", (1,), None), ("b", (1,), None), ("c", (1,), None)],
        [("a", (2,), None), ("b", (2,), "length"), ("c", (2,), None)]]
    assert all(len({d.emitted_at for d in m}) == 1 and m[0].emitted_at > 0 for m in got)


class FakeJobStream:
    """A job's own Serve stream: the events given, then silence until cancelled or ended."""

    def __init__(self, events: list[JobEvent]) -> None:
        self.queue: asyncio.Queue[JobEvent | None] = asyncio.Queue()
        for event in events:
            self.queue.put_nowait(event)
        self.cancelled = False

    def __aiter__(self) -> FakeJobStream:
        return self

    async def __anext__(self) -> JobEvent:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeChannelStream:
    """A ``subscribe`` stream the test feeds; ``fail()`` breaks it as a dead replica would."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        self.cancelled = False

    def __aiter__(self) -> FakeChannelStream:
        return self

    async def __anext__(self) -> Message:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Opened:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.streams: list[FakeChannelStream] = []

    def __call__(self, ingress: str, replica: str, channel_id: str) -> FakeChannelStream:
        self.calls.append((ingress, replica, channel_id))
        self.streams.append(FakeChannelStream())
        return self.streams[-1]


async def drain(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def open_channel(client: ChannelClient, opened: Opened) -> str:
    """Accept one job without a channel (which opens one), ack it; the channel's id."""
    first = FakeJobStream([Accepted("j0", "r1"), TokenDelta.token("j0", 3, Finish("length"))])
    assert [d.token_ids for d in await drain(client.submit("j0", lambda: first))] == [(3,)]
    await asyncio.sleep(0)   # the reader task opens it
    (_, _, channel_id), = opened.calls
    opened.streams[0].queue.put_nowait(())   # the scheduler's ack
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.live_channels == {"r1": channel_id}
    return channel_id


@dataclass
class OneJob:
    """A client with one open, acknowledged channel and job "a" accepted on it."""

    opened: Opened
    client: ChannelClient
    channel_id: str
    own: FakeJobStream
    stream: Any


async def job_on_open_channel(open_timeout_s: float) -> OneJob:
    opened = Opened()
    client = ChannelClient("in-1", opened, open_timeout_s=open_timeout_s)
    channel_id = await open_channel(client, opened)
    own = FakeJobStream([Accepted("a", "r1", channel_id)])
    return OneJob(opened, client, channel_id, own, client.submit("a", lambda: own))


def test_jobs_read_their_tokens_from_the_channel_once_it_is_open() -> None:
    async def run() -> None:
        opened = Opened()
        client = ChannelClient("in-1", opened, open_timeout_s=5)
        channel_id = await open_channel(client, opened)
        assert opened.calls == [("in-1", "r1", channel_id)]
        own = {job: FakeJobStream([Accepted(job, "r1", channel_id)]) for job in "ab"}
        streams = {job: client.submit(job, lambda job=job: own[job]) for job in "ab"}   # type: ignore[misc]
        channel = opened.streams[0]
        channel.queue.put_nowait((TokenDelta.token("a", 1), TokenDelta.token("b", 5), TokenDelta.token("x", 9)))
        channel.queue.put_nowait((TokenDelta("a", (2, 3), Finish("length")), TokenDelta.token("b", 6, Finish("stop"))))
        got = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams.values())), 2)
        assert [[(d.token_ids, d.finish_reason) for d in g] for g in got] == [
            [((1,), None), ((2, 3), "length")], [((5,), None), ((6,), "stop")]]
        assert client.messages == 2 and not any(s.cancelled for s in own.values())
        await client.close()

    asyncio.run(run())


def test_a_broken_channel_fails_its_jobs_and_is_reopened_later() -> None:
    async def run() -> None:
        job = await job_on_open_channel(0.2)
        opened, client, channel_id, stream = job.opened, job.client, job.channel_id, job.stream
        reading = asyncio.create_task(drain(stream))
        opened.streams[0].queue.put_nowait((TokenDelta.token("a", 1),))
        await asyncio.sleep(0.01)
        opened.streams[0].queue.put_nowait(ConnectionError("replica died"))
        got = await asyncio.wait_for(reading, 2)
        assert [(d.token_ids, d.finish_reason) for d in got] == [((1,), None), ((), "error")]
        assert client.live_channels == {} and opened.streams[0].cancelled
        # A job accepted on the dead channel (its accepted event was still in flight) fails too.
        late = FakeJobStream([Accepted("b", "r1", channel_id)])
        assert [d.finish_reason for d in await asyncio.wait_for(drain(client.submit("b", lambda: late)), 2)] \
            == ["error"]
        # Not retried within open_timeout_s of the failure; retried after it.
        client.want("r1")
        await asyncio.sleep(0)
        assert len(opened.calls) == 1
        await asyncio.sleep(0.25)
        client.want("r1")
        await asyncio.sleep(0)
        assert len(opened.calls) == 2
        await client.close()

    asyncio.run(run())


def test_a_channel_that_never_answers_is_given_up_after_its_timeout() -> None:
    async def run() -> None:
        opened = Opened()
        client = ChannelClient("in-1", opened, open_timeout_s=0.05)
        client.want("r1")
        await asyncio.sleep(0.2)
        assert client.live_channels == {} and opened.streams[0].cancelled
        await client.close()

    asyncio.run(run())


def test_cancelling_a_job_on_a_channel_cancels_its_own_stream_and_drops_its_route() -> None:
    async def run() -> None:
        job = await job_on_open_channel(5)
        opened, client, own, stream = job.opened, job.client, job.own, job.stream
        assert await stream.start() is None   # accepted on the channel
        stream.cancel()
        assert own.cancelled
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        opened.streams[0].queue.put_nowait((TokenDelta.ended("a", "abort"),))   # ignored
        await asyncio.sleep(0.01)
        assert client.messages == 1
        await client.close()

    asyncio.run(run())


def test_a_refused_job_ends_with_its_refusal_and_opens_no_channel() -> None:
    async def run() -> None:
        opened = Opened()
        client = ChannelClient("in-1", opened, open_timeout_s=5)
        own = FakeJobStream([Refused("a", ErrorCode.ADMISSION_QUEUE_FULL, "full")])
        stream = client.submit("a", lambda: own)
        assert await stream.start() == Refused("a", ErrorCode.ADMISSION_QUEUE_FULL, "full")
        assert await drain(stream) == [] and opened.calls == []

    asyncio.run(run())


def test_a_channel_is_opened_outside_the_context_of_the_request_that_asked_for_it() -> None:
    """Serve ties a handle call to the request in whose context it is made and cancels it with
    that request: the channel must not belong to whichever request happened to open it."""
    import contextvars

    request: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)
    seen: list[str | None] = []

    async def run() -> None:
        opened = Opened()

        def open_in(ingress: str, replica: str, channel_id: str) -> FakeChannelStream:
            seen.append(request.get())
            return opened(ingress, replica, channel_id)

        client = ChannelClient("in-1", open_in, open_timeout_s=5)

        async def a_request() -> None:
            request.set("req-1")
            first = FakeJobStream([Accepted("j0", "r1"), TokenDelta.token("j0", 3, Finish("length"))])
            await drain(client.submit("j0", lambda: first))

        await asyncio.create_task(a_request())
        await asyncio.sleep(0)
        await client.close()

    asyncio.run(run())
    assert seen == [None]


def test_an_idle_channel_ends_itself_after_its_last_job_but_not_while_one_is_open() -> None:
    async def run() -> tuple[list[Message], list[float]]:
        channel = Channel("c1", idle_close_s=0.05)
        got: list[Message] = []
        ended: list[float] = []

        async def read() -> None:
            async for message in channel.messages():
                got.append(message)
            ended.append(time.monotonic())

        channel.open("a")
        reader = asyncio.create_task(read())
        await asyncio.sleep(0.2)   # four idle periods with a job open: still open
        assert not reader.done() and not channel.closed
        channel.put_nowait(TokenDelta.token("a", 1))
        await asyncio.sleep(0.2)
        assert not reader.done()
        channel.open("b")   # a job opened while the channel waits: it stays open
        finished = time.monotonic()
        channel.put_nowait(TokenDelta.token("a", 2, Finish("length")))
        await asyncio.sleep(0.2)
        assert not reader.done() and channel.job_ids == ["b"]
        finished = time.monotonic()
        channel.put_nowait(TokenDelta.token("b", 9, Finish("stop")))
        await asyncio.wait_for(reader, 2)
        assert channel.closed
        with pytest.raises(RuntimeError, match="channel c1 is closed"):
            channel.open("c")
        return got, [ended[0] - finished]

    got, (idle,) = asyncio.run(run())
    assert [[(d.job_id, d.token_ids, d.finish_reason) for d in m] for m in got] == [
        [("a", (1,), None)], [("a", (2,), "length")], [("b", (9,), "stop")]]
    assert 0.05 <= idle < 1.0


def test_closing_a_channel_still_sends_what_was_put_before() -> None:
    async def run() -> list[Message]:
        channel = Channel("c1")
        channel.open("a")
        got: list[Message] = []
        stream = channel.messages()
        channel.put_nowait(TokenDelta.token("a", 1))
        got.append(await stream.__anext__())
        channel.put_nowait(TokenDelta.ended("a", "abort"))   # an engine stop's abort...
        channel.close()                                           # ...then the replica closes it
        got += [m async for m in stream]
        return got

    got = asyncio.run(run())
    assert [[(d.job_id, d.token_ids, d.finish_reason) for d in m] for m in got] == [
        [("a", (1,), None)], [("a", (), "abort")]]


def test_a_job_accepted_on_a_channel_whose_ack_is_still_in_flight_reads_it() -> None:
    """The engine replica takes jobs on a channel as soon as the ``subscribe`` call reaches
    it, before the ingress has read its ack: such a job is on that channel, not failed."""
    async def run() -> None:
        opened = Opened()
        client = ChannelClient("in-1", opened, open_timeout_s=5)
        client.want("r1")
        await asyncio.sleep(0)
        (_, _, channel_id), = opened.calls
        own = FakeJobStream([Accepted("a", "r1", channel_id)])
        stream = client.submit("a", lambda: own)
        assert await stream.start() is None   # accepted on the channel before its ack
        opened.streams[0].queue.put_nowait(())   # the ack
        opened.streams[0].queue.put_nowait((TokenDelta("a", (4, 5), Finish("length")),))
        got = await asyncio.wait_for(drain(stream), 2)
        assert [(d.token_ids, d.finish_reason) for d in got] == [((4, 5), "length")]
        await client.close()

    asyncio.run(run())


def test_a_channel_the_scheduler_ends_leaves_finished_jobs_alone_and_is_reopened_at_once() -> None:
    async def run() -> None:
        job = await job_on_open_channel(5)
        opened, client, stream = job.opened, job.client, job.stream
        opened.streams[0].queue.put_nowait((TokenDelta("a", (1,), Finish("length")),))
        opened.streams[0].queue.put_nowait(StopAsyncIteration())   # idle: the subscribe call returns
        for _ in range(5):
            await asyncio.sleep(0)
        assert client.live_channels == {}
        got = await asyncio.wait_for(drain(stream), 2)   # its accepted event read only now
        assert [(d.token_ids, d.finish_reason) for d in got] == [((1,), "length")]
        client.want("r1")   # not a failure: no back-off
        await asyncio.sleep(0)
        assert len(opened.calls) == 2
        await client.close()

    asyncio.run(run())
