"""The machine's roofline and how far our decode step is from it: ``python -m fastserve.bench.roofline``.

Measures this CPU's sustained GEMM FLOP/s per engine and dtype (bf16 where it is native) and its
memory bandwidth, then for the served model at batch 1 / 16 / 32 prints the floor of one decode step,

    floor = max(bytes read / bandwidth, FLOPs / peak FLOP/s)

(bytes: every weight once, the batch's embedding rows, the KV attended over; FLOPs: 2 per
multiply-add of the linears, plus 4 × heads × head_dim × context per layer per row for attention;
norms, rotary, softmax, sampling left out), beside our measured step and ``transformers``'.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from fastserve.bench import bench_engine
from fastserve.kernels import cpu_linear
from fastserve.kernels.cpu_features import cpu_has_amx_bf16, cpu_has_bf16, cpu_name
from fastserve.worker.executor import resolve_dtype, torch_dtype
from fastserve.worker.model.config import ModelConfig
from fastserve.worker.model.linear import onednn_linear_available
from fastserve.worker.model.registry import build_model
from fastserve.worker.model.shard import StageShard

DEFAULT_MODEL = str(bench_engine.ROOT / "config/demo.yaml")
BATCH_SIZES = (1, 16, 32)
#: Square GEMM sides of the FLOP/s probe; the fastest engine's rate is the peak.
GEMM_SIDES = (1024, 2048, 4096)
#: Bytes of the bandwidth probe's tensor: far beyond any L3.
STREAM_BYTES = 512 * 1024 * 1024
#: The decode steps' mean context in bench_engine (prompt + half of its decode steps).
DEFAULT_CONTEXT = bench_engine.PROMPT_LEN + bench_engine.DECODE_STEPS // 2


@dataclass(frozen=True)
class StepCost:

    weight_bytes: int
    kv_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Machine:

    flops: dict[str, float]
    bandwidth: float


def decode_step_cost(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> StepCost:
    """One decode step of the whole model, counted from our own stage module on the meta device:
    what the served model multiplies by is what is counted."""
    with torch.device("meta"):
        model = build_model(config, StageShard.whole(config))
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_ids = {id(m.weight) for m in embeddings}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in embedding_ids)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tied_head = 0 if hasattr(model, "lm_head") else model.embed_tokens.weight.numel()
    rows = batch * sum(m.embedding_dim for m in embeddings)   # token (and position) rows read
    weight_bytes = (dense + tied_head + rows) * dtype_bytes
    kv_bytes = batch * context * config.kv_bytes_per_token(dtype_bytes)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context
    flops = batch * (2 * (linear + tied_head) + attention)
    return StepCost(weight_bytes, kv_bytes, flops)


def floor_s(cost: StepCost, bandwidth: float, peak_flops: float) -> float:
    return max(cost.bytes / bandwidth, cost.flops / peak_flops)


def _best(run: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs after a warm-up: the least disturbed."""
    return min(bench_engine.timed_runs(run, repeats))


def measure_gemm_engines(dtype: torch.dtype, sides: tuple[int, ...] = GEMM_SIDES,
                         repeats: int = 3) -> dict[str, float]:
    """Peak FLOP/s per engine: ``torch.mm``, oneDNN, and for bf16 our kernel's paths."""
    engines: dict[str, Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]] = {"torch.mm": _mm}
    if onednn_linear_available(dtype):
        engines["onednn"] = _onednn
    if dtype == torch.bfloat16:
        for path in cpu_linear.paths():
            engines[f"ours_{cpu_linear.PATH_NAMES[path]}"] = functools.partial(_ours, path)
    best = dict.fromkeys(engines, 0.0)
    for side in sides:
        a = torch.randn(side, side).to(dtype)
        b = torch.randn(side, side).to(dtype)
        for name, make in engines.items():
            best[name] = max(best[name], 2 * side**3 / _best(make(a, b), repeats))
    return best


def _mm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    return functools.partial(torch.mm, a, b)


def _onednn(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    packed = torch.ops.mkldnn._reorder_linear_weight(b, b.shape[0])
    return functools.partial(torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], "")


def _ours(path: int, a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    return functools.partial(cpu_linear.linear, a, cpu_linear.pack(b), None, path=path)


def measure_gemm_flops(dtype: torch.dtype, sides: tuple[int, ...] = GEMM_SIDES, repeats: int = 3) -> float:
    return max(measure_gemm_engines(dtype, sides, repeats).values())


def measure_bandwidth(nbytes: int = STREAM_BYTES, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of a streaming read and of a copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return {"read": nbytes / _best(lambda: src.sum(), repeats),
            "copy": 2 * nbytes / _best(lambda: dst.copy_(src), repeats)}


def measure_machine(dtypes: list[str], repeats: int, sides: tuple[int, ...] = GEMM_SIDES,
                    stream_bytes: int = STREAM_BYTES) -> tuple[Machine, dict[str, float], dict[str, dict[str, float]]]:
    """The machine (each dtype's best engine, the faster stream), the streams, and every
    engine's GEMM peak per dtype."""
    engines = {d: measure_gemm_engines(torch_dtype(d), sides, repeats) for d in dtypes}
    streams = measure_bandwidth(stream_bytes, repeats)
    return Machine({d: max(e.values()) for d, e in engines.items()}, max(streams.values())), streams, engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model folder / config.json, or a Serve YAML (default: the demo's)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "auto"), default=None,
                        help="default: float32, and bfloat16 where the CPU has native bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=("auto", "real", "dummy"), default="auto")
    parser.add_argument("--gemm-sides", type=int, nargs="+", default=list(GEMM_SIDES),
                        help="square GEMM sides of the FLOP/s probe")
    parser.add_argument("--stream-mib", type=int, default=STREAM_BYTES >> 20,
                        help="MiB of the bandwidth probe's tensor (far beyond the last-level cache)")
    parser.add_argument("--no-measure-steps", action="store_true",
                        help="the machine and the floors only (no model steps)")
    args = parser.parse_args()
    dtypes = args.dtypes or (["float32", "bfloat16"] if cpu_has_bf16() else ["float32"])
    dtypes = list(dict.fromkeys(resolve_dtype(d, "cpu") for d in dtypes))
    config = bench_engine.load_bench_config(args.model)
    context = DEFAULT_CONTEXT
    sides = tuple(args.gemm_sides)
    machine, streams, engines = measure_machine(dtypes, args.repeats, sides, args.stream_mib << 20)
    amx = cpu_has_amx_bf16()
    print(f"{cpu_name()}, {torch.get_num_threads()} torch threads, AMX bf16 tiles: {'yes' if amx else 'no'}")
    for d in dtypes:
        per_engine = ", ".join(f"{name} {flops / 1e9:.0f}" for name, flops in engines[d].items())
        print(f"  GEMM {d} (best of sides {', '.join(map(str, sides))}): "
              f"{machine.flops[d] / 1e9:.1f} GFLOP/s  [{per_engine}]")
    print(f"  memory: read {streams['read'] / 1e9:.1f} GB/s, copy {streams['copy'] / 1e9:.1f} GB/s "
          f"(floor uses {machine.bandwidth / 1e9:.1f})")
    print(f"{config.name}, decode step at context {context}")
    print(f"{'dtype':>8} {'batch':>5} | {'MB read':>8} {'GFLOP':>7} {'floor ms':>8} {'bound':>7} | "
          f"{'ours ms':>8} {'÷floor':>6} | {'hf ms':>8} {'÷floor':>6}")
    rows = []
    for d in dtypes:
        width = torch_dtype(d).itemsize
        ex = hf = None
        if not args.no_measure_steps:
            ex, hf, _ = bench_engine.build_pair(args.model, args.weights, args.batch_sizes, d)
        for b in args.batch_sizes:
            cost = decode_step_cost(config, b, context, width)
            floor = floor_s(cost, machine.bandwidth, machine.flops[d])
            bound = "memory" if cost.bytes / machine.bandwidth >= cost.flops / machine.flops[d] else "compute"
            row: dict[str, object] = {"dtype": d, "batch": b, **asdict(cost), "floor_ms": float(f"{floor * 1e3:.6g}"),
                                      "bound": bound}
            ours = theirs = float("nan")
            if ex is not None and hf is not None:
                bench_engine.prefill_s_ours(ex, b, 1)
                ours = bench_engine.decode_step_s_ours(ex, b, args.repeats)
                theirs = bench_engine.decode_step_s_hf(hf, b, args.repeats)
                row.update(ours_ms=round(ours * 1e3, 3), ours_over_floor=round(ours / floor, 3),
                           hf_ms=round(theirs * 1e3, 3), hf_over_floor=round(theirs / floor, 3))
            rows.append(row)
            print(f"{d:>8} {b:>5} | {cost.bytes / 1e6:>8.1f} {cost.flops / 1e9:>7.2f} {floor * 1e3:>8.2f} "
                  f"{bound:>7} | {ours * 1e3:>8.2f} {ours / floor:>6.2f} | {theirs * 1e3:>8.2f} {theirs / floor:>6.2f}")
        if ex is not None:
            ex.close()
    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "model": config.name,
                      "context": context, "gemm_flops": {d: round(f) for d, f in machine.flops.items()},
                      "amx_bf16": amx,
                      "gemm_engines": {d: {n: round(f) for n, f in e.items()} for d, e in engines.items()},
                      "bandwidth": {k: round(v) for k, v in streams.items()}, "steps": rows}))


if __name__ == "__main__":
    main()
