"""Every tunable of the scheduler, the KV-cache manager and the engine loop, with the paper's
default where it gives one (§4.1–4.2). Models are strict: a misspelt key fails loudly."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastserve.worker.messages import DEFAULT_BLOCK_SIZE

PolicyName = Literal["skip_join_mlfq", "naive_mlfq", "fixed_priority", "fcfs", "srpt_oracle"]
SwapMode = Literal["proactive", "reactive", "recompute"]
GemmChoiceMode = Literal["cached", "measure", "fixed"]

POLICIES: tuple[PolicyName, ...] = (
    "skip_join_mlfq", "naive_mlfq", "fixed_priority", "fcfs", "srpt_oracle",
)
SWAP_MODES: tuple[SwapMode, ...] = ("proactive", "reactive", "recompute")
#: Where a request's ``priority`` shifts the entry level.
LEVELLED_POLICIES: frozenset[PolicyName] = frozenset({"skip_join_mlfq", "naive_mlfq"})


def alpha_from_slo(per_token_slo_s: float, decode_time_s: float = 0.0) -> float:
    """α = SLO − one decode iteration: a starved job's token gap (α, then one iteration) meets the SLO."""
    if per_token_slo_s <= 0:
        raise ValueError(f"per_token_slo_s must be > 0, got {per_token_slo_s}")
    if decode_time_s < 0:
        raise ValueError(f"decode_time_s must be >= 0, got {decode_time_s}")
    alpha = per_token_slo_s - decode_time_s
    if alpha <= 0:
        raise ValueError(
            f"per-token SLO {per_token_slo_s} s leaves no waiting time after one decode "
            f"iteration of {decode_time_s} s; α would be {alpha}"
        )
    return alpha


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChunkedPrefillConfig(_Strict):
    """A first iteration longer than a chunk runs as several; only the last chunk samples."""

    enabled: bool = False
    chunk_tokens: int = Field(default=512, ge=1)


class SchedulerConfig(_Strict):
    """Scheduling policy (paper §4.1, Algorithm 1)."""

    policy: PolicyName = "skip_join_mlfq"
    #: B: jobs per iteration.
    max_batch_size: int = Field(default=16, ge=1)
    #: Tokens one iteration feeds: a first iteration its prompt, a decode 1.
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    #: α: a job unserved this long is promoted to level 1 (paper: 300 ms).
    starvation_alpha_s: float = Field(default=0.3, gt=0)
    #: α's floor in profiled decode iterations at B (paper's ratio: 300 ms ≈ 10 OPT-13B iterations).
    starvation_min_iterations: float = Field(default=10.0, ge=0)
    #: α × this per earlier promotion, so overload does not turn MLFQ into round-robin (1 = paper).
    starvation_backoff: float = Field(default=64.0, ge=1)
    #: α's floor in rounds of the backlog ahead (jobs at or above its level ÷ B × measured step); 0: off.
    starvation_backlog_batches: float = Field(default=2.0, ge=0)
    step_time_ewma_weight: float = Field(default=0.1, gt=0, le=1)
    #: naive_mlfq: cut a first iteration at the quantum, losing its work (Figure 7(b)); False runs it whole.
    naive_preempts_first_iteration: bool = True
    #: Memory preemption takes KV only from jobs at least this many levels below (1: paper).
    preemption_level_gap: int = Field(default=1, ge=1)
    #: η: levels a job moves down when it exhausts its quantum.
    demotion_eta: int = Field(default=1, ge=1)
    #: q(i+1) = growth · q(i).
    quantum_growth: float = Field(default=2.0, gt=1)
    #: Number of MLFQ levels; None = enough that q_n ≥ the largest profiled t_init.
    num_levels: int | None = Field(default=None, ge=1)
    #: Unadmitted jobs beyond which ``add`` raises AdmissionQueueFull.
    admission_queue_limit: int = Field(default=100_000, ge=1)
    finished_stats_limit: int = Field(default=10_000, ge=0)
    chunked_prefill: ChunkedPrefillConfig = Field(default_factory=ChunkedPrefillConfig)

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> SchedulerConfig:
        chunk = self.chunked_prefill
        if chunk.enabled and chunk.chunk_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"chunked_prefill.chunk_tokens={chunk.chunk_tokens} exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens}: no iteration could "
                "give a chunk that many tokens"
            )
        return self

    def chunk_limit(self) -> int | None:
        """Most tokens one prefill chunk may feed; None when chunking is off."""
        return self.chunked_prefill.chunk_tokens if self.chunked_prefill.enabled else None


class KVCacheConfig(_Strict):
    """Paged KV cache in two tiers and how it is swapped (paper §4.2)."""

    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1)
    num_device_blocks: int = Field(ge=1)
    num_host_blocks: int = Field(default=0, ge=0)
    #: Or size a tier in GiB of the whole model copy's KV (vLLM's ``VLLM_CPU_KVCACHE_SPACE``).
    device_memory_gib: float | None = Field(default=None, gt=0)
    host_memory_gib: float | None = Field(default=None, gt=0)
    #: proactive: ENST-driven prefetch/offload (paper); reactive: swap on demand; recompute: drop.
    swap_mode: SwapMode = "proactive"
    #: Plans a job swapped in for its turn is safe from swap-out (bounded, so it cannot squat).
    swap_pin_plans: int = Field(default=2, ge=0)
    #: Prefetch leaves this many iterations' decode growth free, or the next growth evicts what it brought.
    prefetch_headroom_iterations: int = Field(default=1, ge=0)
    #: Automatic prefix caching (``fastserve.kv.prefix``).
    prefix_caching: bool = True
    #: Cached blocks evicted from the device move to the host while it has room.
    host_prefix_cache: bool = True
    #: Seeds every block hash: what else the KV depends on (set it if a cache may outlive a weight change).
    prefix_cache_key: str = ""
    #: Burst slots: device blocks kept free for arrivals (§4.2), optionally sized from recent ones.
    reserved_blocks: int = Field(default=0, ge=0)
    adaptive_reserve: bool = False
    adaptive_window_s: float = Field(default=1.0, gt=0)
    #: None: the recent arrivals' own prompt blocks.
    adaptive_blocks_per_arrival: float | None = Field(default=None, gt=0)
    adaptive_max_fraction: float = Field(default=0.25, ge=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> KVCacheConfig:
        if self.reserved_blocks >= self.num_device_blocks:
            raise ValueError(
                f"reserved_blocks={self.reserved_blocks} must be smaller than "
                f"num_device_blocks={self.num_device_blocks}"
            )
        if self.swap_mode != "recompute" and self.num_host_blocks == 0:
            raise ValueError(
                f"swap_mode={self.swap_mode!r} swaps to host memory but num_host_blocks=0; "
                "give the host pool blocks or use swap_mode='recompute'"
            )
        return self


class StructuredOutputsConfig(_Strict):
    """Structured outputs' grammar engine (``fastserve.structured``, llguidance)."""

    #: The wait for one constraint's compile before a 400 (llguidance's own limits bound the work).
    compile_timeout_s: float = Field(default=10.0, gt=0)
    #: Distinct compiled constraints kept, least recently used out first.
    compile_cache_size: int = Field(default=256, ge=1)
    #: llguidance threads computing a plan's masks; 0: on the engine's thread (docs/configs.md says why).
    mask_threads: int = Field(default=0, ge=0)


class EngineConfig(_Strict):
    """The asyncio engine loop."""

    #: Idle re-check period: time alone can change a decision (a starvation promotion).
    idle_poll_s: float = Field(default=0.05, gt=0)
    #: Jobs one engine holds at once, beyond which a 429: bounds how far overload stretches latency.
    max_jobs: int = Field(default=100_000, ge=1)
    #: How long rebuilding a lost executor may take; its jobs then end with an error.
    rebuild_deadline_s: float = Field(default=120.0, gt=0)
    stop_timeout_s: float = Field(default=30.0, gt=0)
    rebuild_retry_s: float = Field(default=2.0, gt=0)
    #: Work pending and no step done for this long: unhealthy (Serve replaces the replica).
    watchdog_s: float = Field(default=60.0, gt=0)
    #: How each CPU linear's GEMM path is chosen (``fastserve.worker.model.gemm_choice``): timed once
    #: per CPU model and cached, timed at every start, or fixed (ours, else oneDNN, else torch).
    gemm_choice: GemmChoiceMode = "cached"
    #: Greedy tokens independent of batching (GEMMs whose row sums ignore the row count); CPU bf16 only.
    batch_invariant: bool = False
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
