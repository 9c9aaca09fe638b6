"""The scheduler on the real server under memory pressure: skip-join MLFQ against FCFS, per job.

One ``serve run`` of ``config/demo.yaml`` (the real SmolLM2 model, its own chat template and EOS)
with two applications, ``skip_join_mlfq`` and ``fcfs``, whose device KV pool is shrunk so that it
binds (``--device-blocks``; every request admitted, as in the paper). For each rate the same
ShareGPT chat prompts (one user message, greedy, ``max_tokens`` capped from the reference length,
so outputs end at the model's EOS or the cap) go to one policy and then the other. While a point
runs, ``/debug/engine`` is read every second for the α in effect and the measured step time.

Reported per policy and rate: per-token latency (mean, P95), TTFT, output tokens/s, and per job
(from each response's ``job_stats``): demotions, promotions, swap-outs, and the time it was
blocked on KV — the mean of its total, the longest single wait, and that longest against the
bound the scheduler means to keep: the largest α in effect plus one batch's worth of iterations (B × the measured step).
Then each policy's throughput at the SLO (mean and P95 per-token latency; the SLO is 10 decode
iterations of the demo's profile unless ``--slo`` says). A readable table, then one JSON object.

    python -m fastserve.bench.experiments.sched_real --rates 0.5,1,2,3 --num-prompts 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from fastserve.bench import chat as C
from fastserve.bench import prompts as P
from fastserve.bench.breakdown import STATS_PATH, engine_totals
from fastserve.bench.client import ClientConfig, run_requests, save_jsonl
from fastserve.bench.experiments.common import RESULTS_DIR
from fastserve.bench.experiments.server import ROOT, ServeApps
from fastserve.bench.metrics import RequestRecord, summarize, throughput_at_slo
from fastserve.bench.race import cpu_model
from fastserve.engine.step_stats import diff_totals
from fastserve.engine.step_stats import summarize as summarize_steps
from fastserve.scheduler.profile import Profile

POLICIES = ("skip_join_mlfq", "fcfs")
DEMO = ROOT / "config" / "demo.yaml"
POLL_S = 1.0
#: The SLO: this many decode iterations of the demo's profile per token (the paper's 10×).
SLO_ITERATIONS = 10.0


class EngineWatch:
    """Reads ``/debug/engine`` every second in a thread: the largest α and the step times seen."""

    def __init__(self, url: str) -> None:
        self.url = url + STATS_PATH
        self.steps_summary: dict[str, dict[str, float]] = {}
        self.alpha_max = 0.0
        self.steps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=POLL_S) as client:
            while not self._stop.wait(POLL_S):
                try:
                    stats = client.get(self.url).json()
                except (httpx.HTTPError, ValueError):
                    continue
                self.alpha_max = max(self.alpha_max, float(stats.get("starvation_alpha_s") or 0.0))
                if stats.get("step_time_s"):
                    self.steps.append(float(stats["step_time_s"]))

    def __enter__(self) -> EngineWatch:
        self._before = engine_totals(self.url.removesuffix(STATS_PATH))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.steps_summary = summarize_steps(diff_totals(engine_totals(self.url.removesuffix(STATS_PATH)),
                                                         self._before))


def per_job(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    stats = [r["server"] for r in records if r.get("server")]
    if not stats:
        return {}

    def mean(key: str) -> float:
        return statistics.fmean(float(s.get(key) or 0.0) for s in stats)

    def most(key: str) -> float:
        return max(float(s.get(key) or 0.0) for s in stats)

    return {"jobs": len(stats), "demotions": mean("demotions"), "promotions": mean("promotions"),
            "promotions_max": most("promotions"), "swaps_out": mean("swaps_out"),
            "swaps_out_max": most("swaps_out"), "kv_wait_mean_s": mean("swap_blocked_s"),
            "kv_wait_max_s": most("longest_swap_blocked_s")}


def run_point(url: str, requests: Sequence[Any], args: argparse.Namespace, batch: int,
              out: Path) -> dict[str, Any]:
    config = ClientConfig(base_url=url, prompt_mode="text", mode="chat", max_total_s=args.max_total_s,
                          progress=False, temperature=args.temperature, seed=args.seed,
                          system_prompt=args.system_prompt)
    with EngineWatch(url) as watch:
        records = asyncio.run(run_requests(requests, config))
    save_jsonl(records, out)
    summary = summarize([RequestRecord.from_dict(r) for r in records])
    step = statistics.fmean(watch.steps) if watch.steps else float("nan")
    jobs = per_job(records)
    bound = watch.alpha_max + batch * step
    return {"offered": len(records), "completed": summary.num_completed, "failed": summary.num_failed,
            "steps": watch.steps_summary,
            "per_token_mean_s": summary.per_token.mean, "per_token_p95_s": summary.per_token.p95,
            "ttft_mean_s": summary.ttft.mean, "output_tok_s": summary.output_token_throughput,
            "alpha_max_s": watch.alpha_max, "step_mean_s": step, "kv_wait_bound_s": bound,
            "within_bound": jobs.get("kv_wait_max_s", 0.0) <= bound,
            "output_lengths": C.output_lengths(records).to_dict(), **jobs}


def demo_q1() -> float:
    """q1 of the profile ``config/demo.yaml`` names (one decode iteration)."""
    raw = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    return Profile.load(ROOT / raw["applications"][0]["args"]["profile"]["path"]).q1


def demo_dtype() -> str:
    raw = yaml.safe_load(DEMO.read_text(encoding="utf-8"))
    return str(raw["applications"][0]["args"]["model"]["dtype"])


def print_steps(points: dict[str, list[dict[str, Any]]]) -> None:
    """Where each point's steps went: how full a decode step was, how many steps carried a
    prefill, and their mean cost (the engine's own breakdown, diffed over the point)."""
    print("\nSteps per point (engine breakdown): decode-only and mixed (with a prefill or chunk)")
    print("| policy | req/s | decode steps | jobs per decode | decode ms | mixed steps | jobs / tokens per mixed "
          "| mixed ms | swap wait ms (decode / mixed) |")
    print("|" + "---|" * 9)
    for policy, rows in points.items():
        for p in rows:
            d, m = p["steps"].get("decode", {}), p["steps"].get("mixed", {})
            print(f"| {policy} | {p['rate']:g} | {d.get('steps', 0):.0f} | {d.get('entries', 0):.1f} | "
                  f"{d.get('execute_ms', 0):.1f} | {m.get('steps', 0):.0f} | {m.get('entries', 0):.1f} / "
                  f"{m.get('tokens', 0):.0f} | {m.get('execute_ms', 0):.1f} | "
                  f"{d.get('swap_wait_ms', 0):.2f} / {m.get('swap_wait_ms', 0):.2f} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--dataset", choices=("sharegpt", "alpaca"), default="sharegpt")
    parser.add_argument("--device-blocks", type=int, default=128, help="device KV pool (16-token blocks)")
    parser.add_argument("--host-blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-total-s", type=float, default=300.0, help="bound on each point")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sched-real")
    parser.add_argument("--slo", type=float, default=None, help="per-token SLO (s); default: 10 × q1")
    C.add_mode_args(parser)
    parser.set_defaults(mode="chat")
    args = parser.parse_args(argv)
    if args.mode != "chat":
        parser.error("--mode: this experiment sends chat requests to the real model (real EOS)")
    # The small pool must hold one max-length request: the context is capped at the workload's.
    overrides = {"kv_cache": {"num_device_blocks": args.device_blocks, "num_host_blocks": args.host_blocks},
                 "model": {"max_model_len": args.context_len},
                 "scheduler": {"max_batch_size": args.batch, "admission_queue_limit": 100_000},
                 "engine": {"max_jobs": 100_000},
                 # Every request admitted, under both policies: a 429 after the admission wait
                 # would drop FCFS's slowest requests from its figures (it did: 19 of 40 at 1 req/s).
                 "server": {"admission_timeout_s": args.max_total_s}}
    samples = P.load_prompts(args.dataset)
    points: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    args.out.mkdir(parents=True, exist_ok=True)
    with ServeApps(POLICIES, args.out / "serve.log", args_overrides=overrides, base=DEMO) as apps:
        for k, rate in enumerate(args.rates):
            reqs = C.cap_requests(P.text_requests(samples, args.num_prompts, rate, args.seed, 1.0, k),
                                  C.eos_cap_from_args(args))
            for policy in POLICIES:
                started = time.monotonic()
                point = run_point(apps.url(policy), reqs, args, args.batch, args.out / f"{policy}-{rate:g}.jsonl")
                point.update(rate=rate, wall_s=time.monotonic() - started)
                points[policy].append(point)
                print(f"{policy:15s} {rate:5.2f} req/s  s/token {point['per_token_mean_s']:.3f} "
                      f"(P95 {point['per_token_p95_s']:.3f})  demotions {point.get('demotions', 0):.2f}  "
                      f"promotions {point.get('promotions', 0):.2f}  swap-outs {point.get('swaps_out', 0):.2f}  "
                      f"KV wait max {point.get('kv_wait_max_s', 0):.2f} s (bound {point['kv_wait_bound_s']:.2f})",
                      flush=True)
    print()
    print(f"Real server, {cpu_model()}: SmolLM2-135M dtype {demo_dtype()}, {args.dataset} chat (real EOS), "
          f"{args.num_prompts} prompts per rate, {args.device_blocks} device blocks, batch {args.batch}")
    header = ("| policy | req/s | completed | s/token mean | P95 | TTFT | tok/s | demotions/job | promotions/job | "
              "swap-outs/job | KV-blocked per job, mean (s) / longest wait for device space (s) | "
              "bound α + B·step (s) |")
    print(header)
    print("|" + "---|" * 12)
    for policy in POLICIES:
        for p in points[policy]:
            print(f"| {policy} | {p['rate']:g} | {p['completed']}/{p['offered']} | "
                  f"{p['per_token_mean_s']:.3f} | {p['per_token_p95_s']:.3f} | "
                  f"{p['ttft_mean_s']:.2f} | {p['output_tok_s']:.1f} | {p.get('demotions', 0):.2f} | "
                  f"{p.get('promotions', 0):.2f} (max {p.get('promotions_max', 0):.0f}) | "
                  f"{p.get('swaps_out', 0):.2f} (max {p.get('swaps_out_max', 0):.0f}) | "
                  f"{p.get('kv_wait_mean_s', 0):.2f} / {p.get('kv_wait_max_s', 0):.2f} | {p['kv_wait_bound_s']:.2f} |")
    print_steps(points)
    slo = args.slo or SLO_ITERATIONS * demo_q1()
    at_slo = {policy: {stat: asdict(throughput_at_slo([p["rate"] for p in points[policy]],
                                               [p[f"per_token_{stat}_s"] for p in points[policy]], slo))
                       for stat in ("mean", "p95")} for policy in POLICIES}
    print(f"\nThroughput at the SLO ({slo:.3f} s/token):")
    for policy in POLICIES:
        print(f"  {policy}: mean {at_slo[policy]['mean']['rate']:.2f} req/s ({at_slo[policy]['mean']['status']}), "
              f"P95 {at_slo[policy]['p95']['rate']:.2f} req/s ({at_slo[policy]['p95']['status']})")
    result = {"experiment": "sched_real", "cpu": cpu_model(), "device_blocks": args.device_blocks,
              "batch": args.batch, "slo_s": slo, "throughput_at_slo": at_slo, "points": points}
    (args.out / "sched_real.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
