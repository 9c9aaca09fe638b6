"""Where the time per token goes: ``python -m fastserve.bench.breakdown --base-url URL``.

At light and saturating load (``--concurrency``), real ShareGPT prompts with a fixed output length,
the engine's step totals (``GET /debug/engine``) read before and after: the decode step by phase
(``sample``'s LM head apart, on CPU) and the loop's overhead, TPOT beside the engine's cycle, the
delivery delay, TTFT. ``--model-profile`` (``--model-only``: without a server) adds the model's
decode step by operator family from torch's profiler. Tables, then one JSON object with every
figure and the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx

from fastserve.bench import prompts as P
from fastserve.bench.client import ClientConfig, check_base_url, run_requests
from fastserve.bench.metrics import RequestRecord
from fastserve.bench.metrics import summarize as summarize_run
from fastserve.bench.race import cpu_model
from fastserve.engine.step_stats import diff_totals, summarize

STATS_PATH = "/debug/engine"
DEFAULT_OUTPUT_TOKENS = 64
DEFAULT_CONCURRENCY = 16
DEFAULT_ROUNDS = 2
DEFAULT_MODEL_CONFIG = "config/models/opt-125m"
#: Operators listed by self time in the model profile.
TOP_OPS = 8


def engine_totals(base_url: str) -> dict[str, dict[str, float]]:
    resp = httpx.get(base_url + STATS_PATH, timeout=30.0)
    resp.raise_for_status()
    totals: dict[str, dict[str, float]] = resp.json()["step_totals"]
    return totals


def _requests(n: int, output_tokens: int, seed: int) -> list[Any]:
    base = P.text_requests(P.load_sharegpt_prompts(), n, rate=1.0, seed=seed)
    return [replace(r, arrival_s=0.0, output_len=output_tokens) for r in base]


def measure(base_url: str, streams: int, rounds: int, output_tokens: int, seed: int) -> dict[str, Any]:
    """``rounds`` bursts of ``streams`` concurrent requests; client, server and engine figures."""
    config = ClientConfig(base_url=base_url, prompt_mode="text", progress=False, max_total_s=600.0)
    before = engine_totals(base_url)
    records: list[dict[str, Any]] = []
    for k in range(rounds):
        records += asyncio.run(run_requests(_requests(streams, output_tokens, seed + k), config))
    steps = summarize(diff_totals(engine_totals(base_url), before))
    run = summarize_run([RequestRecord.from_dict(r) for r in records])
    servers = [r["server"] for r in records if r.get("server")]

    def mean_of(key: str) -> float | None:
        values = [s[key] for s in servers if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    decode = steps.get("decode", {})
    tpot = run.tpot.mean
    cycle = decode.get("cycle_ms", decode.get("execute_ms", float("nan"))) / 1e3
    delivery = mean_of("delivery_s")
    return {
        "streams": streams, "requests": len(records), "failed": run.num_failed,
        "client": {"ttft_s": run.ttft.mean, "tpot_s": tpot, "per_token_s": run.per_token.mean,
                   "output_tok_s": run.output_token_throughput},
        "server": {"queue_s": mean_of("queue_s"), "exec_s": mean_of("exec_s"), "delivery_s": delivery},
        "per_token_split_s": {"engine_cycle": cycle, "delivery_delay": delivery},
        "steps": steps,
    }


def model_profile(batch_sizes: Sequence[int], context: int, model_config: str = DEFAULT_MODEL_CONFIG,
                  dtype: str = "float32") -> dict[str, dict[str, Any]]:
    """The model's decode step in this process, ms per step by operator family, and the
    operators that took the most of it (``top_ops``: self time, ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    from fastserve.config_model import resolve_path
    from fastserve.kernels import cpu_step
    from fastserve.worker.executor import InProcessExecutor
    from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, blocks_for
    from fastserve.worker.spec import ModelSpec

    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    out: dict[str, dict[str, float]] = {}
    steps = 5
    for b in batch_sizes:
        per_seq = blocks_for(context + steps + 2, 16)
        ex = InProcessExecutor(ModelSpec(resolve_path(model_config), b * per_seq, 0, 16, dtype, gemm_choice="cached"))
        tables = [tuple(range(j * per_seq, (j + 1) * per_seq)) for j in range(b)]
        prompt = tuple(range(2, 2 + context))
        ex.execute(BatchPlan(0, tuple(BatchEntry(str(j), prompt, 0, tables[j], True, greedy) for j in range(b))))

        def decode(k: int, ex: InProcessExecutor = ex, b: int = b, tables: list[tuple[int, ...]] = tables) -> Any:
            return ex.execute(BatchPlan(1 + k, tuple(
                BatchEntry(str(j), (7,), context + k, tables[j], False, greedy, k + 1) for j in range(b))))

        decode(0)
        kernel_steps: list[tuple[dict[str, float], dict[str, float]]] = []
        for k in range(steps):   # the C run's calls by family (the profiler sees none of them)
            with cpu_step.timed() as kernels:
                timings = decode(1 + k).timings
            kernel_steps.append((kernels, timings))
        head_s = _head_seconds(ex, b, steps)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            timings = [decode(1 + steps + k).timings for k in range(steps)]
        families = {"linear": 0.0, "lm_head": 0.0, "other_ops": 0.0}
        vocab = ex.config.vocab_size
        for evt in prof.events():
            if evt.cpu_parent is not None:   # count top-level aten ops once
                continue
            ms = evt.cpu_time_total / 1e3
            shapes = evt.input_shapes or []
            if evt.name in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul",
                            "mkldnn::_linear_pointwise"):
                is_head = any(vocab in shape for shape in shapes if isinstance(shape, list))
                families["lm_head" if is_head else "linear"] += ms
            elif evt.name.startswith("aten::"):
                families["other_ops"] += ms
        step_ms = 1e3 * statistics.fmean(t["total"] for t in timings)
        row: dict[str, Any] = {name: ms / steps for name, ms in families.items()}
        by_self = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_OPS]
        row["top_ops"] = {a.key: a.self_cpu_time_total / 1e3 / steps for a in by_self}
        row["step_ms"] = step_ms
        # What the profiler does not see: the C decode attention (ctypes) and Python around ops.
        row["attention_and_python"] = step_ms - sum(row[k] for k in families)
        row["c_run"] = _c_run_split(kernel_steps, head_s)
        out[str(b)] = row
        ex.close()
    return out


def _head_seconds(ex: Any, rows: int, repeats: int) -> float:
    """The LM head alone (final norm and the vocabulary GEMM) on ``rows`` rows, median of ``repeats``."""
    import torch

    hidden = torch.randn(rows, ex.config.hidden_size).to(next(ex.model.parameters()).dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            ex.model.logits(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _c_run_split(steps: list[tuple[dict[str, float], dict[str, float]]], head_s: float) -> dict[str, float]:
    """A step in ms, each part the median over ``steps`` (kernel seconds by family, the step's
    timings): the C run's kernel families (none where the module path ran), the rest of the
    forward (embedding, rotary angles, Python between the calls), the LM head and the sampler
    (``sample`` less the head), the batch build and what is left of the step."""
    def median(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    families = sorted({f for kernels, _ in steps for f in kernels})
    split = {f: median([kernels.get(f, 0.0) for kernels, _ in steps]) for f in families}
    mean = {k: median([t.get(k, 0.0) for _, t in steps]) for k in ("total", "build", "forward", "sample")}
    split["forward_outside_kernels"] = mean["forward"] - sum(split.values())
    # The step's own head time where it reports one (CPU), else the head timed alone.
    measured = [t["lm_head"] for _, t in steps if "lm_head" in t]
    split["lm_head"] = median(measured) if len(measured) == len(steps) else head_s * 1e3
    split["sampler"] = mean["sample"] - split["lm_head"]
    split["build"] = mean["build"]
    split["step_rest"] = mean["total"] - mean["forward"] - mean["sample"] - mean["build"]
    split["step_total"] = mean["total"]
    return split


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1e3 * value:.1f}"


def print_tables(result: dict[str, Any]) -> None:
    print(f"CPU: {result['cpu']}; {result['output_tokens']} output tokens per request, ShareGPT prompts")
    print(f"{'load':>14} | {'TTFT':>6} | {'TPOT':>6} {'cycle':>6} {'deliver':>7} ms | "
          f"{'batch':>5} | {'sched':>5} {'build':>5} {'fwd':>6} {'sample':>6} {'head':>5} {'update':>6} | "
          f"{'overhead':>8}")
    for label, m in result["loads"].items():
        d = m["steps"].get("decode", {})
        split = m["per_token_split_s"]
        print(f"{label:>14} | {_ms(m['client']['ttft_s']):>6} | {_ms(m['client']['tpot_s']):>6} "
              f"{_ms(split['engine_cycle']):>6} {_ms(split['delivery_delay']):>7}    | "
              f"{d.get('entries', 0):>5.1f} | {d.get('schedule_ms', 0):>5.2f} {d.get('build_ms', 0):>5.2f} "
              f"{d.get('forward_ms', 0):>6.1f} {d.get('sample_ms', 0):>6.1f} {d.get('lm_head_ms', 0):>5.1f} "
              f"{d.get('update_ms', 0):>6.2f} | "
              f"{100 * d.get('overhead_share', 0):>7.1f}%")
    for b, row in result.get("model_profile", {}).items():
        print(f"model decode step, batch {b}: {row['step_ms']:.1f} ms = linear {row['linear']:.1f} + "
              f"LM head {row['lm_head']:.1f} + other ops {row['other_ops']:.1f} + "
              f"attention (C) and Python {row['attention_and_python']:.1f}")
        print("    most self time (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in row["top_ops"].items()))
        split = ", ".join(f"{k} {v:.2f}" for k, v in row["c_run"].items())
        print(f"    by kernel (ms/step, unprofiled steps): {split}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-profile", action="store_true", help="also profile the model in process")
    parser.add_argument("--context", type=int, default=170, help="context length for --model-profile")
    parser.add_argument("--model-only", action="store_true",
                        help="only the in-process model profile (no server), at --batches")
    parser.add_argument("--model-config", default=DEFAULT_MODEL_CONFIG, help="for the model profile")
    parser.add_argument("--dtype", default="float32", help="for the model profile (auto: as the server resolves)")
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16])
    args = parser.parse_args(argv)
    if args.model_only:
        profile = {"cpu": cpu_model(), "model_config": args.model_config, "dtype": args.dtype,
                   "context": args.context,
                   "model_profile": model_profile(args.batches, args.context, args.model_config, args.dtype)}
        print(f"CPU: {profile['cpu']}; {args.model_config}, dtype {args.dtype}, context {args.context}")
        print_tables({**profile, "output_tokens": 0, "loads": {}})
        print(json.dumps(profile))
        return
    base = check_base_url(args.base_url)
    result: dict[str, Any] = {"cpu": cpu_model(), "output_tokens": args.output_tokens, "loads": {}}
    result["loads"]["light (1)"] = measure(base, 1, 4 * args.rounds, args.output_tokens, args.seed)
    result["loads"][f"saturated ({args.concurrency})"] = measure(base, args.concurrency, args.rounds,
                                                                 args.output_tokens, args.seed)
    if args.model_profile:
        result["model_profile"] = model_profile(args.batches, args.context, args.model_config, args.dtype)
    print_tables(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
