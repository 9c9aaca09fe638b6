"""The ``Engine`` deployment: one replica = one model copy, its executor and its engine loop.

``EngineReplica.generate`` submits an ingress's ``JobRequest`` and streams back ``Accepted`` or
``Refused``; the job's token deltas travel on the ingress replica's delivery channel (``subscribe``,
``fastserve.engine.delivery``). A cancelled stream aborts the job. ``build_executor`` runs the model in
process (TP·PP = 1) or as a Ray pipeline in this replica's placement group (stage s in bundle 1 + s).
The replica records its metrics and stats line on their own intervals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any

from fastserve.config import AppArgs, ProfileMismatchWarning
from fastserve.config_model import resolve_path
from fastserve.engine.async_engine import AsyncEngine, Executor, ThreadedExecutor
from fastserve.engine.core import SyncExecutor
from fastserve.engine.delivery import Accepted, Channel, JobEvent, Message, Refused
from fastserve.engine.metrics import EngineMetrics, scheduler_gauges
from fastserve.engine.stats_log import StatsLog
from fastserve.errors import AdmissionQueueFull, RequestError
from fastserve.logs import join_serve_logs
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.structured import GrammarCompiler, JobGrammars, TokenSpace
from fastserve.worker.spec import OMP_WAIT_POLICY_ENV, EngineSpec

log = logging.getLogger(__name__)
#: How ``replica_id`` starts outside a Serve replica (offline runs, tests).
LOCAL_REPLICA = "local-"


async def build_executor(spec: EngineSpec) -> Executor:
    """The executor of one model copy (``AppArgs.engine_spec()``), started."""
    if spec.parallel.uses_pipeline:
        return await _pipeline_executor(spec)
    return await in_process_executor(spec)


async def in_process_executor(spec: EngineSpec) -> Executor:
    """The model in this process, loaded on the one thread that will run its steps."""
    def build() -> SyncExecutor:
        from fastserve.worker.executor import InProcessExecutor  # imports torch: only where the model lives
        from fastserve.worker.worker import assigned_device_index

        return InProcessExecutor(spec.model, assigned_device_index(spec.model.device))

    return await ThreadedExecutor.on_its_thread(build)


async def _pipeline_executor(spec: EngineSpec) -> Executor:
    """The Ray pipeline in this replica's placement group; stage s takes bundle 1 + s."""
    import ray

    from fastserve.worker.pipeline import PipelineExecutor

    # None outside a Serve replica: the executor then reserves its own group.
    group = ray.util.get_current_placement_group()
    executor = PipelineExecutor(spec, group, bundle_offset=0 if group is None else 1)
    await executor.start()
    return executor


def build_scheduler(args: AppArgs) -> Scheduler:
    from fastserve.worker.executor import resolve_dtype  # imports torch: only where the model lives

    profile = Profile.load(resolve_path(args.profile.path))
    warn_if_profile_dtype_differs(profile, args.profile.path, resolve_dtype(args.model.dtype, args.model.device))
    return Scheduler(args.scheduler, args.kv_cache, profile, eos_token_ids=args.model.eos_token_ids())


def build_grammars(args: AppArgs) -> JobGrammars:
    """Structured outputs' grammar state for this model's tokenizer (its token index is built
    at the first constrained request)."""
    model = args.model
    space = TokenSpace(model.tokenizer(), model.hf_config().vocab_size, model.eos_token_ids())
    config = args.engine.structured_outputs
    return JobGrammars(GrammarCompiler(space, config.compile_cache_size), config.mask_threads)


def warn_if_profile_dtype_differs(profile: Profile, path: str, dtype: str) -> None:
    """Skip-join places a job by its profiled first-iteration time in decode steps, a ratio that moves
    with the dtype; checked here, where ``auto`` is resolved for this machine."""
    if profile.dtype != dtype:
        warnings.warn(f"profile {path} was measured in {profile.dtype}, but this replica runs "
                      f"{dtype}: skip-join levels and quanta will be inaccurate "
                      f"(python -m fastserve.engine.profiler --dtype {dtype})", ProfileMismatchWarning, stacklevel=2)


class EngineReplica:
    """The body of the ``Engine`` deployment (``fastserve.main`` applies the Serve options)."""

    # Serve awaits an async constructor: the replica is ready only once its model is loaded.
    async def __init__(self, args: dict[str, Any] | AppArgs) -> None:  # type: ignore[misc]
        self.replica_id = _replica_id()
        if not self.replica_id.startswith(LOCAL_REPLICA):
            join_serve_logs()
        self.args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
        _check_environment(self.args.engine_env_vars())
        self.metrics = EngineMetrics(self.args.model.name, max_model_len=self.args.model.context_len())
        self.spec = self.args.engine_spec()
        executor = await build_executor(self.spec)
        # A lost pipeline (a stage worker died) is rebuilt in this replica's placement group.
        rebuild = (lambda: build_executor(self.spec)) if self.spec.parallel.uses_pipeline else None
        self.engine = AsyncEngine(build_scheduler(self.args), executor, config=self.args.engine, rebuild=rebuild,
                                  grammars=build_grammars(self.args))
        await self.engine.start()
        self._channels: dict[str, Channel] = {}   # ingress replica id → its delivery channel here
        self.stats_log = StatsLog(self.args.server.stats_log_interval_s, time.monotonic())
        self._sample_task = asyncio.get_running_loop().create_task(self._sample_metrics_forever())
        self._closed = False
        log.info("engine replica %s ready (%s, policy %s, swap %s)", self.replica_id,
                 self.args.model.name, self.args.scheduler.policy, self.args.kv_cache.swap_mode)

    @classmethod
    async def create(cls, args: dict[str, Any] | AppArgs) -> EngineReplica:
        """Construct outside Serve (tests, tools): Python cannot await a constructor itself."""
        replica = cls.__new__(cls)
        await replica.__init__(args)   # type: ignore[misc]
        return replica

    async def close(self) -> None:
        """Stop sampling and stop the engine (aborting open streams, shutting the executor)."""
        if self._closed:
            return
        self._closed = True
        self._sample_task.cancel()
        await self.engine.stop()
        for channel in list(self._channels.values()):   # their jobs were aborted: end the calls
            channel.close()
        try:   # the aborted jobs' accounting, and gauges that say "empty"
            self._sample_metrics()
        except Exception:   # metrics must never stop a shutdown
            log.exception("recording metrics at close failed")

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    async def generate(self, req: JobRequest, ingress_id: str = "") -> AsyncIterator[JobEvent]:
        """Stream one job's events: ``Accepted`` or ``Refused``, then its deltas, the last with its finish;
        with ``ingress_id``'s channel open here the deltas go there and this stream stays open, silent.
        Cancelling it aborts the job."""
        channel = self._channels.get(ingress_id) if ingress_id else None
        if channel is not None and channel.closed:   # ended idle; its subscribe call is returning
            channel = None
        try:
            await self.engine.prepare(req)
            if channel is not None:
                channel.open(req.job_id)
                self.engine.submit_to(req, channel)
            else:
                stream = self.engine.submit(req)
        except RequestError as exc:
            if channel is not None:
                channel.forget(req.job_id)
            if isinstance(exc, AdmissionQueueFull):
                self.metrics.rejected()
            yield Refused(req.job_id, exc.code, str(exc))
            return
        finished = False
        try:   # from here on, however the caller leaves, the job must not outlive it
            if channel is not None:
                yield Accepted(req.job_id, self.replica_id, channel.channel_id)
                await channel.wait_done(req.job_id)
                finished = True
                return
            yield Accepted(req.job_id, self.replica_id)
            async for delta in stream:
                merged = TokenDelta.merge([delta, *stream.ready()])
                finished = merged.finished
                yield replace(merged, emitted_at=time.time())
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(req.job_id)

    async def subscribe(self, ingress_id: str, channel_id: str,
                        pinned_replica: str) -> AsyncIterator[Message]:
        """An ingress replica's delivery channel: an empty message once open, then one per step with its
        jobs' deltas; ending it aborts them. It returns once idle for ``server.channel_idle_close_s``,
        since an open call is a request Serve's graceful shutdown waits for."""
        if pinned_replica != self.replica_id:
            raise ValueError(f"subscribe for replica {pinned_replica!r} reached replica {self.replica_id!r}")
        channel = Channel(channel_id, idle_close_s=self.args.server.channel_idle_close_s)
        replaced = self._channels.get(ingress_id)
        self._channels[ingress_id] = channel
        if replaced is not None:   # that ingress replica lost it and opened a new one
            self._close_channel(replaced)
        try:
            yield ()
            async for message in channel.messages():
                yield message
        finally:
            if self._channels.get(ingress_id) is channel:
                del self._channels[ingress_id]
            self._close_channel(channel)

    def _close_channel(self, channel: Channel) -> None:
        jobs = channel.job_ids
        channel.close()
        for job_id in jobs:
            self.engine.abort(job_id)

    def _record_finished(self) -> None:
        """Record the engine's timing and the finished jobs' accounting since the last tick."""
        timing = self.engine.timing.drain()
        self.metrics.record_timing(timing)
        self.stats_log.add_tokens(timing.prompt_tokens, timing.generation_tokens)
        for stats in self.scheduler.drain_finished():
            self.metrics.job_finished(stats)

    # ---- inspection ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """The scheduler's stats and the engine's step breakdown (tests, operators, the
        breakdown tool; not on the request path)."""
        return {**self.scheduler.stats(), "step_totals": self.engine.step_stats.totals(),
                "process_rss_bytes": process_rss_bytes(), "torch_threads": _torch_threads(),
                "omp_wait_policy": os.environ.get(OMP_WAIT_POLICY_ENV),
                "delivery_channels": {ingress: len(channel.job_ids) for ingress, channel in self._channels.items()},
                "rebuilds": self.engine.rebuilds, "gemm_choice": _gemm_choice(self.spec)}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """Forget this replica's cached KV blocks (``POST /reset_prefix_cache``)."""
        return {"reset_blocks": self.scheduler.reset_prefix_cache()}

    async def replica_info(self) -> dict[str, Any]:
        """This replica's Ray actor id and Serve replica id (tests, operators)."""
        import ray

        return {"actor_id": ray.get_runtime_context().get_actor_id(), "replica_id": self.replica_id}

    def _sample_metrics(self) -> None:
        self._record_finished()
        self.metrics.sample(self.scheduler)
        self._log_stats()

    def _log_stats(self) -> None:
        """The stats line (``fastserve.engine.stats_log``), when one is due."""
        totals = self.scheduler.totals
        line = self.stats_log.observe(scheduler_gauges(self.scheduler), totals["prefix_cache_hits"],
                                      totals["prefix_cache_queries"], time.monotonic())
        if line is not None:
            log.log(self.stats_log.level(line), "%s", line)

    async def _sample_metrics_forever(self) -> None:
        interval = self.args.server.metrics_sample_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                self._sample_metrics()
            except Exception:   # metrics must never take the replica down
                log.exception("recording metrics failed")

    async def check_health(self) -> None:
        """Serve restarts a replica whose check fails: the way a dead pipeline or a stuck step
        gets a fresh replica."""
        problem = self.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    def health_problem(self) -> str | None:
        # A stage worker died (PipelineExecutor). While the engine rebuilds the pipeline its jobs
        # wait to resume on the new one: replacing the replica then would fail them all.
        if getattr(self.engine.executor, "closed", False) and not self.engine.recovering:
            return "the executor is closed"
        return self.engine.health()

    async def health(self) -> dict[str, Any]:
        """For the ingress's ``/health``: ``{"healthy": bool, "problem": str | None}``."""
        problem = self.health_problem()
        return {"healthy": problem is None, "problem": problem}

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve's graceful shutdown calls this on the replica's event loop and awaits what it
        returns; Python's garbage collector calls it too, outside a loop, and gets None (an
        ``async def __del__`` would leave it an un-awaited coroutine)."""
        if getattr(self, "_closed", True):
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self.close()


def _check_environment(wanted: dict[str, str]) -> None:
    """Say so when the environment the config asks for is not this process's: a YAML whose
    ``deployments:`` entry sets its own ``ray_actor_options`` replaces the ``runtime_env`` that
    carried it, and libgomp read its settings when torch loaded (too late to set them here)."""
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            log.warning("%s is %r in this engine replica, not %r as the config asks (under Serve: "
                        "a ray_actor_options set for the Engine in the YAML replaced the builder's "
                        "runtime_env; add runtime_env: {env_vars: {%s: %s}} there; outside Serve: "
                        "set it in the environment before starting)", name, os.environ.get(name),
                        value, name, value)


def _gemm_choice(spec: EngineSpec) -> dict[str, Any] | None:
    """The CPU GEMM path chosen per linear shape, where the model runs in this process (the
    Ray pipeline's stage workers log theirs at start)."""
    if spec.parallel.uses_pipeline:
        return None
    from fastserve.worker.model.gemm_choice import report  # torch: already loaded by the executor here

    return report()


def _torch_threads() -> int:
    """Intra-op threads torch uses in this process (Ray sets OMP_NUM_THREADS=1 in a replica that
    reserves no CPU; ``parallel.torch_threads`` overrides it)."""
    import torch  # already loaded by the executor in this process

    return int(torch.get_num_threads())


def process_rss_bytes() -> int | None:
    """This process's resident memory (Linux), for operators watching a replica grow."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:   # not inside a Serve replica (offline runs, tests)
        return f"{LOCAL_REPLICA}{uuid.uuid4().hex[:8]}"

