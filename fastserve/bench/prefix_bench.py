"""Prefix caching on the real server: ``python -m fastserve.bench.prefix_bench``.

A workload whose prompts share prefixes (``fastserve.bench.prefix_workloads``) sent rate by rate to
our server, as two applications differing only in the setting under test (``--setup cache``:
prefix caching on/off; ``host-tier``: a small device pool, the host tier on/off), and to any peer
(``--system NAME=URL``), with the race's client. Per system and rate: latencies, throughput and the
prefix hit rate (each cached count of ours checked: a multiple of the block size, below the prompt,
equal in ``usage`` and ``job_stats``); then throughput at the SLO and ratios. A table, then JSON.

    python -m fastserve.bench.prefix_bench --setup cache --workload multi-turn --system vllm=http://127.0.0.1:8100 \\
        --rates 0.25,1 --num-prompts 60 --turns 5 --eos-max-tokens 96 --out results/prefix/multi-turn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fastserve.bench import chat as C
from fastserve.bench import prefix_workloads as PW
from fastserve.bench import prompts as P
from fastserve.bench import race as R
from fastserve.bench.client import ClientConfig, run_requests, save_jsonl
from fastserve.bench.experiments.server import ROOT, ServeApps
from fastserve.bench.metrics import RequestRecord, summarize, throughput_at_slo

DEMO = ROOT / "config" / "demo.yaml"
BLOCK_SIZE = 16
#: Host-tier setup: below a multi-turn prefix working set, above the largest job (128 blocks).
DEFAULT_SMALL_POOL = 192
DEFAULT_RATES = (0.25, 1.0)
#: Further per-token SLOs (s/token): 1.5x, 2x, 3x vLLM's light-load per-token latency here.
DEFAULT_SLOS = (0.15, 0.2, 0.3)
#: Prometheus families (any prefix, ``_total`` or not) read from a peer's ``/metrics``.
METRIC_SUFFIXES = ("prefix_cache_queries", "prefix_cache_hits")
METRICS_TIMEOUT_S = 10.0


def setup_variants(setup: str, device_blocks: int, context_len: int) -> dict[str, dict[str, dict[str, Any]]]:
    """name → ``args`` section → settings; the small host-tier pool caps the context at the workload's."""
    if setup == "cache":
        return {"cache-on": {"kv_cache": {"prefix_caching": True}},
                "cache-off": {"kv_cache": {"prefix_caching": False}}}
    if setup == "host-tier":
        return {f"host-{side}": {"kv_cache": {"prefix_caching": True, "num_device_blocks": device_blocks,
                                              "host_prefix_cache": on},
                                 "model": {"max_model_len": context_len}}
                for side, on in (("on", True), ("off", False))}
    if setup == "none":
        return {}
    raise ValueError(f"unknown setup {setup!r}: cache | host-tier | none")


def parse_system(spec: str) -> tuple[str, str]:
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"--system wants NAME=URL, got {spec!r}")
    return name, url


def metric_counters(client: httpx.Client, url: str) -> dict[str, float] | None:
    """Sums of the prefix-cache counters a server's ``/metrics`` shows; None if it shows none."""
    try:
        text = client.get(url + "/metrics", timeout=METRICS_TIMEOUT_S).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for suffix in METRIC_SUFFIXES:
            if family.name.endswith(suffix):
                out[suffix] = out.get(suffix, 0.0) + sum(
                    s.value for s in family.samples if not s.name.endswith("_created"))
    return out or None


def repeats_earlier(record: Mapping[str, Any], index: int) -> bool:
    turn = record.get("turn")
    return bool(turn) if turn is not None else index > 0


def cache_checks(records: Sequence[dict[str, Any]], block_size: int) -> dict[str, Any]:
    """Hit rates, and every response whose cached count is impossible or disagrees with ``job_stats``."""
    ok = [r for r in records if r.get("prompt_tokens")]
    later = [r for i, r in enumerate(ok) if repeats_earlier(r, i)]
    bad: list[dict[str, Any]] = []
    for r in ok:
        cached = r.get("cached_tokens") or 0   # our usage omits the details when none were cached
        stats = r.get("server") or {}            # our job_stats
        reasons = []
        if cached >= r["prompt_tokens"]:
            reasons.append("cached >= prompt")
        if stats and cached % block_size:
            reasons.append(f"cached not a multiple of {block_size}")
        if stats and "cached_tokens" in stats and stats["cached_tokens"] != cached:
            reasons.append(f"job_stats.cached_tokens {stats['cached_tokens']}")
        if reasons:
            bad.append({"request_id": r.get("request_id"), "cached_tokens": cached,
                        "prompt_tokens": r["prompt_tokens"], "why": reasons})
    return {"hit_rate": PW.hit_rate(ok), "hit_rate_repeats": PW.hit_rate(later),
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
            "reported": sum(r.get("cached_tokens") is not None for r in ok), "bad_cached": bad}


def run_point(config: ClientConfig, requests: Sequence[Any],
              convs: Sequence[PW.Conversation]) -> list[dict[str, Any]]:
    if convs:
        return asyncio.run(PW.run_conversations(convs, config))
    return asyncio.run(run_requests(requests, config))


def point_row(records: list[dict[str, Any]], counters: tuple[dict[str, float] | None, ...],
              wall_s: float) -> dict[str, Any]:
    s = summarize([RequestRecord.from_dict(r) for r in records])
    row = R.point_row(s, records)
    row.update(ttft_p95_s=s.ttft.p95, wall_s=wall_s, **cache_checks(records, BLOCK_SIZE))
    before, after = counters
    if before is not None and after is not None:
        queries = after.get("prefix_cache_queries", 0.0) - before.get("prefix_cache_queries", 0.0)
        hits = after.get("prefix_cache_hits", 0.0) - before.get("prefix_cache_hits", 0.0)
        row["metrics"] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}
    return row


def bench(args: argparse.Namespace, urls: Mapping[str, str], external: Sequence[str]) -> dict[str, Any]:
    args.mode = "chat"
    rates = sorted(args.rates)
    samples = P.load_prompts(args.dataset)
    if args.workload == "shared-system" and args.system_prompt is None:
        args.system_prompt = PW.shared_system_prompt(samples, args.system_words, args.seed)
    points: dict[str, dict[float, dict[str, Any]]] = {name: {} for name in urls}
    for url in urls.values():   # /health, then unrecorded warm-up requests (fastserve.bench.race)
        R.warm_up(args, samples, R.client_config(args, url, None))
    with httpx.Client() as scraper:
        for part, rate in enumerate(rates):
            requests = R.point_requests(args, samples, rate, part) if args.workload == "shared-system" else []
            convs = R.conversation_point(args, samples, rate, part) if args.workload == "multi-turn" else []
            for name, url in urls.items():
                config = R.client_config(args, url, None)
                before = metric_counters(scraper, url) if name in external else None
                t0 = time.perf_counter()
                records = run_point(config, requests, convs)
                wall = time.perf_counter() - t0
                after = metric_counters(scraper, url) if name in external else None
                if args.records is not None:
                    save_jsonl(records, args.records / f"{args.workload}-{name}-rate{rate:g}.jsonl")
                row = points[name][rate] = point_row(records, (before, after), wall)
                print(f"  {name:9} rate {rate:g}: TTFT {R._fmt(row['ttft_mean_s'])} s, per-token "
                      f"{R._fmt(row['per_token_mean_s'])} s, hit {R._pct(row['hit_rate'])}, "
                      f"{row['completed']} ok, {row['failed']} failed, {wall:.0f} s", flush=True)
    return summarize_bench(args, rates, points, list(urls))


def summarize_bench(args: argparse.Namespace, rates: list[float], points: dict[str, dict[float, dict[str, Any]]],
                    names: list[str]) -> dict[str, Any]:
    reference = args.slo_from or names[-1]
    if reference not in points:
        raise SystemExit(f"--slo-from {reference!r} is none of {names}")
    slo = args.slo if args.slo is not None else args.slo_factor * points[reference][rates[0]]["per_token_mean_s"]
    at_slo = {name: throughput_at_slo(rates, [points[name][r]["per_token_mean_s"] for r in rates], slo)
              for name in names}
    str_points = {name: {str(r): row for r, row in pts.items()} for name, pts in points.items()}
    ratios = {name: {str(r): {key: R.ratio(points[name][r][key], points[reference][r][key])
                              for key in ("ttft_mean_s", "ttft_p95_s", "per_token_mean_s", "per_token_p95_s",
                                          "output_tok_s")}
                     for r in rates} for name in names if name != reference}
    unit = "conversations/s" if args.workload == "multi-turn" else "requests/s"
    return {"cpu": R.cpu_model(), "workload": args.workload, "setup": args.setup, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "turns": args.turns if args.workload == "multi-turn" else None,
            "system_prompt_words": args.system_words if args.workload == "shared-system" else None,
            "dtype": args.dtype, "device_blocks": args.device_blocks if args.setup == "host-tier" else None,
            "variants": setup_variants(args.setup, args.device_blocks, args.context_len),
            "temperature": args.temperature,
            "eos_cap": asdict(C.eos_cap_from_args(args)), "seed": args.seed, "rates": rates, "rate_unit": unit,
            "slo_s": slo, "slo_reference": reference,
            "points": str_points,
            "throughput_at_slo": {name: t.to_dict() for name, t in at_slo.items()},
            "throughput_at_slos": slo_sweep(str_points, rates, args.slos),
            "ratios_to_reference": ratios}


def slo_sweep(points: Mapping[str, Mapping[str, Mapping[str, Any]]], rates: Sequence[float],
              slos: Sequence[float]) -> dict[str, dict[str, Any]]:
    """Each system's throughput at each of ``slos`` (s/token, mean per-token latency), from the
    same measured points: the race's SLO of 10x a light-load latency is seldom crossed on a
    closed-loop workload, so tighter ones show where the curves part."""
    return {f"{slo:g}": {name: throughput_at_slo(rates, [pts[str(r)]["per_token_mean_s"] for r in rates],
                                                 slo).to_dict()
                         for name, pts in points.items()} for slo in slos}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['workload']} ({result['setup']}), {result['num_prompts']} requests per rate "
          f"(rates in {result['rate_unit']}), chat, greedy, cap {result['eos_cap']}, {result['dtype']}, "
          f"CPU: {result['cpu']}")
    print(f"{'system':9} {'rate':>5} | {'TTFT mean':>9} {'p95':>6} | {'per-token':>9} {'p95':>6} | "
          f"{'TPOT ms':>7} | {'tok/s':>6} | {'hit':>5} {'repeat':>6} {'metrics':>7} | ok/failed | bad")
    for name, pts in result["points"].items():
        for rate in result["rates"]:
            row = pts[str(rate)]
            metrics = (row.get("metrics") or {}).get("hit_rate")
            print(f"{name:9} {rate:>5g} | {R._fmt(row['ttft_mean_s']):>9} {R._fmt(row['ttft_p95_s']):>6} | "
                  f"{R._fmt(row['per_token_mean_s']):>9} {R._fmt(row['per_token_p95_s']):>6} | "
                  f"{R._fmt(1e3 * row['tpot_mean_s'], 1):>7} | {R._fmt(row['output_tok_s'], 1):>6} | "
                  f"{R._pct(row['hit_rate']):>5} {R._pct(row['hit_rate_repeats']):>6} {R._pct(metrics):>7} | "
                  f"{row['completed']:>3}/{row['failed']:<5} | {len(row['bad_cached'])}")
    print(f"\noutput tokens: {'system':9} {'rate':>5} | mean / P50 / max | stop")
    for name, pts in result["points"].items():
        for rate in result["rates"]:
            n = pts[str(rate)]["output_lengths"]
            print(f"               {name:9} {rate:>5g} | {R._fmt(n['mean'], 1)} / {R._fmt(n['p50'], 0)} / "
                  f"{n['max']} | {R._pct(n['stop_share'])}")
    print(f"\nthroughput at SLO {result['slo_s']:.3f} s/token (reference {result['slo_reference']}):")
    for name, t in result["throughput_at_slo"].items():
        print(f"  {name:9} {t['rate']:.3f} {result['rate_unit']} ({t['status']})")
    for slo, by_name in result.get("throughput_at_slos", {}).items():
        print(f"  at {slo} s/token: " + ", ".join(f"{name} {t['rate']:.2f} ({t['status']})"
                                                   for name, t in by_name.items()))
    for name, by_rate in result["ratios_to_reference"].items():
        for rate, r in by_rate.items():
            print(f"  {name} ÷ {result['slo_reference']} at {rate}: TTFT {R._fmt(r['ttft_mean_s'], 2)} "
                  f"(p95 {R._fmt(r['ttft_p95_s'], 2)}), per-token {R._fmt(r['per_token_mean_s'], 2)} "
                  f"(p95 {R._fmt(r['per_token_p95_s'], 2)}), tok/s {R._fmt(r['output_tok_s'], 2)}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--setup", choices=("cache", "host-tier", "none"), default="cache")
    parser.add_argument("--workload", choices=("multi-turn", "shared-system"), default="multi-turn")
    parser.add_argument("--system", type=parse_system, action="append", default=[],
                        help="NAME=URL of a running OpenAI-compatible server to include (loopback)")
    parser.add_argument("--dtype", default="float32", help="model.dtype of our applications")
    parser.add_argument("--device-blocks", type=int, default=DEFAULT_SMALL_POOL,
                        help="host-tier setup: kv_cache.num_device_blocks")
    parser.add_argument("--dataset", choices=P.DATASETS, default="sharegpt")
    C.add_mode_args(parser)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_RATES),
                        help="multi-turn: conversations started per second; shared-system: requests per second")
    parser.add_argument("--num-prompts", type=int, default=60, help="requests (multi-turn: turns) per rate")
    parser.add_argument("--turns", type=int, default=5, help="multi-turn: user turns per conversation")
    parser.add_argument("--system-words", type=int, default=PW.DEFAULT_SYSTEM_WORDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=None)
    parser.add_argument("--slo-factor", type=float, default=R.DEFAULT_SLO_FACTOR)
    parser.add_argument("--slos", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_SLOS),
                        help="also report throughput at these per-token SLOs (s/token, comma-separated)")
    parser.add_argument("--slo-from", default=None, help="reference system (default: first --system, "
                                                         "else the last of ours)")
    parser.add_argument("--max-total-s", type=float, default=600.0, help="bound on each point")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--records", type=Path, default=None, help="folder for per-point request records")
    parser.add_argument("--warmup", type=int, default=R.DEFAULT_WARMUP,
                        help="unrecorded requests sent to each system, one at a time, before the first rate")
    parser.add_argument("--ready-timeout-s", type=float, default=R.DEFAULT_READY_TIMEOUT_S,
                        help="bound on waiting for each system's /health before the warm-up")
    parser.add_argument("--serve-log", type=Path, default=Path("/tmp/prefix_bench_serve.log"))
    parser.add_argument("--recheck", type=Path, default=None,
                        help="recompute the cache checks of this result JSON from --records; no run")
    args = parser.parse_args(argv)
    if args.slo_from is None and args.system:
        args.slo_from = args.system[0][0]
    if args.setup == "none" and not args.system and args.recheck is None:
        parser.error("--setup none needs at least one --system")
    return args


def finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def recheck(result: dict[str, Any], records: Path) -> dict[str, Any]:
    """``result`` with every point's cache fields recomputed from its saved request records."""
    for name, pts in result["points"].items():
        for rate, row in pts.items():
            path = records / f"{result['workload']}-{name}-rate{float(rate):g}.jsonl"
            lines = path.read_text(encoding="utf-8").splitlines()
            row.update(cache_checks([json.loads(line) for line in lines if line.strip()], BLOCK_SIZE))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.recheck is not None:   # the checks again, over a finished run's records
        if args.records is None:
            raise SystemExit("--recheck needs --records, the run's records folder")
        result = recheck(json.loads(args.recheck.read_text(encoding="utf-8")), args.records)
        result["throughput_at_slos"] = slo_sweep(result["points"], result["rates"], args.slos)
        print_table(result)
        text = json.dumps(finite(result))
        args.recheck.write_text(text + "\n")
        print(text)
        return
    variants = setup_variants(args.setup, args.device_blocks, args.context_len)
    peers = dict(args.system)
    for url in peers.values():
        R.check_base_url(url)
    if variants:
        with ServeApps([], args.serve_log, variants=variants,
                       args_overrides={"model": {"dtype": args.dtype}}, base=DEMO) as apps:
            result = bench(args, {**{n: apps.url(n) for n in variants}, **peers}, list(peers))
    else:
        result = bench(args, peers, list(peers))
    print_table(result)
    text = json.dumps(finite(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
