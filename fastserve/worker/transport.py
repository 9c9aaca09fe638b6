"""How a ``StageInput`` travels through the grid of stage workers: the transport interface.

The grid is ``grid[stage][tp_rank]``. Every rank of stage 0 receives ``(plan, None)``; rank ``r``
of stage ``s + 1`` consumes rank ``r``'s output of stage ``s`` (every output must be consumed):
all TP ranks hold the same all-reduced hidden states, so each sends its 1/TP part of them and the
next stage's ranks all-gather the parts (``fastserve.worker.worker.hidden_part``), on either
transport; the last stage's outputs are collected, rank 0's is the ``StepOutput``.

Two implementations behind one interface:

- ``CompiledGraphTransport`` (default): a Ray compiled graph, compiled once at ``start`` and run
  with ``execute_async`` from the caller's event loop, up to ``max_inflight`` executions in flight
  (the pipeline depth). On GPU the activations between stages go over NCCL channels
  (``with_tensor_transport``); that path cannot run on a CPU-only machine and is untested here.
  Ray builds those channels' communicator with CuPy's NCCL binding (``cupy.cuda.nccl``), so each
  worker of a pipeline that needs them checks for it as it starts (``fastserve.worker.nccl``).
- ``ActorCallTransport`` (``transport: actor``): plain chained ``.remote()`` calls, one per
  worker per plan, passing object refs along. Slower; for debugging and platforms where compiled
  graphs misbehave. Ray runs one submitter's calls to an actor in submission order, so plans stay
  ordered on every worker.

``submit`` returns once the plan is enqueued (so the order of plans is fixed when it returns) and
hands back an awaitable of the last stage's outputs.
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
#: Ray's tensor transport for activations between GPU stages ("accelerator" is its newer alias).
GPU_TENSOR_TRANSPORT = "nccl"


class Transport(ABC):
    """Carries plans (and activations) through the worker grid."""

    def __init__(self, grid: Grid) -> None:
        if not grid or not grid[0]:
            raise ValueError("a transport needs at least one stage with one worker")
        if len({len(stage) for stage in grid}) != 1:
            raise ValueError(f"every stage needs the same TP size, got {[len(s) for s in grid]}")
        self.grid = grid

    @abstractmethod
    async def start(self) -> None:
        """Prepare to carry plans (compile, ...); the workers exist and their TP groups are up."""

    @abstractmethod
    async def submit(self, msg: StageInput) -> Awaitable[list[Any]]:
        """Enqueue one plan; the awaitable yields the last stage's outputs, rank by rank."""

    @abstractmethod
    async def close(self, kill_actors: bool) -> None:
        """Stop carrying plans; may block (callers bound it with a timeout)."""


class CompiledGraphTransport(Transport):
    """A Ray compiled graph over the grid, executed asynchronously, ``max_inflight`` deep."""

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
        # The graph's driver-side proxy actor lives until the graph object is collected, which a
        # reference cycle can delay; end it now so a shutdown leaves no actor behind.
        proxy = getattr(dag, "_proxy_actor", None)
        if proxy is not None:
            ray.kill(proxy)


class ActorCallTransport(Transport):
    """Plain chained actor calls: each worker's output ref is the next stage's argument."""

    async def start(self) -> None:
        return None

    async def submit(self, msg: StageInput) -> Awaitable[list[Any]]:
        upstream: list[Any] = [msg] * len(self.grid[0])
        for stage in self.grid:
            upstream = [w.step.remote(upstream[r]) for r, w in enumerate(stage)]
        return _await_in_order(upstream)

    async def close(self, kill_actors: bool) -> None:
        return None  # nothing of its own to release; the pipeline kills the workers


async def _await_in_order(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    # Sequentially: a compiled-graph future may be awaited only once, each from this loop.
    return [await a for a in awaitables]


def make_transport(kind: str, grid: Grid, max_inflight: int, device: str) -> Transport:
    """The transport named ``kind`` (``compiled`` or ``actor``) for a grid on ``device``."""
    if kind == "compiled":
        tensor = GPU_TENSOR_TRANSPORT if uses_nccl_channels(kind, device, len(grid)) else None
        return CompiledGraphTransport(grid, max_inflight, tensor)
    if kind == "actor":
        return ActorCallTransport(grid)
    raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {kind!r}")
