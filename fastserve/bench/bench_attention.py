"""The C decode attention per layer, against an older revision of it: ``python -m fastserve.bench.bench_attention``.

Times ``fastserve.kernels.cpu_ops.paged_attention`` on SmolLM2-135M's decode shapes (9 query heads over 3
KV heads of 64 dims, blocks of 16 tokens) at each ``--batch`` and ``--context``, for a float32
and a bfloat16 cache, through per-layer views of a block-major pool of ``--layers`` layers (the
executor's layout, so a block's K and V of one layer lie ``layers`` apart). The query has the
model's dtype (bf16 with a bf16 cache, as when the model runs in bf16); ``--query-dtype float32``
times a float32 query over a bf16 cache instead (the kernel then widens keys rather than using
vdpbf16ps). The same calls on the kernel source at git ``--baseline-ref`` (built the same way)
give the before column; ``--baseline-ref ''`` skips it. Prints a table, then one JSON object
last with the figures (milliseconds per layer, median of ``--repeats``) and the CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastserve.bench.race import cpu_model
from fastserve.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "fastserve/kernels/cpu/paged_attention.c"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16   # SmolLM2-135M
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WARMUP = 3


def baseline_library(ref: str) -> ctypes.CDLL | None:
    """The kernel as it was at git ``ref``, built and loaded (None when git or the ref is not there)."""
    folder = Path(tempfile.mkdtemp())
    # The kernel and the headers beside it (it includes simd_math.h), each as it was at ``ref``.
    headers = sorted(h.relative_to(ROOT).as_posix() for h in (ROOT / SOURCE).parent.glob("*.h"))
    for source in (SOURCE, *headers):
        try:
            text = subprocess.run(["git", "show", f"{ref}:{source}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            if source == SOURCE:
                return None
            continue
        name = "paged_attention_baseline.c" if source == SOURCE else Path(source).name
        (folder / name).write_text(text)
    return cpu_ops.load(folder / "paged_attention_baseline.c")


def case(batch: int, context: int, layers: int, cache_dtype: torch.dtype, query_dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Query, K and V layer views, block tables and context lengths for one batch."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    pool = torch.randn(batch * per_seq, layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(cache_dtype)
    order = torch.randperm(batch * per_seq, generator=gen)   # scattered blocks, as a busy pool has
    tables = order.view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(query_dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return query, pool[:, layers // 2, 0], pool[:, layers // 2, 1], tables, lens


def median_ms(repeats: int, args: tuple[torch.Tensor, ...], library: ctypes.CDLL | None) -> float:
    query, key, value, tables, lens = args
    for _ in range(WARMUP):
        cpu_ops.paged_attention(query, key, value, tables, lens, HEAD_DIM**-0.5, library=library)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_ops.paged_attention(query, key, value, tables, lens, HEAD_DIM**-0.5, library=library)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    if not cpu_ops.available():
        raise SystemExit("the C kernels did not build on this machine")
    base = baseline_library(args.baseline_ref) if args.baseline_ref else None
    rows = []
    for name, cache_dtype in CACHE_DTYPES.items():
        query_dtype = cache_dtype if args.query_dtype == "model" else torch.float32
        for batch in args.batch:
            tensors = case(batch, args.context, args.layers, cache_dtype, query_dtype)
            kv_bytes = 2 * batch * args.context * NUM_KV_HEADS * HEAD_DIM * tensors[1].element_size()
            ms = median_ms(args.repeats, tensors, None)
            before = median_ms(args.repeats, tensors, base) if base is not None else None
            rows.append({"cache": name, "query": str(query_dtype).removeprefix("torch."), "batch": batch,
                         "context": args.context, "ms_per_layer": round(ms, 4),
                         "baseline_ms_per_layer": None if before is None else round(before, 4),
                         "kv_gb_s": round(kv_bytes / ms / 1e6, 2)})
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "baseline_ref": args.baseline_ref or None,
            "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                      "block_size": BLOCK_SIZE, "layers": args.layers}, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"C decode attention per layer, {result['cpu']}, {result['threads']} threads; "
          f"baseline {result['baseline_ref'] or '-'}")
    print(f"{'cache':>9} {'query':>9} {'batch':>5} {'context':>7} {'before ms':>9} {'ms':>8} "
          f"{'speedup':>7} {'K+V GB/s':>8} {'x layers ms':>11}")
    for row in result["rows"]:
        before = row["baseline_ms_per_layer"]
        speedup = f"{before / row['ms_per_layer']:.1f}x" if before else "-"
        print(f"{row['cache']:>9} {row['query']:>9} {row['batch']:>5} {row['context']:>7} "
              f"{before if before is not None else '-':>9} {row['ms_per_layer']:>8.3f} {speedup:>7} "
              f"{row['kv_gb_s']:>8.1f} {row['ms_per_layer'] * result['shape']['layers']:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30, help="layers in the pool (SmolLM2-135M: 30)")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--query-dtype", choices=("model", "float32"), default="model")
    parser.add_argument("--baseline-ref", default="main", help="git ref of the kernel to compare; '' for none")
    args = parser.parse_args()
    if min(args.batch) < 1 or args.context < 1 or args.layers < 1 or args.repeats < 1:
        raise SystemExit(f"--batch {args.batch}, --context {args.context}, --layers {args.layers} and "
                         f"--repeats {args.repeats} must all be at least 1")
    result = bench(args)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
