"""Every CPU GEMM path on a model's own linear shapes, side by side: ``python -m fastserve.bench.bench_gemm``.

Two tables, then one JSON object:

* **paths**: for each linear shape of the model (q/k/v merged, o, gate/up merged, down, the LM
  head) and each row count, the time of one pass over the layers' weights (cold, as in a step;
  ``--layers`` copies) on every path this CPU runs — our kernel on ``vdpbf16ps`` and on AMX tiles,
  oneDNN's prepacked GEMM (AMX inside where the CPU has it), torch's ``F.linear`` — timed as the
  server times them at start (``fastserve.worker.model.gemm_choice.time_candidates``: each call on its
  own, the fastest of the interleaved rounds; above 64 rows over two layers' weights), and the
  decode step's linears summed per path;
* **steps** (``--steps``): whole decode steps of the real model at ``--batches``, the paths chosen
  three ways in one process, interleaved round by round: ``fixed`` (our kernel throughout),
  ``cached`` (the server's measured choice) and ``batch_invariant`` — its cost is that ratio.

Random weights of the model's shapes for the paths (speed does not depend on the values); the
model folder's own weights for the steps. Name the CPU with every figure (it is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import torch

from fastserve.bench.bench_engine import ROOT, load_bench_config
from fastserve.kernels.cpu_features import cpu_name
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, blocks_for
from fastserve.worker.model import gemm_choice as G
from fastserve.worker.model.linear import candidate_paths, candidates
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.spec import ModelSpec

DEFAULT_MODEL = str(ROOT / ".cache/models/smollm2-135m-instruct")
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
BATCHES = (1, 8, 32)
CONTEXT = 256
STEP_ROUNDS = 6
STEPS_PER_ROUND = 4
BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
#: The step modes compared: (label, engine.gemm_choice, engine.batch_invariant).
MODES = (("fixed", G.FIXED, False), ("cached", G.CACHED, False), ("batch_invariant", G.FIXED, True))


def linear_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """A LLaMA-family layer's GEMM shapes ([out, in], q/k/v and gate/up merged) and the head's."""
    q, kv = config.num_attention_heads * config.head_dim, config.kv_heads_per_rank(1) * config.head_dim
    return {"qkv": (q + 2 * kv, config.hidden_size), "o": (config.hidden_size, q),
            "gate_up": (2 * config.intermediate_size, config.hidden_size),
            "down": (config.hidden_size, config.intermediate_size), "lm_head": (config.vocab_size, config.hidden_size)}


def bench_paths(config: LlamaConfig, rows: tuple[int, ...], layers: int) -> dict[str, Any]:
    """Seconds of a pass over ``layers`` weights (the head: one) per shape, row count and path."""
    out: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for name, (n, k) in linear_shapes(config).items():
        count = 1 if name == "lm_head" else layers
        weights = tuple((torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16) for _ in range(count))
        paths = candidate_paths(weights[0])
        out[name], _ = G.time_candidates(G.GemmRole(name, weights), candidates(paths), rows, prune_ratio=math.inf)
    return out


def _executor(config: LlamaConfig, folder: str, batch: int, gemm_choice: str, invariant: bool) -> InProcessExecutor:
    per_seq = blocks_for(CONTEXT + STEP_ROUNDS * STEPS_PER_ROUND + 2, BLOCK_SIZE)
    return InProcessExecutor(ModelSpec(config, batch * per_seq, 0, BLOCK_SIZE, dtype="bfloat16", load_format="auto",
                                       model_path=folder, gemm_choice=gemm_choice, batch_invariant=invariant))


def bench_steps(config: LlamaConfig, folder: str, batches: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Median decode step (ms) per batch and mode, the modes interleaved round by round."""
    out: dict[int, dict[str, float]] = {}
    for b in batches:
        per_seq = blocks_for(CONTEXT + STEP_ROUNDS * STEPS_PER_ROUND + 2, BLOCK_SIZE)
        tables = [tuple(range(j * per_seq, (j + 1) * per_seq)) for j in range(b)]
        prompt = tuple(range(2, 2 + CONTEXT))
        executors = {label: _executor(config, folder, b, choice, inv) for label, choice, inv in MODES}
        for ex in executors.values():
            ex.execute(BatchPlan(0, tuple(BatchEntry(str(j), prompt, 0, tables[j], True, GREEDY) for j in range(b))))
        times: dict[str, list[float]] = {label: [] for label in executors}
        position = {label: CONTEXT for label in executors}
        for _ in range(STEP_ROUNDS):
            for label, ex in executors.items():
                for _ in range(STEPS_PER_ROUND):
                    pos = position[label]
                    plan = BatchPlan(1, tuple(BatchEntry(str(j), (7,), pos, tables[j], False, GREEDY, pos - CONTEXT + 1)
                                              for j in range(b)))
                    start = time.perf_counter()
                    ex.execute(plan)
                    times[label].append(time.perf_counter() - start)
                    position[label] += 1
        out[b] = {label: statistics.median(ts) * 1e3 for label, ts in times.items()}
        for ex in executors.values():
            ex.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a LLaMA-family model folder (default: the demo's)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--layers", type=int, default=None, help="weights per shape (default: the model's layers)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps per mode")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_bench_config(args.model)
    if not isinstance(config, LlamaConfig):
        raise SystemExit(f"{args.model}: bench_gemm takes a LLaMA-family model, got {type(config).__name__}")
    layers = args.layers or config.num_hidden_layers
    print(f"{cpu_name()}, {torch.get_num_threads()} torch threads; {config.name}, bf16, {layers} layers' weights")
    paths = bench_paths(config, tuple(args.rows), layers)
    names = sorted({p for shape in paths.values() for ts in shape.values() for p in ts})
    print(f"{'shape':>8} {'rows':>5} | " + " ".join(f"{n:>15}" for n in names) + " | best    ms per pass")
    for shape, per_rows in paths.items():
        for r, ts in per_rows.items():
            best = min(ts, key=ts.__getitem__)
            print(f"{shape:>8} {r:>5} | " + " ".join(f"{ts.get(n, float('nan')) * 1e3:>15.3f}" for n in names)
                  + f" | {best}")
    print("decode step's linears (every shape summed, ms):")
    for r in args.rows:
        sums = {n: sum(paths[s][r].get(n, float("nan")) for s in paths) * 1e3 for n in names}
        print(f"  rows {r:>5}: " + ", ".join(f"{n} {v:.2f}" for n, v in sums.items()))
    steps = bench_steps(config, args.model, tuple(args.batches)) if args.steps else {}
    if steps:
        print("paths the cached mode ran (gemm_choice's report):")
        for entry in G.report()["shapes"].values():
            if entry["dtype"] == "bfloat16":
                print(f"  {entry['shape']:>10} {entry['used_by']}: {entry['choice']} [{entry['source']}]")
        print(f"decode step, context {CONTEXT}, median ms (modes interleaved):")
        for b, per in steps.items():
            print(f"  batch {b:>3}: " + ", ".join(f"{m} {v:.2f}" for m, v in per.items())
                  + f"  invariant/cached {per['batch_invariant'] / per['cached']:.3f}")
    print(json.dumps({"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "model": config.name,
                      "layers": layers,
                      "paths_ms": {s: {str(r): {p: round(t * 1e3, 4) for p, t in ts.items()} for r, ts in v.items()}
                                   for s, v in paths.items()},
                      "steps_ms": {str(b): {m: round(v, 3) for m, v in per.items()} for b, per in steps.items()},
                      "gemm_choice": G.report() if steps else None}))


if __name__ == "__main__":
    main()
