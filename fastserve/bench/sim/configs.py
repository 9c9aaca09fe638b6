"""Scheduler and KV configs for a simulated run (the profile's ``serving`` defaults, else the
scheduler's), and ``simulate``, the one-call entry point the experiments and tests use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastserve.bench.sim.cost import CostModel
from fastserve.bench.sim.simulator import SimOptions, SimResult, Simulator
from fastserve.bench.workloads import Request
from fastserve.scheduler.config import KVCacheConfig, PolicyName, SchedulerConfig, SwapMode

ROOT = Path(__file__).resolve().parents[3]
PROFILES_DIR = ROOT / "config" / "profiles"

#: The paper's three evaluation settings, by the short names the experiments use.
PAPER_PROFILES: dict[str, Path] = {
    "opt-13b": PROFILES_DIR / "opt-13b-a100-tp1-pp1.json",
    "opt-66b": PROFILES_DIR / "opt-66b-a100-tp4-pp1.json",
    "opt-175b": PROFILES_DIR / "opt-175b-a100-tp8-pp2.json",
}
OPT_2_7B_PROFILE = PROFILES_DIR / "opt-2.7b-a100-tp1-pp1.json"
CPU_PROFILE = PROFILES_DIR / "opt-125m-cpu-tp1-pp1.json"


@dataclass(frozen=True)
class SimSetup:
    """Everything a run varies besides the workload; None = the profile's (or scheduler's) default."""

    policy: PolicyName = "skip_join_mlfq"
    swap_mode: SwapMode = "proactive"
    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    max_batch_size: int | None = None
    max_num_batched_tokens: int | None = None
    starvation_alpha_s: float | None = None
    reserved_blocks: int = 0
    #: naive_mlfq: cut a first iteration at its quantum (Figure 7(b)) or run it whole (Figure 14).
    naive_preempts_first_iteration: bool = True
    #: Chunked prefill with chunks of this many tokens (None: off, first iterations run whole).
    chunk_tokens: int | None = None
    #: Off: the paper has none, and here it would turn recompute's drops into host swaps (Figure 15).
    prefix_caching: bool = False
    #: Any other ``SchedulerConfig`` field, by name (e.g. starvation_backoff).
    scheduler_options: Mapping[str, object] = field(default_factory=dict)


def build_configs(cost: CostModel, setup: SimSetup) -> tuple[SchedulerConfig, KVCacheConfig]:
    serving = cost.serving
    sched_kwargs: dict[str, object] = {
        "policy": setup.policy, "naive_preempts_first_iteration": setup.naive_preempts_first_iteration}
    for key, value in (("max_batch_size", setup.max_batch_size or serving.max_batch_size),
                       ("max_num_batched_tokens", setup.max_num_batched_tokens or serving.max_num_batched_tokens),
                       ("starvation_alpha_s", setup.starvation_alpha_s)):
        if value is not None:
            sched_kwargs[key] = value
    if setup.chunk_tokens is not None:
        sched_kwargs["chunked_prefill"] = {"enabled": True, "chunk_tokens": setup.chunk_tokens}
    sched_kwargs.update(setup.scheduler_options)
    device = setup.num_device_blocks or serving.num_device_blocks
    if device is None:
        raise ValueError("the profile has no serving.num_device_blocks; pass num_device_blocks")
    host = setup.num_host_blocks if setup.num_host_blocks is not None else serving.num_host_blocks
    if setup.swap_mode == "recompute":
        host = host or 0
    elif not host:
        host = device
    kv = KVCacheConfig(block_size=cost.profile.block_size, num_device_blocks=device, num_host_blocks=host,
                       swap_mode=setup.swap_mode, reserved_blocks=setup.reserved_blocks,
                       prefix_caching=setup.prefix_caching)
    return SchedulerConfig(**sched_kwargs), kv  # type: ignore[arg-type]


def simulate(requests: Sequence[Request], cost: CostModel | str | Path, setup: SimSetup | None = None,
             options: SimOptions | None = None) -> SimResult:
    """Replay ``requests`` through a fresh scheduler with ``setup`` and the cost model."""
    model = cost if isinstance(cost, CostModel) else CostModel.from_json(cost)
    sched, kv = build_configs(model, setup or SimSetup())
    return Simulator(model, sched, kv, options).run(requests)
