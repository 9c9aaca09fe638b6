"""The Serve application's configuration: ``AppArgs``, the ``args`` of every ``config/*.yaml``.

Owns the top-level schema that Serve validates a YAML's ``args`` with (``app.main:build_app``),
composed of the control plane's own models (``SchedulerConfig``, ``KVCacheConfig``,
``EngineConfig`` from ``app.scheduler.config``, imported, never duplicated) plus the model, the
parallel layout, the profile and the HTTP server. Serve's deployment options (replicas,
autoscaling, ``max_ongoing_requests``, actor options) are not here: they belong in the YAML's
standard ``deployments:`` section, over the defaults ``INGRESS_DEFAULTS``/``SCHEDULER_DEFAULTS``
(Serve hashes ``args`` into the code version, so an option here would restart model copies). Every model is strict
(``extra="forbid"``) so a misspelt key fails naming itself, and cross-field checks reject
impossible sizes (TP·PP ≠ GPUs requested, a block size that does not divide the context, pools
or token budgets too small for one max-length request) before anything is deployed.

Relative paths are resolved against the project root (not the working directory): Serve
replicas and the application builder run in Ray worker processes with their own cwd.

Pass ``context={"require_profile": False}`` to ``AppArgs.model_validate`` to skip the existence
check of the profile file. Only the schema test does that, for the GPU configs whose profiles
come from the simulator; a running server always requires its profile.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from actors.messages import blocks_for
from actors.model.config import ModelConfig, load_model_config
from actors.spec import EngineSpec, ModelSpec, ParallelSpec, PipelineTimeouts
from app.drain import DrainArgs, graceful_shutdown_timeout_s
from app.generation_config import CONFIG_FILE, eos_token_ids
from app.scheduler.config import EngineConfig, KVCacheConfig, SchedulerConfig
from app.scheduler.profile import Profile
from app.tokenizer import Tokenizer, load_tokenizer

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: Environment variable that supplies (or overrides) the API key.
API_KEY_ENV = "FASTSERVE_API_KEY"
#: Validation-context key that lets the schema test skip the profile file check.
REQUIRE_PROFILE_CONTEXT = "require_profile"

Device = Literal["cpu", "cuda"]
#: ``auto``: bfloat16 where the device computes it natively (CPU: AVX-512 BF16 or AMX, read from
#: /proc/cpuinfo), float32 on other CPUs (``actors.executor.resolve_dtype``).
DType = Literal["auto", "float32", "float16", "bfloat16"]
LoadFormat = Literal["dummy", "auto"]


class ProfileMismatchWarning(UserWarning):
    """The profile was measured on another layout (TP, PP or block size) than the config's."""


def resolve_path(path: str | Path) -> Path:
    """An absolute path as is; a relative one under the project root."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArgs(_Strict):
    """Which model a replica serves and how its weights are made."""

    #: The id clients put in ``model`` and that ``/v1/models`` lists.
    name: str = Field(min_length=1)
    #: A Hugging Face ``config.json`` (or the directory holding it).
    config_path: str
    tokenizer_path: str = "config/tokenizers/opt"
    load_format: LoadFormat = "dummy"
    #: Checkpoint directory or hub id; required by ``load_format: auto``.
    model_path: str | None = None
    dtype: DType = "float32"
    device: Device = "cpu"
    seed: int = Field(default=0, ge=0)
    #: Cap on prompt + generated tokens; None = the model's ``max_position_embeddings``.
    max_model_len: int | None = Field(default=None, ge=1)

    @field_validator("config_path", "tokenizer_path")
    @classmethod
    def _exists(cls, value: str) -> str:
        if not resolve_path(value).exists():
            raise ValueError(f"path {value!r} does not exist (resolved to {resolve_path(value)})")
        return value

    @field_validator("tokenizer_path")
    @classmethod
    def _loads(cls, value: str) -> str:
        """Refuse at start a folder whose tokenizer (or chat template) cannot be loaded."""
        load_tokenizer(resolve_path(value))   # TokenizerLoadError names the path and reason
        return value

    @model_validator(mode="after")
    def _weights(self) -> ModelArgs:
        if self.load_format == "auto" and not self.model_path:
            raise ValueError("load_format 'auto' needs model_path (a checkpoint directory or hub id)")
        return self

    def hf_config(self) -> ModelConfig:
        """The model's config, of the architecture its ``config.json`` names (OPT or LLaMA)."""
        return load_model_config(resolve_path(self.config_path))

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (loaded once per process)."""
        return load_tokenizer(resolve_path(self.tokenizer_path))

    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a job: generation_config.json (in the config or model folder),
        else config.json's eos_token_id, else the tokenizer's eos_token."""
        config = resolve_path(self.config_path)
        folders = [config] if config.is_dir() else ([config.parent] if config.name == CONFIG_FILE else [])
        if self.model_path and resolve_path(self.model_path).is_dir():
            folders.append(resolve_path(self.model_path))
        config_file = config / CONFIG_FILE if config.is_dir() else config
        return eos_token_ids(folders, config_file, self.tokenizer().eos_token_id)

    def context_len(self) -> int:
        """The longest prompt + output a request may have."""
        limit = self.hf_config().max_position_embeddings
        return limit if self.max_model_len is None else self.max_model_len


class ParallelArgs(_Strict):
    """How one model copy is split: TP ranks per stage × PP stages, and the GPUs that takes."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    #: Run stage-worker actors (the Ray pipeline) even for TP·PP = 1.
    use_ray_pipeline: bool = False
    #: GPUs one model copy requests; must be TP·PP on cuda and 0 on cpu.
    num_gpus: int = Field(default=0, ge=0)
    #: Plans the pipeline keeps in flight; None = one per stage (paper §4.3).
    max_inflight: int | None = Field(default=None, ge=1)
    #: How plans travel between stage workers: a Ray compiled graph, or plain actor calls.
    transport: Literal["compiled", "actor"] = "compiled"
    #: Logical CPUs each stage worker (one TP rank) reserves; a stage's bundle holds TP of them.
    worker_cpus: float = Field(default=0.01, gt=0)
    #: torch intra-op threads of each process that runs the model (the in-process executor, or
    #: each stage worker). None keeps what Ray set: OMP_NUM_THREADS = the CPUs the actor
    #: reserved, i.e. 1 for a replica that reserves none (the demo's), whatever the cores.
    torch_threads: int | None = Field(default=None, ge=1)
    #: Resources of the Scheduler replica's own bundle (bundle 0 of each model copy's placement
    #: group); GPUs are added for an in-process model on cuda. It must hold the replica's
    #: ``ray_actor_options`` (``deployments:`` in the YAML). A sliver keeps a 2-core box schedulable.
    replica_bundle: dict[str, float] = Field(default_factory=lambda: {"CPU": 0.01})

    @field_validator("replica_bundle")
    @classmethod
    def _some_resource(cls, value: dict[str, float]) -> dict[str, float]:
        if not any(v > 0 for v in value.values()):
            raise ValueError(f"replica_bundle {value} must reserve some resource")
        return value

    def spec(self) -> ParallelSpec:
        """What the data plane is given (it answers ``world_size`` and ``uses_pipeline``)."""
        return ParallelSpec(self.tensor_parallel_size, self.pipeline_parallel_size, self.transport,
                            self.max_inflight, self.worker_cpus, self.use_ray_pipeline)

    @property
    def world_size(self) -> int:
        return self.spec().world_size

    @property
    def uses_pipeline(self) -> bool:
        return self.spec().uses_pipeline


_WAITS = PipelineTimeouts()


class PipelineArgs(_Strict):
    """The Ray pipeline's waits and its compiled-graph channel size (defaults: ``PipelineTimeouts``)."""

    #: Compiled-graph channel size: above the largest activation message (else Ray resizes it).
    channel_buffer_bytes: int = Field(default=_WAITS.channel_buffer_bytes, ge=1024)
    #: How long the stage workers' placement group may take to be placed.
    placement_timeout_s: float = Field(default=_WAITS.placement_timeout_s, gt=0)
    #: How long the stage workers may take to start (weights loaded).
    startup_timeout_s: float = Field(default=_WAITS.startup_timeout_s, gt=0)
    #: TP rendezvous timeout, also gloo/NCCL's collective timeout (a rank whose peer died).
    tp_timeout_s: float = Field(default=_WAITS.tp_timeout_s, gt=0)
    #: While a plan is overdue by this much, the workers are pinged to tell slow from dead.
    liveness_interval_s: float = Field(default=_WAITS.liveness_interval_s, gt=0)
    ping_timeout_s: float = Field(default=_WAITS.ping_timeout_s, gt=0)
    #: A live worker that answers no ping for this long (wedged) fails the pipeline.
    unresponsive_s: float = Field(default=_WAITS.unresponsive_s, gt=0)
    #: After a transport error, how long to keep probing for the worker death behind it.
    diagnose_s: float = Field(default=_WAITS.diagnose_s, ge=0)
    #: How long tearing the graph and the workers down may take.
    teardown_timeout_s: float = Field(default=_WAITS.teardown_timeout_s, gt=0)

    def timeouts(self) -> PipelineTimeouts:
        return PipelineTimeouts(**self.model_dump())


class ProfileArgs(_Strict):
    """The job profiler's output the scheduler interpolates (``python -m app.profiler``)."""

    path: str

    @field_validator("path")
    @classmethod
    def _exists(cls, value: str, info: ValidationInfo) -> str:
        required = (info.context or {}).get(REQUIRE_PROFILE_CONTEXT, True)
        if required and not resolve_path(value).is_file():
            raise ValueError(
                f"profile file {value!r} not found (resolved to {resolve_path(value)}); "
                "write it with `python -m app.profiler`"
            )
        return value


class ServerArgs(_Strict):
    """HTTP behaviour of the ingress."""

    #: Bearer token clients must send; None = open (env FASTSERVE_API_KEY, if set, wins).
    api_key: str | None = None
    #: ``Retry-After`` seconds sent with a 429 when the admission queue is full.
    retry_after_s: int = Field(default=1, ge=0)
    #: Refuse to start without an API key (set it for every config that binds a non-loopback host).
    require_api_key: bool = False
    #: Largest request body accepted; larger ones get a 413 before being read whole.
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    #: OpenAI ``stop``: how many strings a request may send, and how long each may be.
    max_stop_strings: int = Field(default=16, ge=1)
    max_stop_string_chars: int = Field(default=256, ge=1)
    #: OpenAI ``n``: most choices one request may ask for (each is its own job).
    max_choices: int = Field(default=16, ge=1)
    #: A request still generating after this long ends with a timeout error (and its job is
    #: aborted), whatever the client asked for.
    request_timeout_s: float = Field(default=600.0, gt=0)
    #: Longest a request waits for its job's first output (admission and first iteration); past
    #: it the job is dropped and the client gets a 429 with Retry-After.
    admission_timeout_s: float = Field(default=60.0, gt=0)
    #: Honour the request ``priority`` field (it moves a job's MLFQ entry level, so any caller
    #: could jump the queue); off by default.
    allow_priority: bool = False
    #: Offer ``POST /reset_prefix_cache`` (vLLM's): every cached KV block not in use is
    #: forgotten (benchmarks, or after a weight change). Off by default, and to stay off in any
    #: config that binds beyond loopback: any caller could empty the cache of every user.
    allow_reset_prefix_cache: bool = False
    #: How long ``/health`` waits for a scheduler replica to answer before reporting 503.
    health_timeout_s: float = Field(default=5.0, gt=0)
    #: How often each scheduler replica records its state gauges and mirrored counters (Ray
    #: then exports them every ``RAY_metrics_report_interval_ms``).
    metrics_sample_interval_s: float = Field(default=0.5, gt=0)
    #: Deliver tokens on one channel per ingress replica and scheduler replica, one message per
    #: step (``app.delivery``), instead of on each job's own stream (one message per job per step).
    delivery_channels: bool = True
    #: How long an ingress replica waits for a new delivery channel to open; one that did not is
    #: retried after as long (its jobs use their own streams meanwhile).
    channel_open_timeout_s: float = Field(default=5.0, gt=0)
    #: A scheduler replica ends a delivery channel that had no job on it for this long (the
    #: ingress opens another with its next job there). An open channel is a request in flight,
    #: and Serve's graceful shutdown of a replica waits for every one: this bounds how long an
    #: idle channel keeps a drained replica alive after its last stream.
    channel_idle_close_s: float = Field(default=2.0, gt=0)
    #: How long ``GET /metrics`` waits for each node's Ray metrics agent.
    metrics_agent_timeout_s: float = Field(default=5.0, gt=0)

    def resolved_api_key(self) -> str | None:
        key = os.environ.get(API_KEY_ENV) or self.api_key
        if key is None and self.require_api_key:
            raise ValueError(f"server.require_api_key is set but no API key is configured: set "
                             f"server.api_key or the {API_KEY_ENV} environment variable")
        return key


class AppArgs(_Strict):
    """Everything ``build_app`` needs; the ``args`` of a Serve YAML."""

    model: ModelArgs
    parallel: ParallelArgs = Field(default_factory=ParallelArgs)
    profile: ProfileArgs
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pipeline: PipelineArgs = Field(default_factory=PipelineArgs)
    server: ServerArgs = Field(default_factory=ServerArgs)
    drain: DrainArgs = Field(default_factory=DrainArgs)

    @model_validator(mode="after")
    def _consistent(self) -> AppArgs:
        self._check_parallel()
        self._check_sizes()
        self._check_profile()
        return self

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

    # ---- what the data plane is given ----------------------------------------------------

    def engine_spec(self) -> EngineSpec:
        """The one spec of this model copy — model, KV pools, layout, pipeline waits — that the
        executors and every stage worker are given whole."""
        m, kv = self.model, self.kv_cache
        model = ModelSpec(resolve_path(m.config_path), kv.num_device_blocks, kv.num_host_blocks,
                          kv.block_size, m.dtype, m.device, m.seed, m.load_format, m.model_path,
                          self.parallel.torch_threads)
        return EngineSpec(model, self.parallel.spec(), self.pipeline.timeouts())

    # ---- derived deployment settings ------------------------------------------------------

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """One bundle for the scheduler replica, then the pipeline's stage bundles (the very ones
        ``actors.pipeline`` places its stages in: ``ParallelSpec.stage_bundles``)."""
        par = self.parallel
        replica = dict(par.replica_bundle)
        if not par.uses_pipeline:
            if par.num_gpus:
                replica["GPU"] = replica.get("GPU", 0.0) + par.num_gpus
            return [replica]
        return [replica] + par.spec().stage_bundles(self.model.device)

    def scheduler_deployment_defaults(self) -> dict[str, Any]:
        """Serve options of the ``Scheduler`` deployment before the YAML's ``deployments:``.

        The placement group is derived from the model's layout; the rest are plain defaults that
        ``deployments: [{name: Scheduler, ...}]`` overrides without restarting replicas (except
        ``ray_actor_options`` and the placement group: Serve applies those by starting new replicas).
        """
        actor_options: dict[str, Any] = dict(SCHEDULER_DEFAULTS["ray_actor_options"])
        if not self.parallel.uses_pipeline and self.parallel.num_gpus:
            actor_options["num_gpus"] = self.parallel.num_gpus   # the in-process model's GPUs
        return {**SCHEDULER_DEFAULTS, "ray_actor_options": actor_options,
                "placement_group_bundles": self.placement_group_bundles(),
                "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s(self)}

    def ingress_deployment_defaults(self) -> dict[str, Any]:
        """Serve options of the ``Ingress`` deployment: it drains a stream as long as the Scheduler."""
        return {**INGRESS_DEFAULTS, "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s(self)}


#: Serve options the builder gives the ``Ingress`` deployment; the YAML's ``deployments:``
#: section overrides any of them (num_replicas, autoscaling_config, max_ongoing_requests, ...).
INGRESS_DEFAULTS: dict[str, Any] = {
    # Above every scheduler's admission limit (waiting + running), so overload is answered by
    # the scheduler with a 429 + Retry-After rather than queued at Serve's proxy.
    "max_ongoing_requests": 1024,
    # Serve's own last-resort bound on requests queued for an ingress replica (it answers 503
    # past it); with the defaults above it is not reached before admission control answers 429.
    "max_queued_requests": 1024,
    # Tokenizing and streaming need little CPU; 0 keeps a 2-core box schedulable.
    "ray_actor_options": {"num_cpus": 0},
}
#: Serve options the builder gives the ``Scheduler`` deployment (one replica = one model copy).
SCHEDULER_DEFAULTS: dict[str, Any] = {
    # Streams one replica accepts; beyond it Serve queues at the handle, outside admission control.
    "max_ongoing_requests": 1024,
    "ray_actor_options": {"num_cpus": 0},
    "placement_group_strategy": "PACK",
}
