"""``StageWorker``: the Ray actor holding one pipeline stage's layers for one tensor-parallel rank,
its slice of the KV store and a ``StageRunner``, so it executes a plan as the in-process executor does.

``step`` is the compiled-graph method: ``(plan, hidden)`` in, swaps started, layers run, ``(plan, hidden)``
on (the swap commands travel with the activations, paper §4.3); the last stage's rank 0 returns the
``StepOutput``. ``ping``, ``stats`` and ``timeline`` run in their own concurrency group beside a step.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import ray

from fastserve.worker.messages import BatchPlan, StepOutput
from fastserve.worker.model.config import ModelConfig
from fastserve.worker.nccl import check_worker_can_use_nccl_channels
from fastserve.worker.parallel import TensorParallelGroup, cuda_device_index
from fastserve.worker.ports import free_port
from fastserve.worker.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from fastserve.worker.stage import StageRunner

#: Concurrency group of the plain calls that must answer while the graph runs a step.
CONTROL_GROUP = "control"
#: How many step records a worker keeps for ``timeline`` (a ring: old steps fall off).
TIMELINE_CAPACITY = 4096


class StageInput(NamedTuple):
    """What flows between stages: the plan, the hidden states (None into the first stage or with no
    entries; one rank's part where ``hidden_shape`` is set) and the phase times summed so far.
    """

    plan: BatchPlan
    hidden: torch.Tensor | None
    timings: dict[str, float] | None = None
    hidden_shape: tuple[int, ...] | None = None


def hidden_part(hidden: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """Rank ``tp_rank``'s 1/TP of the (all-reduced, identical) hidden states, which the next stage
    all-gathers, and the shape to rebuild (None: sent whole). A copy: a view would pickle its whole storage."""
    if tp_size == 1 or hidden.numel() % tp_size:
        return hidden, None
    return hidden.reshape(tp_size, -1)[tp_rank].clone(), tuple(hidden.shape)


class StepRecord(NamedTuple):
    """When one worker ran one plan, in ``time.time()`` seconds (comparable within one node)."""

    step_id: int
    start: float
    end: float


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: the model copy's ``ModelSpec`` as it is, the loaded config, and where in the
    grid this worker sits. Picklable, no torch."""

    model: ModelSpec
    config: ModelConfig
    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    tp_rank: int
    tp_size: int
    #: Whether this worker's activations travel over Ray's NCCL channels (``fastserve.worker.nccl``).
    nccl_channels: bool = False

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def samples(self) -> bool:
        """Only one rank of the last stage computes logits and samples."""
        return self.is_last and self.tp_rank == 0

    @property
    def name(self) -> str:
        return f"stage {self.stage_index} tp rank {self.tp_rank}"


def _add_timings(upstream: dict[str, float], own: dict[str, float]) -> dict[str, float]:
    summed = dict(upstream)
    for phase, seconds in own.items():
        summed[phase] = summed.get(phase, 0.0) + seconds
    return summed


def assigned_device_index(device: str) -> int:
    """The CUDA index of the GPU Ray assigned this process (a stage worker, or an Engine replica
    that runs its model in process); outside Ray, the current device; 0 on CPU."""
    if device != "cuda":
        return 0
    if not ray.is_initialized():
        import torch

        return int(torch.cuda.current_device())
    return cuda_device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def _build_runner(spec: WorkerSpec, tp: TensorParallelGroup) -> StageRunner:
    from fastserve.worker.executor import build_runner
    from fastserve.worker.model.shard import StageShard

    shard = StageShard(spec.layer_start, spec.layer_end, spec.config.num_hidden_layers,
                       spec.tp_rank, spec.tp_size)
    return build_runner(spec.model, spec.config, shard, all_reduce=tp.all_reduce(), device_index=tp.device_index)


@ray.remote(concurrency_groups={CONTROL_GROUP: 1})  # type: ignore[call-overload]
class StageWorker:
    """One stage × one TP rank. Create through ``fastserve.worker.pipeline``, which places and wires it."""

    def __init__(self, spec: WorkerSpec) -> None:
        check_worker_can_use_nccl_channels(spec.nccl_channels)   # before any weight is read
        self.spec = spec
        self.tp = TensorParallelGroup(spec.model.device, assigned_device_index(spec.model.device))
        self.runner = _build_runner(spec, self.tp)
        self._steps = 0
        self._hidden_bytes_sent = 0
        self._timeline: deque[StepRecord] = deque(maxlen=TIMELINE_CAPACITY)

    def tp_address(self) -> tuple[str, int]:
        """Where this rank (rank 0 of its stage) hosts the TP group's rendezvous."""
        return ray.util.get_node_ip_address(), free_port()

    def init_tp_group(self, master_addr: str, port: int, world_size: int, rank: int,
                      timeout_s: float) -> None:
        """Join this stage's TP group; every rank of the stage must be calling it at once."""
        if (world_size, rank) != (self.spec.tp_size, self.spec.tp_rank):
            raise ValueError(f"{self.spec.name} was built as rank {self.spec.tp_rank} of "
                             f"{self.spec.tp_size}, asked to join as rank {rank} of {world_size}")
        self.tp.init(master_addr, port, world_size, rank, timeout_s)

    def step(self, msg: StageInput) -> StageInput | StepOutput | None:
        """Run one plan on this worker (the compiled graph's method; see the module docstring)."""
        start = time.time()
        self.runner.make_current()
        msg = StageInput(*msg)  # a plain (plan, hidden) tuple is accepted too
        plan, hidden, upstream, shape = msg
        if not self.tp.initialized:
            raise RuntimeError(f"{self.spec.name}: step before init_tp_group (tp_size {self.spec.tp_size})")
        if plan.entries and self.spec.stage_index > 0 and hidden is None:
            raise ValueError(f"{self.spec.name}: plan {plan.step_id} has {len(plan.entries)} entries "
                             "but no hidden states came from the previous stage")
        gather_s = 0.0
        if hidden is not None:
            if hidden.device != self.runner.device:
                hidden = hidden.to(self.runner.device)
            if shape is not None:
                began = time.perf_counter()
                hidden = self.tp.all_gather(hidden).reshape(shape)
                gather_s = time.perf_counter() - began
        result = self.runner.run(plan, hidden, sample=self.spec.samples)
        end = time.time()
        self._steps += 1
        self._timeline.append(StepRecord(plan.step_id, start, end))
        own = dict(result.timings)
        if gather_s:
            own["hidden_gather"] = gather_s
            own["total"] = own.get("total", 0.0) + gather_s
        summed = _add_timings(upstream or {}, own)
        if not self.spec.is_last:
            if result.hidden is None:
                return StageInput(plan, None, summed)
            part, full = hidden_part(result.hidden, self.spec.tp_rank, self.spec.tp_size)
            self._hidden_bytes_sent += part.numel() * part.element_size()
            return StageInput(plan, part, summed, full)
        return (StepOutput(plan.step_id, result.tokens, summed, result.logprobs, result.prompt_logprobs)
                if self.spec.samples else None)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> str:
        return self.spec.name

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self) -> dict[str, Any]:
        """Counters only: safe while the graph runs (no KV access, no collectives). The swapped
        blocks are the KV store's own counts; ``hidden_bytes_sent`` what this rank passed on."""
        kv = self.runner.kv
        return {"stage": self.spec.stage_index, "tp_rank": self.spec.tp_rank, "steps": self._steps,
                "swapped_out_blocks": kv.swapped_out_blocks, "swapped_in_blocks": kv.swapped_in_blocks,
                "hidden_bytes_sent": self._hidden_bytes_sent}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def timeline(self) -> list[StepRecord]:
        return list(self._timeline)
