"""Tensor parallelism on CPU in tests: one spawned process per TP rank, joined over gloo.

Each rank builds its shard of one stage (all layers), its KV store and a ``StageRunner``, wraps
them in ``RankExecutor`` (shaped like ``InProcessExecutor`` for ``Driver``) and runs ``work`` on a
``Driver`` over it. Every rank samples the same all-reduced logits, so each returns the tokens a
single process would. ``work`` must be picklable (a module-level function or a
``functools.partial`` of one): it crosses into the spawned processes.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastserve.worker.messages import BatchPlan, StepOutput
from fastserve.worker.model.config import ModelConfig
from tests.harness.engine_driver import Driver

#: Seconds to wait for the gloo rendezvous and for each rank's result.
TP_TIMEOUT_S = 120


@dataclass(frozen=True)
class RankPools:
    """KV store shape of every rank."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int


@dataclass(frozen=True)
class RankResult:
    """What one rank reports: its (query heads, KV heads) and ``work``'s return value."""

    local_heads: tuple[int, int]
    result: Any


class RankExecutor:
    """One TP rank's stage, KV store and runner, shaped like ``InProcessExecutor`` for ``Driver``."""

    def __init__(self, config: ModelConfig, path: Path, rank: int, tp_size: int, port: int,
                 pools: RankPools, timeout_s: float) -> None:
        from fastserve.worker.executor import build_stage
        from fastserve.worker.kv_store import KVStore
        from fastserve.worker.model.shard import StageShard
        from fastserve.worker.parallel import TensorParallelGroup
        from fastserve.worker.sampler import Sampler
        from fastserve.worker.stage import StageRunner

        group = TensorParallelGroup("cpu")
        group.init("127.0.0.1", port, tp_size, rank, timeout_s)
        layers = config.num_hidden_layers
        shard = StageShard(0, layers, layers, rank, tp_size)
        stage = build_stage(config, shard, "float32", "cpu", "auto", str(path), 0, all_reduce=group.all_reduce())
        self.kv = KVStore(layers, stage.num_local_kv_heads, config.head_dim, pools.block_size,
                          pools.num_device_blocks, pools.num_host_blocks)
        self.runner = StageRunner(stage, self.kv, Sampler(0))

    def execute(self, plan: BatchPlan) -> StepOutput:
        result = self.runner.run(plan, None, sample=True)
        return StepOutput(plan.step_id, result.tokens, result.timings)


Work = Callable[[Driver], Any]


def _rank_main(config: ModelConfig, path: Path, rank: int, tp_size: int, port: int, pools: RankPools,
               work: Work, timeout_s: float, queue: Any) -> None:
    """Child process: build this rank, run ``work``, report (rank, heads, result, error)."""
    try:
        torch.set_num_threads(1)   # the ranks share the machine's cores
        ex = RankExecutor(config, path, rank, tp_size, port, pools, timeout_s)
        local = (ex.runner.model.num_local_heads, ex.runner.model.num_local_kv_heads)
        queue.put((rank, local, work(Driver(ex)), None))  # type: ignore[arg-type]
    except Exception as exc:  # reported to the parent, which fails the test with it
        queue.put((rank, None, None, repr(exc)))


def run_tensor_parallel(config: ModelConfig, path: Path, work: Work, pools: RankPools, tp_size: int = 2,
                        timeout_s: float = TP_TIMEOUT_S) -> dict[int, RankResult]:
    """Run ``work`` on every rank of a ``tp_size``-way split of ``config``'s checkpoint at ``path``."""
    from fastserve.worker.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(config, path, r, tp_size, port, pools, work, timeout_s, queue))
             for r in range(tp_size)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
    errors = [e for _, _, _, e in results if e]
    assert not errors, errors
    return {rank: RankResult(tuple(local), out) for rank, local, out, _ in results}
