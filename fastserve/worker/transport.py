"""How a ``StageInput`` travels through the grid ``grid[stage][tp_rank]`` of stage workers: rank ``r``
of each stage feeds rank ``r`` of the next. ``CompiledGraphTransport`` (default) is a Ray compiled graph
(NCCL channels on GPU); ``ActorCallTransport`` chains plain actor calls.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import Any, Literal

import ray
from ray.actor import ActorHandle

from fastserve.worker.nccl import uses_nccl_channels
from fastserve.worker.worker import StageInput

TransportKind = Literal["compiled", "actor"]
TRANSPORTS: tuple[TransportKind, ...] = ("compiled", "actor")
Grid = Sequence[Sequence[ActorHandle]]
GPU_TENSOR_TRANSPORT = "nccl"


class Transport(ABC):
    def __init__(self, grid: Grid) -> None:
        if not grid or not grid[0]:
            raise ValueError("a transport needs at least one stage with one worker")
        if len({len(stage) for stage in grid}) != 1:
            raise ValueError(f"every stage needs the same TP size, got {[len(s) for s in grid]}")
        self.grid = grid

    @abstractmethod
    async def start(self) -> None:
        """Prepare to carry plans; the workers and their TP groups are up."""

    @abstractmethod
    async def submit(self, msg: StageInput) -> Awaitable[list[Any]]:
        """Enqueue one plan; the awaitable yields the last stage's outputs."""

    @abstractmethod
    async def close(self, kill_actors: bool) -> None:
        """May block: callers bound it."""


class CompiledGraphTransport(Transport):
    def __init__(self, grid: Grid, max_inflight: int, tensor_transport: str | None = None) -> None:
        super().__init__(grid)
        self.max_inflight = max_inflight
        self.tensor_transport = tensor_transport
        self._dag: Any = None

    async def start(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        last = len(self.grid) - 1
        with InputNode() as inp:
            upstream: list[Any] = [inp] * len(self.grid[0])
            for s, stage in enumerate(self.grid):
                nodes: list[Any] = [w.step.bind(upstream[r]) for r, w in enumerate(stage)]
                if self.tensor_transport is not None and s < last:
                    nodes = [n.with_tensor_transport(transport=self.tensor_transport) for n in nodes]
                upstream = nodes
            dag = MultiOutputNode(upstream)
        # Must run inside the caller's event loop: enable_asyncio binds the graph to it.
        self._dag = dag.experimental_compile(enable_asyncio=True,
                                             _max_inflight_executions=self.max_inflight)

    async def submit(self, msg: StageInput) -> Awaitable[list[Any]]:
        if self._dag is None:
            raise RuntimeError("compiled graph transport used before start()")
        futures = await self._dag.execute_async(msg)
        return _await_in_order(futures)

    async def close(self, kill_actors: bool) -> None:
        dag, self._dag = self._dag, None
        if dag is None:
            return
        await asyncio.to_thread(dag.teardown, kill_actors=kill_actors)
        # Its proxy actor lives until the graph is collected (a cycle can delay that): end it now.
        proxy = getattr(dag, "_proxy_actor", None)
        if proxy is not None:
            ray.kill(proxy)


class ActorCallTransport(Transport):
    async def start(self) -> None:
        return None

    async def submit(self, msg: StageInput) -> Awaitable[list[Any]]:
        upstream: list[Any] = [msg] * len(self.grid[0])
        for stage in self.grid:
            upstream = [w.step.remote(upstream[r]) for r, w in enumerate(stage)]
        return _await_in_order(upstream)

    async def close(self, kill_actors: bool) -> None:
        return None


async def _await_in_order(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    # Sequentially: a compiled-graph future may be awaited only once, each from this loop.
    return [await a for a in awaitables]


def make_transport(kind: str, grid: Grid, max_inflight: int, device: str) -> Transport:
    if kind == "compiled":
        tensor = GPU_TENSOR_TRANSPORT if uses_nccl_channels(kind, device, len(grid)) else None
        return CompiledGraphTransport(grid, max_inflight, tensor)
    if kind == "actor":
        return ActorCallTransport(grid)
    raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {kind!r}")
