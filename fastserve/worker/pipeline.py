"""The pipeline executor: P stages × T tensor-parallel ranks of ``StageWorker``s behind one plan API.

Owns the workers' lifecycle (placement, start-up, TP groups, transport, failure detection, teardown),
up to P plans in flight (paper §4.3). A dead worker closes it (``PipelineError``, recovery is the
caller's); a plan that fails on live workers (``PlanFailed``) fails only its jobs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from fastserve.worker.liveness import Liveness, as_future, describe, looks_like_channel_failure, ref_failed
from fastserve.worker.messages import BatchPlan, StepOutput
from fastserve.worker.placement import (
    PlacementError,
    check_given_group,
    check_layout,
    create_workers,
    placement_failure,
    worker_specs,
)
from fastserve.worker.spec import EngineSpec
from fastserve.worker.transport import Transport, make_transport
from fastserve.worker.worker import StageInput, StepRecord

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """The pipeline cannot run plans: it failed to start, or a worker died."""


class PlanFailed(RuntimeError):
    """One plan failed on live workers (a worker raised); the pipeline keeps running plans."""


class PipelineExecutor:
    """Runs ``BatchPlan``s on P × T Ray stage workers; ``execute`` is async, P plans deep."""

    def __init__(self, spec: EngineSpec, placement_group: PlacementGroup | None = None,
                 bundle_offset: int = 0) -> None:
        """Stage s goes in ``placement_group``'s bundle ``bundle_offset + s``; None: one of its own."""
        if bundle_offset < 0:
            raise ValueError(f"bundle_offset must be >= 0, got {bundle_offset}")
        self.spec = spec
        self.timeouts = spec.timeouts
        self.config = spec.model.load_config()
        check_layout(spec, self.config)
        self._given_pg = placement_group
        self._bundle_offset = bundle_offset
        self._specs = worker_specs(spec, self.config)
        self._grid: list[list[ActorHandle]] = []
        self._pg: PlacementGroup | None = None
        self._owns_pg = False
        self._transport: Transport | None = None
        self._slots = asyncio.Semaphore(self.max_inflight)
        self._closed = asyncio.Event()
        self._closed_reason: str | None = None
        self._teardown: asyncio.Future[None] | None = None
        self._liveness: Liveness | None = None

    @property
    def max_inflight(self) -> int:
        return self.spec.parallel.max_inflight or self.spec.parallel.pipeline_parallel_size

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def workers(self) -> list[list[ActorHandle]]:
        return [list(stage) for stage in self._grid]

    async def start(self) -> None:
        """Place and start the workers, join their TP groups, compile the transport."""
        if self._grid or self.closed:
            raise PipelineError("start() may be called once per executor")
        try:
            pg = await self._placement_group()
            self._grid = create_workers(self.spec, self._specs, pg, self._bundle_offset, os.environ)
            self._liveness = Liveness(dict(zip(self._worker_names(), self._all_workers(), strict=True)),
                                       self.timeouts.ping_timeout_s, self.timeouts.unresponsive_s)
            await self._await_ready()
            await self._init_tp_groups()
            self._transport = make_transport(self.spec.parallel.transport, self._grid, self.max_inflight,
                                             self.spec.model.device)
            await self._transport.start()
        except BaseException as exc:
            error = self._fail(f"start-up failed: {exc}")
            await asyncio.shield(self._teardown_started())
            if isinstance(exc, PipelineError | asyncio.CancelledError):
                raise
            raise error from exc

    async def shutdown(self) -> None:
        """Tear the graph and the workers down (bounded in time); idempotent, also after a failure."""
        self._mark_closed("shut down")
        await asyncio.shield(self._teardown_started())

    async def _placement_group(self) -> PlacementGroup:
        bundles = self.spec.parallel.stage_bundles(self.spec.model.device)
        pg = self._given_pg
        if pg is not None:
            try:
                check_given_group(self.spec, pg, bundles, self._bundle_offset)
            except PlacementError as exc:
                raise PipelineError(str(exc)) from None
        else:
            pg = placement_group(bundles, strategy="PACK", name="")
            self._owns_pg = True
        self._pg = pg
        try:
            await asyncio.wait_for(as_future(pg.ready()), self.timeouts.placement_timeout_s)
        except TimeoutError:
            raise PipelineError(placement_failure(self.spec, bundles)) from None
        return pg

    async def _await_ready(self) -> None:
        names = [ws.name for stage in self._specs for ws in stage]
        pings: list[ray.ObjectRef] = [w.ping.remote() for w in self._all_workers()]
        timeout = self.spec.startup_timeout_s()
        try:
            await asyncio.wait_for(asyncio.gather(*pings), timeout)
        except TimeoutError:
            raise PipelineError(f"stage workers did not start within {timeout:.0f}s (startup_timeout_s, or the "
                                "weights' bytes at weight_read_bytes_per_s)") from None
        except RayActorError as exc:
            failed = next((n for n, p in zip(names, pings, strict=True) if ref_failed(p)), "a worker")
            raise PipelineError(f"{failed} failed to start: {exc}") from exc

    async def _init_tp_groups(self) -> None:
        if self.spec.parallel.tensor_parallel_size == 1:
            return
        joins: list[ray.ObjectRef] = []
        for stage in self._grid:
            addr, port = await stage[0].tp_address.remote()
            joins += [w.init_tp_group.remote(addr, port, len(stage), r, self.timeouts.tp_timeout_s)
                      for r, w in enumerate(stage)]
        try:
            await asyncio.wait_for(asyncio.gather(*joins), self.timeouts.tp_timeout_s)
        except TimeoutError:
            raise PipelineError(f"tensor-parallel groups ({self.spec.parallel.tensor_parallel_size} ranks per stage) "
                                f"did not form within tp_timeout_s={self.timeouts.tp_timeout_s}s") from None

    def _all_workers(self) -> list[ActorHandle]:
        return [w for stage in self._grid for w in stage]

    def _worker_names(self) -> list[str]:
        return [ws.name for stage in self._specs for ws in stage] if self._grid else []

    async def execute(self, plan: BatchPlan) -> StepOutput:
        """Run ``plan`` through every stage; returns once its swaps are settled everywhere."""
        async with self._slots:
            self._check_open()
            assert self._transport is not None
            submitted = time.perf_counter()
            try:
                # Submitting is watched too: a graph whose worker died may refuse or stall the write.
                outputs = await self._watch(self._submit(self._transport, plan), plan)
            except (PipelineError, PlanFailed, asyncio.CancelledError):
                raise
            except Exception as exc:
                raise await self._step_failed(plan, exc) from exc
        out = outputs[0]
        if not isinstance(out, StepOutput):
            raise await self._step_failed(plan, TypeError(f"last stage returned {type(out).__name__}"))
        out.timings["pipeline_latency"] = time.perf_counter() - submitted
        return out

    @staticmethod
    async def _submit(transport: Transport, plan: BatchPlan) -> list[Any]:
        pending = await transport.submit(StageInput(plan, None))
        return await pending

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise PipelineError(f"pipeline is closed ({self._closed_reason})")
        if self._transport is None:
            raise PipelineError("pipeline not started: call start() first")

    async def _watch(self, pending: Coroutine[Any, Any, list[Any]], plan: BatchPlan) -> list[Any]:
        """Await a plan's outputs; while they are overdue, ping the workers to catch a death."""
        task = asyncio.ensure_future(pending)
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            while True:
                await asyncio.wait({task, closed}, timeout=self.timeouts.liveness_interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if closed.done():
                    raise PipelineError(f"plan {plan.step_id} aborted: pipeline closed ({self._closed_reason})")
                failed = await self._find_failed_worker()
                if failed is not None:
                    raise self._fail(f"{failed} while plan {plan.step_id} was in flight")
        finally:
            for t in (task, closed):
                if not t.done():
                    t.cancel()

    async def _step_failed(self, plan: BatchPlan, exc: BaseException) -> PipelineError | PlanFailed:
        """Name the cause of a failed step: a dead worker (the pipeline closes), else the plan's own
        error on live workers (it stays open)."""
        if self._closed_reason is not None:  # another plan's failure closed the pipeline first
            return PipelineError(f"plan {plan.step_id} aborted: pipeline closed ({self._closed_reason})")
        failed = await self._find_failed_worker()
        deadline = time.monotonic() + self.timeouts.diagnose_s
        # A graph whose worker was killed may error before Ray reports the actor dead: re-probe briefly.
        while failed is None and looks_like_channel_failure(exc) and time.monotonic() < deadline:
            await asyncio.sleep(self.timeouts.liveness_interval_s)
            failed = await self._find_failed_worker()
        if failed is None and not looks_like_channel_failure(exc):
            log.warning("plan %d failed on live workers: %s", plan.step_id, describe(exc))
            return PlanFailed(f"plan {plan.step_id} failed: {describe(exc)}")
        reason = (f"{failed} while plan {plan.step_id} was in flight" if failed is not None
                  else f"plan {plan.step_id} failed: {describe(exc)}")
        return self._fail(reason)

    async def _find_failed_worker(self) -> str | None:
        """A dead worker's description (as soon as one is known), else a long-silent one's, else None."""
        assert self._liveness is not None
        return await self._liveness.failed_worker()

    async def stats(self) -> list[dict[str, Any]]:
        self._check_open()
        return list(await asyncio.gather(*[w.stats.remote() for w in self._all_workers()]))

    async def timeline(self) -> dict[tuple[int, int], list[StepRecord]]:
        """``(stage, tp_rank)`` → when that worker ran each recent plan (``time.time()``)."""
        self._check_open()
        records: list[list[Any]] = await asyncio.gather(*[w.timeline.remote() for w in self._all_workers()])
        keys = [(ws.stage_index, ws.tp_rank) for stage in self._specs for ws in stage]
        return {k: [StepRecord(*r) for r in recs] for k, recs in zip(keys, records, strict=True)}

    def _mark_closed(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        self._closed.set()

    def _fail(self, reason: str) -> PipelineError:
        """Close on a failure: kill the workers now (survivors may be stuck in a collective with a
        dead peer), finish the teardown in the background, and return the error to raise."""
        if self._closed_reason is None:
            log.error("pipeline closing: %s", reason)
        self._mark_closed(reason)
        self._kill_workers()
        self._teardown_started()
        return PipelineError(reason)

    def _teardown_started(self) -> asyncio.Future[None]:
        if self._teardown is None:
            self._teardown = asyncio.ensure_future(self._tear_down())
        return self._teardown

    async def _tear_down(self) -> None:
        await self._close_transport(kill_actors=True)
        self._kill_workers()
        await self._await_workers_gone()
        if self._owns_pg and self._pg is not None:
            remove_placement_group(self._pg)
        self._pg = None

    async def _close_transport(self, kill_actors: bool) -> None:
        transport, self._transport = self._transport, None
        if transport is None:
            return
        try:
            await asyncio.wait_for(transport.close(kill_actors), self.timeouts.teardown_timeout_s)
        except TimeoutError:
            log.warning("transport teardown exceeded %ss; killing the workers", self.timeouts.teardown_timeout_s)
        except Exception:
            log.exception("transport teardown failed; killing the workers")

    def _kill_workers(self) -> None:
        for w in self._all_workers():
            try:
                ray.kill(w, no_restart=True)
            except Exception as exc:  # already gone, or Ray itself is shutting down
                log.debug("ray.kill(%s): %s", w, exc)

    async def _await_workers_gone(self) -> None:
        """Until every killed worker is reported dead (bounded): shutdown leaves no actors behind."""
        deadline = time.monotonic() + self.timeouts.teardown_timeout_s
        for w in self._all_workers():
            while time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(as_future(w.ping.remote()), self.timeouts.ping_timeout_s)
                except (RayActorError, GetTimeoutError, TimeoutError):
                    break
                await asyncio.sleep(self.timeouts.liveness_interval_s / 10)
