"""Sampler cost per batch, this tree against a git ref, interleaved: ``python -m fastserve.bench.bench_sampler``.

Times ``Sampler.sample_with_logprobs`` on logits shaped as SmolLM2's LM head gives them (49,152
bf16 values widened to float32; ``--logit-scale`` sets how peaked they are: the table reports the
tokens top-p keeps) at batch 1/16/32/64, for the request mixes a server sees: all greedy (the
race's chat clients), greedy with logprobs, all sampled (temperature, top-k and top-p: a chat
client's sampling), temperature alone, top-p alone, half greedy and half sampled (with and without
logprobs), and sampled with penalties over a ``--history``-token output and prompt.

Each case runs the sampler of ``--baseline-ref`` (its ``fastserve/worker/sampler.py`` read from git
into a module of its own) and this tree's alternately, call by call in one process, so a busy
machine slows both alike; the figure is each one's median and their ratio. On one thread (the
default) the clock is this thread's CPU time, which leaves out the time other processes hold the
core; on more, wall time. Beside them, the LM
head on the same rows (the model's packed bf16 GEMM for a ``--hidden``-wide model, its float32
output): the engine's ``sample`` phase is the head and the sampler together.

Prints a table and, last, one JSON object (milliseconds per batch, the CPU named).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fastserve.kernels.cpu_features import cpu_name
from fastserve.worker.messages import SamplingContext, SamplingParams
from fastserve.worker.model.gemm_choice import DECODE_ROWS, GemmPolicy, GemmRole
from fastserve.worker.model.linear import choose_for, multiply_widened, pack_weight
from fastserve.worker.sampler import Sampler, batched_filtered_probs

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49_152   # SmolLM2
HIDDEN = 576     # SmolLM2-135M: the LM head's input width
BATCH_SIZES = (1, 16, 32, 64)
TOP_LOGPROBS = 5
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
#: Rows' params by case: one entry is every row's, two alternate row by row.
CASES: dict[str, tuple[SamplingParams, ...]] = {
    "greedy": (GREEDY,),
    "greedy+logprobs": (replace(GREEDY, logprobs=TOP_LOGPROBS),),
    "sampled": (SAMPLED,),
    "temperature": (SamplingParams(temperature=0.8),),
    "top_p": (SamplingParams(temperature=0.8, top_p=0.95),),
    "mixed": (GREEDY, SAMPLED),
    "mixed+logprobs": (replace(GREEDY, logprobs=TOP_LOGPROBS), replace(SAMPLED, logprobs=TOP_LOGPROBS)),
    "penalties": (replace(SAMPLED, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),),
}

Call = Callable[[], object]


def baseline_module(ref: str) -> ModuleType | None:
    """``fastserve/worker/sampler.py`` as it is at git ``ref`` (None when git or the ref is not there)."""
    try:
        source = subprocess.run(["git", "show", f"{ref}:fastserve/worker/sampler.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = module
    spec.loader.exec_module(module)
    return module


def interleaved_ms(repeats: int, calls: Mapping[str, Call], clock: Callable[[], float]) -> dict[str, float]:
    """Median ms of each call on ``clock``, the calls taking turns (after one warm-up each), their
    order reversed every other round so none always runs right after the same neighbour."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    order = list(calls)
    for _ in range(repeats):
        for name in order:
            start = clock()
            calls[name]()
            times[name].append(clock() - start)
        order.reverse()
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def real_shaped_logits(batch: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Gaussian logits of standard deviation ``scale``, rounded to bf16 as the LM head's output is."""
    return (torch.randn(batch, VOCAB, generator=gen) * scale).bfloat16().float()


def lm_head(hidden: int, gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's LM head for a ``[VOCAB, hidden]`` bf16 weight, packed on the path chosen here."""
    weight = (torch.randn(VOCAB, hidden, generator=gen) * hidden ** -0.5).bfloat16()
    choice = choose_for(GemmRole("lm_head", (weight,), DECODE_ROWS[-1]), GemmPolicy())
    packed = None if choice is None else pack_weight(weight, choice)
    return lambda x: multiply_widened(x, weight, packed)


def bench(repeats: int, history: int, ref: str, scale: float, hidden: int,
          batches: tuple[int, ...]) -> dict[str, Any]:
    # On one thread every op (and the C kernels' OpenMP) runs on this thread: its CPU time leaves
    # out the time other processes take the core, which wall time on a shared machine does not.
    one_thread = torch.get_num_threads() == 1
    clock = time.thread_time if one_thread else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * history,), generator=gen).tolist()
    ctx = SamplingContext(output_ids=tuple(ids[:history]), prompt_ids=tuple(ids[history:]))
    base = baseline_module(ref)
    samplers: dict[str, Any] = {"new": Sampler(0)}
    if base is not None:
        samplers["old"] = base.Sampler(0)
    head = lm_head(hidden, gen)
    rows: dict[str, Any] = {}
    for batch in batches:
        logits = real_shaped_logits(batch, scale, gen)
        x = torch.randn(batch, hidden, generator=gen).bfloat16()
        with torch.inference_mode():
            head_ms = interleaved_ms(repeats, {"lm_head": functools.partial(head, x)}, clock)["lm_head"]
        for case, pattern in CASES.items():
            params = [pattern[i % len(pattern)] for i in range(batch)]
            contexts = [ctx] * batch if case == "penalties" else None
            steps = list(range(batch))
            calls = {name: functools.partial(s.sample_with_logprobs, logits, params, steps, contexts)
                     for name, s in samplers.items()}
            row: dict[str, Any] = interleaved_ms(repeats, calls, clock)
            if "old" in row:
                row["ratio"] = row["old"] / row["new"]
            row["lm_head"] = head_ms
            row["kept_tokens"] = kept_tokens(logits, params)
            rows[f"{case}/b{batch}"] = row
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "clock": "thread_cpu" if one_thread else "wall",
            "vocab": VOCAB, "hidden": hidden,
            "logit_scale": scale, "history_tokens": history, "top_logprobs": TOP_LOGPROBS,
            "baseline_ref": ref if base is not None else None, "repeats": repeats, "ms_per_batch": rows}


def kept_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> float | None:
    """Mean tokens with mass after the sampled rows' filters (None: no sampled row)."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return None
    probs = batched_filtered_probs(logits[rows], [params[i] for i in rows])
    return float(torch.count_nonzero(probs, dim=-1).double().mean())


def print_table(result: dict[str, Any]) -> None:
    print(f"sampler ms per batch ({result['clock']} time) on {result['cpu']}, {result['threads']} threads, "
          f"vocab {result['vocab']}, "
          f"logit scale {result['logit_scale']}; old = {result['baseline_ref']}, new = this tree")
    print(f"{'case':<22}{'old':>10}{'new':>10}{'old/new':>9}{'LM head':>10}{'kept tok':>10}")
    for name, row in result["ms_per_batch"].items():
        old = f"{row['old']:>10.3f}" if "old" in row else f"{'-':>10}"
        ratio = f"{row['ratio']:>9.2f}" if "ratio" in row else f"{'-':>9}"
        kept = f"{row['kept_tokens']:>10.0f}" if row["kept_tokens"] is not None else f"{'-':>10}"
        print(f"{name:<22}{old}{row['new']:>10.3f}{ratio}{row['lm_head']:>10.3f}{kept}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--history", type=int, default=256, help="output and prompt tokens each (penalties)")
    ap.add_argument("--baseline-ref", default="main", help="git ref of the sampler to compare against")
    ap.add_argument("--logit-scale", type=float, default=4.0, help="standard deviation of the random logits")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the LM head's input width")
    ap.add_argument("--batches", type=lambda v: tuple(int(b) for b in v.split(",")), default=BATCH_SIZES)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steady figures on a shared machine; 0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench(args.repeats, args.history, args.baseline_ref, args.logit_scale, args.hidden, args.batches)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
