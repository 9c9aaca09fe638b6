"""``Liveness`` tells a dead stage worker from a slow one; helpers read Ray's refs and errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError


class Liveness:
    """Pings workers: a dead one is reported at once, a silent one only after ``unresponsive_s``
    (a starved machine answers late, not never)."""

    def __init__(self, workers: dict[str, ActorHandle], ping_timeout_s: float, unresponsive_s: float) -> None:
        self.workers = workers
        self.ping_timeout_s = ping_timeout_s
        self.unresponsive_s = unresponsive_s
        self._silent_since: dict[str, float] = {}

    async def failed_worker(self) -> str | None:
        probes = [asyncio.ensure_future(self._probe(n, w)) for n, w in self.workers.items()]
        try:
            for done in asyncio.as_completed(probes):
                dead = await done
                if dead is not None:
                    return dead
        finally:
            for p in probes:
                p.cancel()
        now = time.monotonic()
        silent = [n for n, since in self._silent_since.items() if now - since > self.unresponsive_s]
        return f"{silent[0]} answered no ping for {self.unresponsive_s}s" if silent else None

    async def _probe(self, name: str, worker: ActorHandle) -> str | None:
        try:
            await asyncio.wait_for(as_future(worker.ping.remote()), self.ping_timeout_s)
        except TimeoutError:
            self._silent_since.setdefault(name, time.monotonic())
            return None
        except RayActorError as exc:
            return f"{name} died ({type(exc).__name__})"
        self._silent_since.pop(name, None)
        return None


def looks_like_channel_failure(exc: BaseException) -> bool:
    """Not a worker's own exception: the graph's channels failed (a worker died under them)."""
    return not isinstance(exc, RayTaskError)


def describe(exc: BaseException) -> str:
    """One line: a worker's own exception rather than Ray's wrapper and its remote traceback."""
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    shown = cause if isinstance(cause, BaseException) else exc
    first = (str(shown).strip().splitlines() or [""])[-1 if shown is exc else 0]
    return f"{type(shown).__name__}: {first}"


def as_future(ref: ray.ObjectRef) -> asyncio.Future[Any]:
    return asyncio.wrap_future(ref.future())


def ref_failed(ref: ray.ObjectRef) -> bool:
    """The task behind ``ref`` has ended with an error (False while it runs)."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False
