"""Prometheus metric families (vLLM's names, units, buckets and ``model_name`` label, under our
prefix) and their recorders: ``EngineMetrics`` per Engine replica, ``IngressMetrics`` per Ingress
replica, both through ``ray.serve.metrics``; nothing sums across replicas. Counters mirrored from the
scheduler's totals advance by their difference (``CounterMirror``), so they never decrease.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from fastserve.engine.request_timing import COMPLETED, TimingBatch
from fastserve.kv.manager import Tier
from fastserve.scheduler.job import JobState, JobStats
from fastserve.scheduler.scheduler import Scheduler

#: Ray exports it as ``ray_`` + this.
PREFIX = "fastserve_"
Kind = Literal["counter", "gauge", "histogram"]

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles mean the same here.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
#: Context length for the token-length buckets where the model's is not known.
DEFAULT_MAX_MODEL_LEN = 2048
#: ENST prediction error (ours): from one decode step to a long wait.
ENST_ERROR_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Family:
    suffix: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return PREFIX + self.suffix


def length_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


def _families(*items: Family) -> dict[str, Family]:
    return {f.suffix: f for f in items}


#: Recorded in each Engine replica: vLLM's families, then the scheduler's own.
ENGINE_FAMILIES = _families(
    Family("num_requests_running", "gauge", "Number of requests in model execution batches."),
    Family("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    Family("num_requests_swapped", "gauge", "Number of requests whose KV cache is swapped out to host memory."),
    Family("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    Family("num_preemptions", "counter", "Cumulative number of preemptions from the engine "
           "(a running job's KV swapped out or dropped for recompute)."),
    Family("prompt_tokens", "counter", "Number of prefill tokens processed."),
    Family("generation_tokens", "counter", "Number of generation tokens processed."),
    Family("prefix_cache_queries", "counter",
           "Prefix cache queries, in terms of number of queried tokens."),
    Family("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    Family("time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
           buckets=TTFT_BUCKETS),
    Family("inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
           buckets=TOKEN_LATENCY_BUCKETS),
    Family("request_time_per_output_token_seconds", "histogram",
           "Histogram of time_per_output_token_seconds per request.", buckets=TOKEN_LATENCY_BUCKETS),
    Family("e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_queue_time_seconds", "histogram",
           "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_inference_time_seconds", "histogram",
           "Histogram of time spent in RUNNING phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_prefill_time_seconds", "histogram",
           "Histogram of time spent in PREFILL phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_decode_time_seconds", "histogram",
           "Histogram of time spent in DECODE phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
           buckets=length_buckets(DEFAULT_MAX_MODEL_LEN)),
    Family("request_generation_tokens", "histogram", "Number of generation tokens processed.",
           buckets=length_buckets(DEFAULT_MAX_MODEL_LEN)),
    Family("mlfq_jobs", "gauge", "Active jobs per MLFQ level, by state (running: in an in-flight "
           "iteration; waiting: not).", ("level", "state")),
    Family("admission_queue_jobs", "gauge", "Jobs waiting for admission (no KV anywhere yet)."),
    Family("host_kv_cache_usage_perc", "gauge", "Host (swap) KV-cache usage. 1 means 100 percent usage."),
    Family("prefix_cache_blocks", "gauge", "KV blocks the prefix cache holds, by tier (device, "
           "host), whether a job uses them or they are only kept for later hits.", ("tier",)),
    Family("swaps", "counter", "Jobs whose KV was swapped, by direction (out: device->host, in: host->device).",
           ("direction",)),
    Family("swapped_blocks", "counter", "KV blocks swapped, by direction.", ("direction",)),
    Family("recomputes", "counter", "Jobs whose KV was dropped and is recomputed."),
    Family("promotions", "counter", "Starvation promotions to the highest MLFQ level."),
    Family("demotions", "counter", "MLFQ demotions after a quantum was used up."),
    Family("scheduler_steps", "counter", "Iterations the engine ran."),
    Family("requests_rejected", "counter", "Requests refused because the admission queue was full."),
    Family("request_wait_time_seconds", "histogram", "Time a request's job was active but in no iteration, "
           "summed over its life (its first queueing and every MLFQ wait or preemption after it), "
           "less the time it was blocked on a swap (request_swap_blocked_time_seconds).",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("request_swap_blocked_time_seconds", "histogram",
           "Time a request was picked to run but its KV was still on the host.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("enst_error_seconds", "histogram", "Absolute error of ENST predictions made at swap decisions: "
           "|predicted - actual| time until the job next ran.", buckets=ENST_ERROR_BUCKETS),
)

#: Recorded in each Ingress replica: only it knows how a request ended for the client (a stop
#: string matched there aborts the job, yet the request finished "stop").
INGRESS_FAMILIES = _families(
    Family("request_success", "counter", "Count of successfully processed requests.", ("finished_reason",)),
)

LENGTH_FAMILIES = ("request_prompt_tokens", "request_generation_tokens")

ALL_FAMILIES: dict[str, Family] = {**ENGINE_FAMILIES, **INGRESS_FAMILIES}


class Sink(Protocol):
    """One metric as recorded (``ray.serve.metrics`` objects satisfy it)."""

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...

    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None: ...


SinkFactory = Callable[[Family, str], Any]


def ray_sink(family: Family, model_name: str) -> Any:
    from ray.serve import metrics as serve_metrics

    # Ray's stubs say tuple[str]; any tuple of str works (and is what Ray checks for).
    tag_keys: Any = ("model_name", *family.labels)
    metric: Any
    if family.kind == "counter":
        metric = serve_metrics.Counter(family.name, family.help, tag_keys=tag_keys)
    elif family.kind == "gauge":
        metric = serve_metrics.Gauge(family.name, family.help, tag_keys=tag_keys)
    else:
        metric = serve_metrics.Histogram(family.name, family.help, boundaries=list(family.buckets),
                                         tag_keys=tag_keys)
    metric.set_default_tags({"model_name": model_name})
    return metric


class Recorder:

    def __init__(self, families: Mapping[str, Family], model_name: str, sink_factory: SinkFactory = ray_sink) -> None:
        self.families = dict(families)
        self.model_name = model_name
        self._sinks = {suffix: sink_factory(f, model_name) for suffix, f in self.families.items()}

    def inc(self, suffix: str, value: float = 1.0, **tags: str) -> None:
        if value > 0:   # Ray rejects inc(0); a counter never goes down
            self._sinks[suffix].inc(value, tags=tags or None)

    def set(self, suffix: str, value: float, **tags: str) -> None:
        self._sinks[suffix].set(value, tags=tags or None)

    def observe(self, suffix: str, value: float) -> None:
        self._sinks[suffix].observe(value)


class CounterMirror:
    """Turns cumulative totals (the scheduler's own counters) into non-negative increments."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def advance(self, recorder: Recorder, suffix: str, total: float, **tags: str) -> None:
        key = (suffix, tuple(sorted(tags.items())))
        previous = self._last.get(key, 0.0)
        if total > previous:
            recorder.inc(suffix, total - previous, **tags)
            self._last[key] = total


class IngressMetrics(Recorder):
    def __init__(self, model_name: str, sink_factory: SinkFactory = ray_sink) -> None:
        super().__init__(INGRESS_FAMILIES, model_name, sink_factory)

    def request_finished(self, finished_reason: str) -> None:
        self.inc("request_success", finished_reason=finished_reason)


def engine_families(max_model_len: int) -> dict[str, Family]:
    """``ENGINE_FAMILIES`` with the token-length buckets of a ``max_model_len`` context."""
    buckets = length_buckets(max_model_len)
    return {suffix: replace(f, buckets=buckets) if suffix in LENGTH_FAMILIES else f
            for suffix, f in ENGINE_FAMILIES.items()}


class EngineMetrics(Recorder):
    """What one Engine replica records every sampling tick."""

    def __init__(self, model_name: str, sink_factory: SinkFactory = ray_sink,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        super().__init__(engine_families(max_model_len), model_name, sink_factory)
        self._mirror = CounterMirror()

    def record_timing(self, batch: TimingBatch) -> None:
        self.inc("prompt_tokens", batch.prompt_tokens)
        self.inc("generation_tokens", batch.generation_tokens)
        for ttft in batch.ttfts:
            self.observe("time_to_first_token_seconds", ttft)
        for itl in batch.itls:
            self.observe("inter_token_latency_seconds", itl)
        for f in batch.finished:
            self.observe("e2e_request_latency_seconds", f.e2e_s)
            self.observe("request_queue_time_seconds", f.queue_s)
            self.observe("request_inference_time_seconds", f.inference_s)
            self.observe("request_prefill_time_seconds", f.prefill_s)
            self.observe("request_decode_time_seconds", f.decode_s)
            self.observe("request_prompt_tokens", f.prompt_len)
            self.observe("request_generation_tokens", f.num_generated)
            if f.time_per_output_token_s is not None:
                self.observe("request_time_per_output_token_seconds", f.time_per_output_token_s)

    def job_finished(self, s: JobStats) -> None:
        """ENST errors of a finished or aborted job; wait and swap-blocked time if it completed."""
        for predicted, actual in s.enst_pairs:
            self.observe("enst_error_seconds", abs(predicted - actual))
        if s.finish_reason not in COMPLETED or s.finish_time is None:
            return
        self.observe("request_wait_time_seconds", s.queueing_s)
        self.observe("request_swap_blocked_time_seconds", s.swap_blocked_s)

    def rejected(self) -> None:
        self.inc("requests_rejected")

    def sample(self, scheduler: Scheduler) -> None:
        for suffix, value in scheduler_gauges(scheduler).items():
            self.set(suffix, value)
        for (level, state), n in mlfq_jobs(scheduler).items():
            self.set("mlfq_jobs", n, level=str(level), state=state)
        t, kv, m = scheduler.totals, scheduler.kv, self._mirror
        self.set("prefix_cache_blocks", float(kv.device.num_cached), tier="device")
        self.set("prefix_cache_blocks", float(kv.host.num_cached), tier="host")
        m.advance(self, "prefix_cache_queries", t["prefix_cache_queries"])
        m.advance(self, "prefix_cache_hits", t["prefix_cache_hits"])
        m.advance(self, "num_preemptions", t["swaps_out"] + t["recomputes"])
        for direction in ("out", "in"):
            m.advance(self, "swaps", t[f"swaps_{direction}"], direction=direction)
        m.advance(self, "swapped_blocks", kv.swapped_out_blocks, direction="out")
        m.advance(self, "swapped_blocks", kv.swapped_in_blocks, direction="in")
        for suffix, key in (("recomputes", "recomputes"), ("promotions", "promotions"),
                            ("demotions", "demotions"), ("scheduler_steps", "steps")):
            m.advance(self, suffix, t[key])


def scheduler_gauges(s: Scheduler) -> dict[str, float]:
    running = waiting = swapped = 0
    for job in s.jobs().values():
        if job.state is JobState.RUNNING:
            running += 1
        elif job.active:
            waiting += 1
        if job.active and s.kv.tier(job.job_id) is Tier.HOST:
            swapped += 1
    kv = s.kv
    return {
        "num_requests_running": float(running),
        "num_requests_waiting": float(waiting),
        "num_requests_swapped": float(swapped),
        "kv_cache_usage_perc": (kv.device.capacity - kv.num_free_device) / kv.device.capacity,
        "host_kv_cache_usage_perc": (kv.host.capacity - kv.num_free_host) / kv.host.capacity
        if kv.host.capacity else 0.0,
        "admission_queue_jobs": float(s.num_waiting()),
    }


def mlfq_jobs(s: Scheduler) -> dict[tuple[int, str], float]:
    """Active jobs per (MLFQ level, running|waiting), zeros included."""
    out = {(level, state): 0.0 for level in range(1, s.queues.num_levels + 1) for state in ("running", "waiting")}
    for job in s.jobs().values():
        if job.active:
            out[(job.level, "running" if job.state is JobState.RUNNING else "waiting")] += 1
    return out
