"""Configuration of the control plane: scheduler, KV-cache manager and engine loop.

Every tunable of the scheduling policies, the KV-cache manager and the engine loop lives here,
with the paper's default where the paper gives one (FastServe §4.1–4.2). Models are strict
(``extra="forbid"``) so a misspelt key fails loudly instead of silently keeping a default.
"""

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
#: The policies with more than one level: a request's ``priority`` shifts its entry level there
#: and changes nothing under the others.
LEVELLED_POLICIES: frozenset[PolicyName] = frozenset({"skip_join_mlfq", "naive_mlfq"})


def alpha_from_slo(per_token_slo_s: float, decode_time_s: float = 0.0) -> float:
    """Starvation threshold α derived from a per-token latency SLO.

    A job that is never picked on priority is promoted to level 1 once it has waited α and then
    runs at the next iteration, so the gap between two of its tokens is at most α plus one
    decode iteration. Choosing ``α = per_token_slo − decode_time`` keeps that worst-case gap
    within the SLO (the paper tunes α "based on the user-specified SLO", default 300 ms).
    """
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
    """Chunked prefill: a first iteration longer than a chunk runs as several iterations.

    Each chunk is its own iteration, mixed with other jobs' decodes; it gets what is left of the
    token budget (``max_num_batched_tokens``), at most ``chunk_tokens``. Only the last chunk
    samples a token. Each chunk counts as service in the job's level (its profiled
    ``t_init`` of the chunk's tokens); the entry level still comes from the whole prompt.
    """

    enabled: bool = False
    #: Most tokens one chunk feeds; a chunk also gets no more than the budget its batch left.
    chunk_tokens: int = Field(default=512, ge=1)


class SchedulerConfig(_Strict):
    """Scheduling policy (paper §4.1, Algorithm 1)."""

    policy: PolicyName = "skip_join_mlfq"
    #: B: jobs per iteration (paper: the largest batch that fits; same for every policy).
    max_batch_size: int = Field(default=16, ge=1)
    #: Token budget of one iteration: a first iteration costs its prompt, a decode costs 1.
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    #: α: a job not served for longer than this is promoted to level 1 (paper default 300 ms).
    starvation_alpha_s: float = Field(default=0.3, gt=0)
    #: α never falls below this many decode iterations (the profile's ``t_dec`` at
    #: ``max_batch_size``), so a job that waited one or two ordinary iterations is never
    #: "starving" (else every job outside the batch is promoted at each decision and MLFQ
    #: becomes FIFO). 10 is the paper's own ratio: α = 300 ms over a ~30 ms OPT-13B decode
    #: iteration at B = 16, and its SLO of "10x a decode iteration". Decode iterations, not
    #: measured steps: a step carrying first iterations is longer, and α would grow with the
    #: prefill share of the work.
    starvation_min_iterations: float = Field(default=10.0, ge=0)
    #: A job's α is multiplied by this for every promotion it already had. Under sustained
    #: overload a starving job is otherwise promoted every α, runs its level-1 quantum, sinks
    #: and starves again: MLFQ degenerates to round-robin with quantum α (the paper's own
    #: limitation) and each round trip drags a swap-out and a swap-in. Its first promotion
    #: still comes after α, so at normal load the paper's α is what holds. 64: in the simulated
    #: 2x overload (tests/unit/test_stability.py, ~550 jobs held) promotions per job are 0.70
    #: with 64 and 1.24-1.32 with 8 (second promotions come once a wait is 8x the first);
    #: 1 = the paper's fixed α (~28 per job there).
    starvation_backoff: float = Field(default=64.0, ge=1)
    #: α is also never below this many rounds of the backlog ahead of a job when its wait
    #: begins (the jobs in its level and above ÷ B, times the measured step): under sustained
    #: overload the backlog grows and so does every job's wait, and a fixed α would promote
    #: each waiting job again and again. The wait's α is fixed when it begins, so a backlog
    #: that drains later does not turn a long wait into a promotion; when the job comes due
    #: α is read again and the promotion postponed if the backlog grew meanwhile (a burst's
    #: first jobs saw almost nothing ahead). At normal load this term is a few steps, below
    #: the paper's 300 ms or the iteration floor. 2 rather than 4: the short jobs' P95 under
    #: 2x overload is 2.2-2.7x its 0.9-load value with 2, 2.6-3.4x with 4, at the same
    #: promotions. 0 turns it off.
    starvation_backlog_batches: float = Field(default=2.0, ge=0)
    #: Weight of the newest step in the running mean of measured step times (α's floor).
    step_time_ewma_weight: float = Field(default=0.1, gt=0, le=1)
    #: naive_mlfq only. True (paper Figure 7(b)): a first iteration longer than the level's
    #: quantum is preempted at the quantum — a prompt prefix costing the quantum runs, its KV and
    #: token are discarded, the job is demoted and starts over. False: the variant we had, which
    #: runs the first iteration to completion and demotes afterwards.
    naive_preempts_first_iteration: bool = True
    #: Memory preemption takes KV only from jobs at least this many levels below the job that
    #: wants it (1 = any strictly lower level, the paper's priority order). 2 leaves neighbours
    #: alone: a job demoted just below another does not trade its KV for it at once.
    preemption_level_gap: int = Field(default=1, ge=1)
    #: η: levels a job moves down when it exhausts its quantum (paper: the next queue).
    demotion_eta: int = Field(default=1, ge=1)
    #: q(i+1) = growth · q(i) (paper: 2, after classic MLFQ).
    quantum_growth: float = Field(default=2.0, gt=1)
    #: Number of MLFQ levels; None = enough that q_n ≥ the largest profiled t_init.
    num_levels: int | None = Field(default=None, ge=1)
    #: Jobs not yet admitted (no KV anywhere) beyond which ``add`` raises AdmissionQueueFull.
    admission_queue_limit: int = Field(default=100_000, ge=1)
    #: Accounting records of finished jobs kept until drained (oldest dropped first).
    finished_stats_limit: int = Field(default=10_000, ge=0)
    #: Split long first iterations into chunks (off by default: the paper runs them whole).
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
        """Most tokens one first-iteration chunk may feed, or None when chunking is off."""
        return self.chunked_prefill.chunk_tokens if self.chunked_prefill.enabled else None


class KVCacheConfig(_Strict):
    """Paged KV cache in two tiers and how it is swapped (paper §4.2)."""

    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1)
    num_device_blocks: int = Field(ge=1)
    num_host_blocks: int = Field(default=0, ge=0)
    #: Size a pool by memory instead, as vLLM's CPU build sizes its KV space
    #: (``VLLM_CPU_KVCACHE_SPACE``, GiB): the GiB of KV of the whole model copy (all layers and
    #: ranks), in the dtype the replica's machine resolves. Set one of the two per tier; the
    #: block count is then worked out where the replica starts (``fastserve.config``).
    device_memory_gib: float | None = Field(default=None, gt=0)
    host_memory_gib: float | None = Field(default=None, gt=0)
    #: proactive = ENST-driven prefetch/offload overlapped with compute (the paper);
    #: reactive = swap in only when scheduled, evict only when needed; recompute = drop + redo.
    swap_mode: SwapMode = "proactive"
    #: A job swapped in for its turn is not swapped out again for this many plans; then its pin
    #: expires, so a job that stopped being wanted cannot hold device blocks forever.
    swap_pin_plans: int = Field(default=2, ge=0)
    #: Prefetch also leaves free the decode growth of this many further iterations, so a job it
    #: brings in is not evicted again by the very next iteration's growth (prefetch→evict
    #: ping-pong: 564 of 1,224 swap-outs at 3 req/s in the Figure 15 simulation without it).
    prefetch_headroom_iterations: int = Field(default=1, ge=0)
    #: Automatic prefix caching (``fastserve.kv.prefix``): full blocks of computed KV are kept, by a
    #: chained hash of their tokens, after their job is done, and a new job takes the longest
    #: cached prefix instead of computing it. False: nothing is cached (the behaviour before).
    prefix_caching: bool = True
    #: Cached blocks evicted from the device move to the host pool while it has room (then a
    #: new job's prefix found there is copied back), instead of being dropped.
    host_prefix_cache: bool = True
    #: What else, beside the tokens, the cached KV depends on (the model; set per deployment
    #: when one cache could ever outlive a weight change). Seeds every block hash.
    prefix_cache_key: str = ""
    #: Burst slots: device blocks kept free for new arrivals (paper §4.2 "reserved slots").
    reserved_blocks: int = Field(default=0, ge=0)
    #: Also size the reserve from recent arrivals ("tuned on historical arrival patterns").
    adaptive_reserve: bool = False
    #: How far back arrivals are counted for the adaptive reserve.
    adaptive_window_s: float = Field(default=1.0, gt=0)
    #: Expected prompt blocks per arrival; None = use the recent arrivals' own prompt blocks.
    adaptive_blocks_per_arrival: float | None = Field(default=None, gt=0)
    #: Cap on the adaptive part, as a fraction of the device pool.
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

    #: How long the engine waits for one constraint to compile (on a worker thread, off its
    #: loop) before refusing the request with a 400. llguidance's own limits bound the work
    #: (its lexer fuel and grammar size: a typical JSON schema compiles in about a millisecond);
    #: this bounds the wait on a busy machine. vLLM has no such bound (its compile future is
    #: awaited while the request waits); ours is generous, far above any schema a client sends.
    compile_timeout_s: float = Field(default=10.0, gt=0)
    #: Distinct compiled constraints kept (least recently used goes first): a client sending the
    #: same schema again pays no compile. Each holds a pristine matcher (kilobytes).
    compile_cache_size: int = Field(default=256, ge=1)
    #: Threads that compute a plan's grammar masks together (llguidance's pool; it drops the
    #: GIL); 0: row after row on the engine's thread. 0 by default: on 2 cores the pool was no
    #: faster and may take the cores from the next forward (``fastserve.structured``). A
    #: many-core host serving large constrained batches may want a few.
    mask_threads: int = Field(default=0, ge=0)


class EngineConfig(_Strict):
    """The asyncio engine loop."""

    #: When the scheduler has nothing to run and nothing is in flight, re-check this often
    #: (time alone can change the decision, e.g. a starvation promotion).
    idle_poll_s: float = Field(default=0.05, gt=0)
    #: Jobs one engine holds at once (running, waiting, swapped, queued for admission); a request
    #: beyond it gets a 429. Bounds how far overload can stretch every job's latency, whatever
    #: the policy (skip-join MLFQ starts new jobs at once, so admission alone does not bound it).
    max_jobs: int = Field(default=100_000, ge=1)
    #: After the executor is lost (a stage worker died), how long rebuilding it may take; its
    #: jobs wait meanwhile and end with an error past it.
    rebuild_deadline_s: float = Field(default=120.0, gt=0)
    #: On shutdown, how long steps in flight may take to finish before they are cancelled.
    stop_timeout_s: float = Field(default=30.0, gt=0)
    #: Pause between two failed rebuild attempts.
    rebuild_retry_s: float = Field(default=2.0, gt=0)
    #: Work pending and no step finished for this long: the engine reports itself unhealthy
    #: (a stuck step; Serve then replaces the replica). Well above the longest step.
    watchdog_s: float = Field(default=60.0, gt=0)
    #: How each CPU linear shape's GEMM path (our bf16 kernel on vdpbf16ps or AMX, oneDNN, torch)
    #: is chosen at start (``fastserve.worker.model.gemm_choice``): ``cached`` times them once per CPU
    #: model string and reads the cache after; ``measure`` times them at every start; ``fixed``
    #: times nothing (our kernel where it builds, on AMX tiles where they run, else oneDNN, else torch).
    gemm_choice: GemmChoiceMode = "cached"
    #: A request's greedy tokens do not depend on what it is batched or chunked with (vLLM's and
    #: SGLang's deterministic modes): GEMMs whose per-row sums ignore the row count. CPU bf16
    #: with our kernel only; refused at start elsewhere.
    batch_invariant: bool = False
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
