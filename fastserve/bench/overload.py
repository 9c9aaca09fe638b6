"""Overload a server and watch it hold: ``python -m fastserve.bench.overload --base-url URL --factor 3 --duration 60``.

Three phases with real ShareGPT prompts: capacity (two bursts of ``--probe`` requests, the second
counted, as the first warms a fresh server; or ``--capacity``), overload (Poisson arrivals at
``--factor`` × capacity), recovery (``--recovery-load`` × capacity). Per 10 s window: requests offered,
accepted, refused with 429 (with ``Retry-After`` or not), other errors, P50/P95 per-token latency; the
engine replica's RSS. A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import numpy as np

from fastserve.bench import prompts as P
from fastserve.bench import workloads as W
from fastserve.bench.client import ClientConfig, check_base_url, run_requests
from fastserve.bench.metrics import RequestRecord, request_metrics
from fastserve.bench.race import cpu_model

DEFAULT_WINDOW_S = 10.0
STATS_PATH = "/debug/engine"
#: The capacity bursts' seed is the run's plus this (the overload phase uses the seed, recovery +1).
PROBE_SEED_OFFSET = 2


def scheduler_rss(base_url: str, headers: dict[str, str]) -> int | None:
    try:
        resp = httpx.get(base_url + STATS_PATH, headers=headers, timeout=30.0)
        value = resp.json().get("process_rss_bytes") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return None if value is None else int(value)


def poisson_phase(samples: list[P.PromptSample], rate: float, duration_s: float, seed: int, start_s: float,
                  output_scale: float, max_output: int | None, prefix: str) -> list[W.Request]:
    """Requests arriving at ``rate`` for ``duration_s`` seconds, offset by ``start_s``."""
    n = max(1, math.ceil(rate * duration_s))
    reqs = P.text_requests(samples, min(n, len(samples)), rate, seed, output_scale)
    return [replace(r, request_id=f"{prefix}-{i}", arrival_s=start_s + r.arrival_s,
                    output_len=r.output_len if max_output is None else min(r.output_len, max_output))
            for i, r in enumerate(reqs) if r.arrival_s < duration_s]


def measure_capacity(config: ClientConfig, samples: list[P.PromptSample], probe: int, seed: int,
                     output_scale: float, max_output: int | None) -> float:
    """Requests completed per second of a burst of ``probe`` requests sent at once, after an
    unmeasured burst of the same size."""
    def burst(part: int, prefix: str) -> list[W.Request]:
        # Own prompts per burst (``part``) and a seed the phases do not use: a prefix cache must
        # not make the measured burst cheaper than the traffic it sizes.
        reqs = P.text_requests(samples, probe, 1.0, seed + PROBE_SEED_OFFSET, output_scale, part=part)
        return [replace(r, request_id=f"{prefix}-{i}", arrival_s=0.0,
                        output_len=r.output_len if max_output is None else min(r.output_len, max_output))
                for i, r in enumerate(reqs)]

    asyncio.run(run_requests(burst(0, "warmup"), config))
    records = asyncio.run(run_requests(burst(1, "probe"), config))
    ok = [r for r in records if r["status"] == "ok"]
    elapsed = max((r["end"] for r in ok), default=0.0)
    return len(ok) / elapsed if elapsed > 0 else 0.0


def window_rows(records: list[dict[str, Any]], window_s: float, phase_of: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    last = max((r["scheduled_arrival"] for r in records), default=0.0)
    for k in range(int(last // window_s) + 1):
        lo, hi = k * window_s, (k + 1) * window_s
        inside = [r for r in records if lo <= r["scheduled_arrival"] < hi]
        if not inside:
            continue
        ok = [r for r in inside if r["status"] == "ok"]
        refused = [r for r in inside if r.get("http_status") == 429]
        per_token = [m.per_token for r in ok if (m := request_metrics(RequestRecord.from_dict(r))) is not None
                     and m.per_token is not None]
        rows.append({
            "window_s": [lo, hi], "phase": phase_of[inside[0]["request_id"]], "offered": len(inside),
            "accepted": len(ok), "rejected_429": len(refused),
            "retry_after_on_429": sum(1 for r in refused if r.get("retry_after")),
            "errors": len(inside) - len(ok) - len(refused),
            "errors_5xx": sum(1 for r in inside if (r.get("http_status") or 0) >= 500),
            "per_token_p50_s": float(np.percentile(per_token, 50)) if per_token else None,
            "per_token_p95_s": float(np.percentile(per_token, 95)) if per_token else None,
        })
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = check_base_url(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    config = ClientConfig(base_url=base, prompt_mode="text", progress=False, api_key=args.api_key,
                          max_total_s=args.duration + args.recovery + args.max_drain_s)
    samples = P.load_prompts(args.dataset)
    rss_start = scheduler_rss(base, headers)
    capacity = args.capacity or measure_capacity(config, samples, args.probe, args.seed, args.output_scale,
                                                 args.max_output_tokens)
    if capacity <= 0:
        raise RuntimeError("the capacity probe completed no request")
    overload = poisson_phase(samples, args.factor * capacity, args.duration, args.seed, 0.0,
                             args.output_scale, args.max_output_tokens, "overload")
    recovery = poisson_phase(samples, args.recovery_load * capacity, args.recovery, args.seed + 1,
                             args.duration, args.output_scale, args.max_output_tokens, "recovery")
    phase_of = {r.request_id: "overload" for r in overload} | {r.request_id: "recovery" for r in recovery}
    records = asyncio.run(run_requests(overload + recovery, config))
    rows = window_rows(records, args.window, phase_of)
    return {
        "cpu": cpu_model(), "capacity_req_s": capacity, "factor": args.factor, "duration_s": args.duration,
        "recovery_s": args.recovery, "offered": len(records),
        "accepted": sum(1 for r in records if r["status"] == "ok"),
        "rejected_429": sum(1 for r in records if r.get("http_status") == 429),
        "errors_5xx": sum(1 for r in records if (r.get("http_status") or 0) >= 500),
        "errors_other": sum(1 for r in records if r["status"] != "ok" and r.get("http_status") != 429
                            and (r.get("http_status") or 0) < 500),
        "windows": rows, "scheduler_rss_bytes": {"start": rss_start, "end": scheduler_rss(base, headers)},
    }


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def print_table(result: dict[str, Any]) -> None:
    print(f"CPU: {result['cpu']}; capacity {result['capacity_req_s']:.2f} req/s, offered {result['factor']}× "
          f"for {result['duration_s']:g} s, then recovery for {result['recovery_s']:g} s")
    print(f"{'window':>10} {'phase':>9} | {'offered':>7} {'ok':>5} {'429':>5} {'5xx':>4} {'other':>5} | "
          f"{'p50 s/tok':>9} {'p95 s/tok':>9}")
    for w in result["windows"]:
        lo, hi = w["window_s"]
        print(f"{lo:>4.0f}–{hi:<4.0f}s {w['phase']:>9} | {w['offered']:>7} {w['accepted']:>5} "
              f"{w['rejected_429']:>5} {w['errors_5xx']:>4} {w['errors'] - w['errors_5xx']:>5} | "
              f"{_fmt(w['per_token_p50_s']):>9} {_fmt(w['per_token_p95_s']):>9}")
    rss = result["scheduler_rss_bytes"]
    mib = {k: None if v is None else v / 2**20 for k, v in rss.items()}
    print(f"engine replica RSS: {_fmt(mib['start'])} → {_fmt(mib['end'])} MiB")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--factor", type=float, default=3.0, help="offered load as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    parser.add_argument("--recovery", type=float, default=30.0, help="seconds of light load after it")
    parser.add_argument("--recovery-load", type=float, default=0.3, help="light load as a multiple of capacity")
    parser.add_argument("--capacity", type=float, default=None, help="req/s; default: measure it first")
    parser.add_argument("--probe", type=int, default=24, help="requests sent at once to measure capacity")
    parser.add_argument("--dataset", choices=P.DATASETS, default="sharegpt")
    parser.add_argument("--output-scale", type=float, default=0.25)
    parser.add_argument("--max-output-tokens", type=int, default=None, help="cap every output length")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_S)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-drain-s", type=float, default=300.0, help="bound on finishing admitted requests")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    result = run(parse_args(argv))
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
