"""``python -m fastserve.plan CONFIG``: a dry run of a Serve config's memory, per GPU and per node,
with no GPU and no torch.

Per rank: weights, KV pool and activations at ``max_num_batched_tokens`` against
``gpu_memory_utilization`` of ``parallel.gpu_kind``; per node: the pinned swap pools against
``host_memory_utilization``. Exits 1 when anything does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from fastserve.config import AppArgs
from fastserve.config_model import REQUIRE_MODEL_FILES_CONTEXT, REQUIRE_PROFILE_CONTEXT
from fastserve.gpu_kinds import GIB, GpuKind, GpuTable, load_gpu_table
from fastserve.worker.model.footprint import rank_activation_bytes, rank_kv_bytes_per_block, stage_weight_bytes
from fastserve.worker.model.shard import StageShard
from fastserve.worker.parallel import layer_ranges


@dataclass(frozen=True)
class RankPlan:
    """One GPU: its stage, TP rank, layer range and what it holds, in bytes."""

    stage: int
    tp_rank: int
    layers: tuple[int, int]
    weight_bytes: int
    kv_bytes: int
    activation_bytes: int
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes


@dataclass(frozen=True)
class NodePlan:
    """One stage's node: the pinned host swap pools of its TP ranks."""

    stage: int
    host_pool_bytes: int
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.host_pool_bytes <= self.budget_bytes


@dataclass(frozen=True)
class Plan:
    app: str
    gpu_kind: str
    ranks: tuple[RankPlan, ...]
    nodes: tuple[NodePlan, ...]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks) and all(n.fits for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        ranks = [asdict(r) | {"total_bytes": r.total_bytes, "fits": r.fits} for r in self.ranks]
        nodes = [asdict(n) | {"fits": n.fits} for n in self.nodes]
        return {"app": self.app, "gpu_kind": self.gpu_kind, "fits": self.fits, "ranks": ranks, "nodes": nodes}


def plan_app(name: str, args: AppArgs, kind: GpuKind, table: GpuTable) -> Plan:
    """The memory plan of one application's model copy on GPUs of ``kind``."""
    config = args.model.hf_config()
    par, kv, sched = args.parallel, args.kv_cache, args.scheduler
    dtype_bytes = args.model.dtype_bytes()
    gpu_budget = int(kind.memory_bytes * table.gpu_memory_utilization)
    host_budget = int(kind.node_host_memory_bytes * table.host_memory_utilization)
    ranks: list[RankPlan] = []
    nodes: list[NodePlan] = []
    tp = par.tensor_parallel_size
    for stage, (start, end) in enumerate(layer_ranges(config.num_hidden_layers, par.pipeline_parallel_size)):
        block = 0
        for rank in range(tp):
            shard = StageShard(start, end, config.num_hidden_layers, rank, tp)
            block = rank_kv_bytes_per_block(config, shard, kv.block_size, dtype_bytes)
            ranks.append(RankPlan(
                stage, rank, (start, end), stage_weight_bytes(config, shard, dtype_bytes),
                kv.num_device_blocks * block,
                rank_activation_bytes(config, shard, sched.max_num_batched_tokens, sched.max_batch_size, dtype_bytes),
                gpu_budget))
        nodes.append(NodePlan(stage, kv.num_host_blocks * block * tp, host_budget))
    return Plan(name, kind.name, tuple(ranks), tuple(nodes))


def plan_config(path: Path, gpu_kind: str | None = None) -> list[Plan]:
    """Needs only the YAML and the model's config.json (the rest is on the serving nodes)."""
    raw = yaml.safe_load(path.read_text())
    table = load_gpu_table()
    context = {REQUIRE_PROFILE_CONTEXT: False, REQUIRE_MODEL_FILES_CONTEXT: False}
    plans = []
    for app in raw.get("applications", []):
        args = AppArgs.model_validate(app["args"], context=context)
        if args.model.device != "cuda":
            raise ValueError(f"{path}: application {app['name']!r} runs on {args.model.device!r}: "
                             "the planner sizes GPU configs")
        name = gpu_kind or args.parallel.gpu_kind
        if name is None:
            raise ValueError(f"{path}: application {app['name']!r} names no parallel.gpu_kind "
                             f"(one of {sorted(table.kinds)}); pass --gpu-kind")
        plans.append(plan_app(app["name"], args, table.kind(name), table))
    if not plans:
        raise ValueError(f"{path} has no applications")
    return plans


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    head = (f"{plan.app} on {plan.gpu_kind}: {len(plan.ranks)} GPUs, "
            f"{'fits' if plan.fits else 'DOES NOT FIT'} (GiB)")
    cols = (f"{'stage':>5} {'rank':>4} {'layers':>9} {'weights':>8} {'kv':>8} {'activ':>7} {'total':>8} "
            f"{'budget':>8}  fits")
    rows = [f"{r.stage:>5} {r.tp_rank:>4} {f'{r.layers[0]}-{r.layers[1] - 1}':>9} {_gib(r.weight_bytes):>8} "
            f"{_gib(r.kv_bytes):>8} {_gib(r.activation_bytes):>7} {_gib(r.total_bytes):>8} "
            f"{_gib(r.budget_bytes):>8}  {'yes' if r.fits else 'NO'}" for r in plan.ranks]
    nodes = [f"stage {n.stage} node: pinned host pool {_gib(n.host_pool_bytes)} of {_gib(n.budget_bytes)} "
             f"GiB  {'yes' if n.fits else 'NO'}" for n in plan.nodes]
    return "\n".join([head, cols, *rows, *nodes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastserve.plan", description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="a Serve YAML (config/*.yaml)")
    parser.add_argument("--gpu-kind", help="size for this GPU kind instead of the config's parallel.gpu_kind")
    parser.add_argument("--json", action="store_true", help="print the plans as one JSON object")
    ns = parser.parse_args(argv)
    plans = plan_config(ns.config, ns.gpu_kind)
    if ns.json:
        print(json.dumps({"plans": [p.to_dict() for p in plans]}))
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    return 0 if all(p.fits for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
