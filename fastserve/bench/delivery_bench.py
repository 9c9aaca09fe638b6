"""Per-job streams against delivery channels, transport only: ``python -m fastserve.bench.delivery_bench``.

Should each job's tokens travel on its own Serve stream (accept, tokens and cancel on one path,
``server.delivery_channels: false``), or on its ingress replica's delivery channel
(``fastserve.engine.delivery``, the default)? This isolates what the transport costs: a stand-in
engine deployment (no model, ``num_cpus`` 0) steps every ``--step-ms``, giving each open job one
token a step, and delivers it either way, exactly as ``EngineReplica.generate`` and ``subscribe``
do. This process stands in for one ingress replica: it runs ``--concurrency`` jobs of
``--tokens`` tokens at once through ``ChannelClient`` (channels) or the jobs' own streams, the two
modes alternating round by round on one cluster (interleaved A/B). Per mode it reports the
delivery delay per token (engine emitting → this process reading), the engine process's CPU
milliseconds per step (what a model's threads lose to delivery in a real replica) and this
process's. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastserve.bench.race import cpu_model
from fastserve.engine.delivery import Accepted, Channel, ChannelClient, JobEvent, JobStream, Message, ServeStream
from fastserve.scheduler.job import Finish, TokenDelta

MODES = ("per_job", "channel")
STAND_IN_REPLICA = "stand-in"
#: Channels stay open between rounds (a loaded server's channel never idles).
IDLE_CLOSE_S = 600.0
OPEN_TIMEOUT_S = 5.0


class StandInEngine:
    """The Engine deployment's delivery without a model: every ``step_s`` each open job gets a
    token; the job's own stream or its ingress's channel carries it."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._queues: dict[str, tuple[asyncio.Queue[TokenDelta] | None, Channel | None, list[int]]] = {}
        self._channels: dict[str, Channel] = {}
        self.steps = 0
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            if not self._queues:
                continue
            self.steps += 1
            for job_id, (queue, channel, left) in list(self._queues.items()):
                left[0] -= 1
                delta = TokenDelta(job_id, (7,), Finish("length") if left[0] == 0 else None)
                if queue is not None:
                    queue.put_nowait(delta)
                elif channel is not None:
                    channel.put_nowait(delta)
                if left[0] == 0:
                    del self._queues[job_id]

    async def generate(self, job_id: str, tokens: int, ingress_id: str = "") -> AsyncIterator[JobEvent]:
        channel = self._channels.get(ingress_id) if ingress_id else None
        if channel is not None and channel.closed:
            channel = None
        if channel is not None:
            channel.open(job_id)
            self._queues[job_id] = (None, channel, [tokens])
            yield Accepted(job_id, STAND_IN_REPLICA, channel.channel_id)
            await channel.wait_done(job_id)
            return
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[job_id] = (queue, None, [tokens])
        yield Accepted(job_id, STAND_IN_REPLICA if ingress_id else "")
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            merged = TokenDelta.merge(batch)
            yield replace(merged, emitted_at=time.time())
            if merged.finished:
                return

    async def subscribe(self, ingress_id: str, channel_id: str,
                        pinned_replica: str) -> AsyncIterator[Message]:
        channel = Channel(channel_id, idle_close_s=IDLE_CLOSE_S)
        self._channels[ingress_id] = channel
        yield ()
        async for message in channel.messages():
            yield message

    async def usage(self) -> dict[str, float]:
        """CPU seconds of this process so far, and steps taken."""
        return {"cpu_s": time.process_time(), "steps": float(self.steps)}


async def run_round(handle: Any, client: ChannelClient | None, concurrency: int, tokens: int) -> list[float]:
    """``concurrency`` jobs at once to their end; every token's delivery delay (seconds)."""
    generate = handle.options(stream=True).generate
    delays: list[float] = []

    async def one() -> None:
        job_id = uuid.uuid4().hex
        if client is None:
            stream = JobStream(job_id, generate.remote(job_id, tokens))
        else:
            stream = client.submit(job_id, lambda: generate.remote(job_id, tokens, client.ingress_id))
        await stream.start()
        async for delta in stream:
            if delta.token_ids:
                now = time.time()
                delays.extend([now - delta.emitted_at] * len(delta.token_ids))

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return delays


async def measure(handle: Any, concurrency: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Warm both paths, then ``args.rounds`` rounds of each mode, alternating which goes first."""
    subscribe = handle.options(stream=True).subscribe

    def open_channel(ingress: str, replica_id: str, channel_id: str) -> ServeStream[Message]:
        stream: ServeStream[Message] = subscribe.remote(ingress_id=ingress, channel_id=channel_id,
                                                        pinned_replica=replica_id)
        return stream

    client = ChannelClient(uuid.uuid4().hex, open_channel, OPEN_TIMEOUT_S)
    await run_round(handle, client, concurrency, args.tokens)   # warm-up: opens the channel
    await run_round(handle, None, concurrency, args.tokens)
    results: dict[str, dict[str, list[float]]] = {m: {"delay": [], "engine_ms": [], "ingress_ms": []} for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            before = await handle.usage.remote()
            mine = time.process_time()
            delays = await run_round(handle, client if mode == "channel" else None, concurrency, args.tokens)
            after = await handle.usage.remote()
            steps = max(after["steps"] - before["steps"], 1.0)
            out = results[mode]
            out["delay"] += delays
            out["engine_ms"].append(1000 * (after["cpu_s"] - before["cpu_s"]) / steps)
            out["ingress_ms"].append(1000 * (time.process_time() - mine) / steps)
    await client.close()
    return results


def summary(results: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for mode, r in results.items():
        delays = sorted(r["delay"])
        out[mode] = {"delay_mean_ms": 1000 * statistics.fmean(delays),
                     "delay_p95_ms": 1000 * delays[int(0.95 * (len(delays) - 1))],
                     "engine_cpu_ms_per_step": statistics.median(r["engine_ms"]),
                     "ingress_cpu_ms_per_step": statistics.median(r["ingress_ms"])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args()
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=args.num_cpus, object_store_memory=200 * 2**20, include_dashboard=False)
    report: dict[str, Any] = {"cpu": cpu_model(), "tokens": args.tokens, "step_ms": args.step_ms,
                              "rounds": args.rounds, "by_concurrency": {}}
    try:
        app = serve.deployment(name="StandInEngine", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)(StandInEngine).bind(args.step_ms / 1000)
        handle = serve.run(app, name="delivery-bench", route_prefix=None)

        async def every() -> None:
            for c in args.concurrency:
                report["by_concurrency"][c] = summary(await measure(handle, c, args))

        asyncio.run(every())
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{'jobs':>5} {'mode':>8} {'delay mean ms':>14} {'delay p95 ms':>13} "
          f"{'engine CPU ms/step':>19} {'ingress CPU ms/step':>20}")
    for c, got in report["by_concurrency"].items():
        for mode, s in got.items():
            print(f"{c:>5} {mode:>8} {s['delay_mean_ms']:>14.2f} {s['delay_p95_ms']:>13.2f} "
                  f"{s['engine_cpu_ms_per_step']:>19.2f} {s['ingress_cpu_ms_per_step']:>20.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
