"""The Serve application's configuration: ``AppArgs``, the ``args`` of every ``config/*.yaml``.

Composes the control plane's configs (``fastserve.scheduler.config``) with the sections in the
``config_*`` modules beside it; every model forbids unknown keys, and cross-field checks refuse
impossible layouts and sizes before anything is deployed. Serve's deployment options live in the
YAML's ``deployments:`` over ``INGRESS_DEFAULTS``/``ENGINE_DEFAULTS``, not here: Serve hashes
``args`` into the code version. ``context={"require_profile": False}`` skips the profile file check.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, model_validator

from fastserve.config_drain import DrainArgs, profile_tpot_s
from fastserve.config_layout import ParallelArgs
from fastserve.config_model import ModelArgs, ProfileArgs, Strict, resolve_path
from fastserve.config_server import ServerArgs
from fastserve.gpu_kinds import load_gpu_table
from fastserve.scheduler.config import LEVELLED_POLICIES, EngineConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.profile import Profile
from fastserve.worker.messages import DEFAULT_BLOCK_SIZE, blocks_for
from fastserve.worker.spec import OMP_WAIT_POLICY_ENV, EngineSpec, ModelSpec, PipelineTimeouts

GIB = 1 << 30


class ProfileMismatchWarning(UserWarning):
    """The profile was measured on another TP, PP or block size than the config's."""


class AppArgs(Strict):
    """Everything ``build_app`` needs; the ``args`` of a Serve YAML."""

    model: ModelArgs
    parallel: ParallelArgs = Field(default_factory=ParallelArgs)
    profile: ProfileArgs
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pipeline: PipelineTimeouts = Field(default_factory=PipelineTimeouts)
    server: ServerArgs = Field(default_factory=ServerArgs)
    drain: DrainArgs = Field(default_factory=DrainArgs)

    @model_validator(mode="before")
    @classmethod
    def _pools_from_memory(cls, data: Any) -> Any:
        """The block counts ``kv_cache``'s memory sizes buy for this model on this machine."""
        if not isinstance(data, dict) or not isinstance(data.get("kv_cache"), dict):
            return data
        kv = dict(data["kv_cache"])
        sized = [(tier, gib) for tier in ("device", "host") if (gib := kv.get(f"{tier}_memory_gib")) is not None]
        if not sized:
            return data
        model = ModelArgs.model_validate(data.get("model"))
        block = model.kv_bytes_per_block(int(kv.get("block_size", DEFAULT_BLOCK_SIZE)))
        for tier, gib in sized:
            if kv.get(f"num_{tier}_blocks") is not None:
                raise ValueError(f"kv_cache: set num_{tier}_blocks or {tier}_memory_gib, not both "
                                 f"(got {kv[f'num_{tier}_blocks']} and {gib})")
            kv[f"num_{tier}_blocks"] = int(float(gib) * GIB // block)
        return {**data, "kv_cache": kv}

    def replica_args(self) -> dict[str, Any]:
        """These args as replicas get them: memory-sized block counts unset, for each to work out."""
        raw = self.model_dump(mode="json")
        for tier in ("device", "host"):
            if raw["kv_cache"][f"{tier}_memory_gib"] is not None:
                del raw["kv_cache"][f"num_{tier}_blocks"]
        return raw

    @model_validator(mode="after")
    def _consistent(self) -> AppArgs:
        self._check_parallel()
        self._check_sizes()
        self._check_profile()
        self._check_priority()
        self._check_batch_invariant()
        return self

    def _check_batch_invariant(self) -> None:
        """Batch invariance needs our CPU kernels and KV computed once (recompute re-sums it)."""
        if not self.engine.batch_invariant:
            return
        if self.model.device != "cpu":
            raise ValueError(f"engine.batch_invariant runs on our CPU kernels; model.device is {self.model.device!r}")
        if self.kv_cache.swap_mode == "recompute":
            raise ValueError("engine.batch_invariant with kv_cache.swap_mode 'recompute': a recomputed job's tokens "
                             "would be prefilled where they were decoded, in another summation order; use "
                             "'proactive' or 'reactive'")

    def _check_priority(self) -> None:
        """A one-level policy would accept ``priority`` and change nothing: refused at start."""
        policy = self.scheduler.policy
        if self.server.allow_priority and policy not in LEVELLED_POLICIES:
            raise ValueError(f"server.allow_priority is on but scheduler.policy '{policy}' has one level, so a "
                             f"request's priority would change nothing: use one of {sorted(LEVELLED_POLICIES)} "
                             "or turn allow_priority off")

    def _check_profile(self) -> None:
        """The profile should describe this layout: its timings drive skip-join and the quanta."""
        path = resolve_path(self.profile.path)
        if not path.is_file():   # only possible when the caller waived the file check
            return
        prof = Profile.load(path)
        want = {"tp": self.parallel.tensor_parallel_size, "pp": self.parallel.pipeline_parallel_size,
                "block_size": self.kv_cache.block_size}
        for key, value in want.items():
            if getattr(prof, key) != value:
                # Not fatal: a CPU pipeline demo has no profile of its own; the quanta are off.
                warnings.warn(f"profile {self.profile.path} was measured with {key}={getattr(prof, key)}, "
                              f"but this config has {key}={value}: skip-join levels and quanta will be "
                              "inaccurate", ProfileMismatchWarning, stacklevel=2)

    def _check_parallel(self) -> None:
        par, model = self.parallel, self.model
        if model.device == "cuda" and par.num_gpus != par.world_size:
            raise ValueError(
                f"parallel.num_gpus={par.num_gpus} but tensor_parallel_size={par.tensor_parallel_size} "
                f"× pipeline_parallel_size={par.pipeline_parallel_size} = {par.world_size}: "
                "each TP rank of each stage takes exactly one GPU"
            )
        if model.device == "cpu" and par.num_gpus:
            raise ValueError(f"parallel.num_gpus={par.num_gpus} but model.device is 'cpu'")
        if par.gpu_kind is not None:
            if model.device != "cuda":
                raise ValueError(f"parallel.gpu_kind={par.gpu_kind!r} but model.device is {model.device!r}")
            load_gpu_table().kind(par.gpu_kind)   # refuses an unknown kind
        par.spec().check(model.hf_config())

    def _check_sizes(self) -> None:
        ctx = self.model.context_len()
        positions = self.model.hf_config().max_position_embeddings
        if ctx > positions:
            raise ValueError(f"model.max_model_len={ctx} exceeds the model's {positions} positions")
        kv = self.kv_cache
        if ctx % kv.block_size:
            raise ValueError(
                f"kv_cache.block_size={kv.block_size} does not divide the context length {ctx}"
            )
        need = blocks_for(ctx, kv.block_size)
        usable = kv.num_device_blocks - kv.reserved_blocks
        if usable < need:
            raise ValueError(
                f"kv_cache.num_device_blocks={kv.num_device_blocks} (minus reserved_blocks="
                f"{kv.reserved_blocks}) is too small for one max-length request: {ctx} tokens "
                f"need {need} blocks of {kv.block_size}"
            )
        if kv.swap_mode != "recompute" and kv.num_host_blocks < need:
            raise ValueError(
                f"kv_cache.num_host_blocks={kv.num_host_blocks} is too small to swap out one "
                f"max-length request ({need} blocks)"
            )
        if self.scheduler.max_num_batched_tokens < ctx and not self.scheduler.chunked_prefill.enabled:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.scheduler.max_num_batched_tokens} is below the "
                f"context length {ctx}: a max-length prompt could never run its first iteration (raise it, or "
                "enable scheduler.chunked_prefill)"
            )

    def engine_spec(self) -> EngineSpec:
        m, kv = self.model, self.kv_cache
        model = ModelSpec(resolve_path(m.config_path), kv.num_device_blocks, kv.num_host_blocks,
                          kv.block_size, m.dtype, m.device, m.seed, m.load_format, m.model_path,
                          self.parallel.torch_threads, m.cuda_graphs, m.cuda_graph_max_batch,
                          m.cuda_graph_max_context, self.engine.gemm_choice, self.engine.batch_invariant)
        return EngineSpec(model, self.parallel.spec(), self.pipeline)

    def placement_group_bundles(self) -> list[dict[str, float]]:
        par = self.parallel
        replica = dict(par.replica_bundle)
        if not par.uses_pipeline:
            if par.num_gpus:
                replica["GPU"] = replica.get("GPU", 0.0) + par.num_gpus
            return [replica]
        return [replica] + par.spec().stage_bundles(self.model.device)

    def engine_deployment_defaults(self) -> dict[str, Any]:
        """Serve options of the ``Engine`` deployment before the YAML's ``deployments:``."""
        actor_options: dict[str, Any] = dict(ENGINE_DEFAULTS["ray_actor_options"])
        if not self.parallel.uses_pipeline and self.parallel.num_gpus:
            actor_options["num_gpus"] = self.parallel.num_gpus
        env = self.engine_env_vars()
        if env:
            actor_options["runtime_env"] = {"env_vars": env}
        return {**ENGINE_DEFAULTS, "ray_actor_options": actor_options,
                "placement_group_bundles": self.placement_group_bundles(),
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s()}

    def graceful_shutdown_timeout_s(self) -> float:
        """A context-length stream at the profile's full-batch decode step, unless ``drain:`` says."""
        d = self.drain
        context = d.max_tokens if d.max_tokens is not None else self.model.context_len()
        tpot = d.tpot_s if d.tpot_s is not None else profile_tpot_s(self.profile.path, self.scheduler.max_batch_size)
        return d.timeout_s(context, tpot, self.server.request_timeout_s)

    def engine_env_vars(self) -> dict[str, str]:
        """Environment an Engine replica (and its stage workers) needs before torch loads."""
        policy = self.parallel.omp_wait_policy
        return {OMP_WAIT_POLICY_ENV: policy.upper()} if policy else {}

    def ingress_deployment_defaults(self) -> dict[str, Any]:
        return {**INGRESS_DEFAULTS, "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s()}


#: Defaults the YAML's ``deployments:`` section overrides.
INGRESS_DEFAULTS: dict[str, Any] = {
    # Above every admission limit, so overload is a 429 from the scheduler, not a proxy queue.
    "max_ongoing_requests": 1024,
    "max_queued_requests": 1024,
    # Tokenizing and streaming need little CPU; 0 keeps a small node schedulable.
    "ray_actor_options": {"num_cpus": 0},
}
ENGINE_DEFAULTS: dict[str, Any] = {
    # Streams one replica accepts; beyond it Serve queues at the handle, outside admission control.
    "max_ongoing_requests": 1024,
    "ray_actor_options": {"num_cpus": 0},
    "placement_group_strategy": "PACK",
}
