"""Sampler cost per batch with and without the request features: ``python -m fastserve.bench.bench_sampler``.

Times ``Sampler.sample`` on random logits of SmolLM2's vocabulary (49,152) at batch 1/8/32, for
greedy and temperature sampling rows: plain (no feature), with penalties (presence, frequency
and repetition over a ``--history``-token output and prompt) and with logprobs (N=5). The plain
path is also timed on the sampler before the features (``--baseline-ref``'s
``fastserve/worker/sampler.py``, read from git into a module of its own), so the no-feature cost is seen
unchanged. Prints a table and, last, one JSON object with the figures (milliseconds per batch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fastserve.worker.messages import SamplingContext, SamplingParams
from fastserve.worker.sampler import Sampler

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49_152   # SmolLM2
BATCH_SIZES = (1, 8, 32)
TOP_LOGPROBS = 5
MODES = {"greedy": SamplingParams(temperature=0.0), "temperature": SamplingParams(temperature=0.8)}


def _median_ms(repeats: int, run: Callable[..., object], *args: Any) -> float:
    run(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def baseline_sampler(ref: str) -> Any | None:
    """``Sampler`` as it was at git ``ref`` (None when git or the ref is not there)."""
    try:
        source = subprocess.run(["git", "show", f"{ref}:fastserve/worker/sampler.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = module
    spec.loader.exec_module(module)
    return module.Sampler(0)


def bench(repeats: int, history: int, ref: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * history,), generator=gen).tolist()
    ctx = SamplingContext(output_ids=tuple(ids[:history]), prompt_ids=tuple(ids[history:]))
    ours, base = Sampler(0), baseline_sampler(ref)
    rows: dict[str, Any] = {}
    for mode, params in MODES.items():
        penalised = replace(params, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        logprobs = replace(params, logprobs=TOP_LOGPROBS)
        for batch in BATCH_SIZES:
            logits = torch.randn(batch, VOCAB, generator=gen)
            steps = [0] * batch
            case = {
                "plain": _median_ms(repeats, ours.sample, logits, [params] * batch, steps),
                "penalties": _median_ms(repeats, ours.sample, logits, [penalised] * batch, steps,
                                        [ctx] * batch),
                "logprobs": _median_ms(repeats, ours.sample_with_logprobs, logits, [logprobs] * batch, steps),
            }
            if base is not None:
                case["baseline_plain"] = _median_ms(repeats, base.sample, logits, [params] * batch, steps)
            rows[f"{mode}/b{batch}"] = case
    return {"vocab": VOCAB, "history_tokens": history, "top_logprobs": TOP_LOGPROBS,
            "baseline_ref": ref if base is not None else None, "threads": torch.get_num_threads(),
            "ms_per_batch": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--history", type=int, default=256, help="output and prompt tokens each (penalties)")
    ap.add_argument("--baseline-ref", default="main", help="git ref of the sampler before the features")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steady figures on a shared machine; 0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench(args.repeats, args.history, args.baseline_ref)
    cols = ["baseline_plain", "plain", "penalties", "logprobs"]
    print(f"sampler ms per batch, vocab {VOCAB}, {result['threads']} threads "
          f"(baseline = {result['baseline_ref']})")
    print(f"{'case':<16}" + "".join(f"{c:>16}" for c in cols))
    for name, case in result["ms_per_batch"].items():
        print(f"{name:<16}" + "".join(f"{case[c]:>16.3f}" if c in case else f"{'-':>16}" for c in cols))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
