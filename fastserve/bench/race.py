"""Race two OpenAI-compatible servers on one workload: ``python -m fastserve.bench.race --ours URL --peer URL``.

The same requests (ShareGPT or Alpaca prompts, Poisson arrivals, one seed, each rate its own
prompts) go to each server in turn, rate by rate, so machine drift hits both alike. Per server and
rate: per-token latency (mean, P95), TTFT, TPOT, tokens/s and the output lengths received; then
throughput at the SLO (given, or ``--slo-factor`` × the peer's at the lowest rate) and the ratios,
marked ≥ / ≤ where a crossing lies past the grid. ``--mode completions`` sends ``ignore_eos``
completions of the reference lengths (the paper's setting); ``--mode chat`` lets a real model stop
at its EOS. ``--recheck RACE.json`` recomputes a saved race's SLO figures. Loopback servers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from fastserve.bench import chat as C
from fastserve.bench import prefix_workloads as PW
from fastserve.bench import prompts as P
from fastserve.bench import workloads as W
from fastserve.bench.client import ClientConfig, check_base_url, run_requests, save_jsonl, wait_healthy
from fastserve.bench.metrics import RequestRecord, RunSummary, SLORatio, slo_ratio, summarize, throughput_at_slo

SYSTEMS = ("ours", "peer")
DEFAULT_RATES = (0.25, 1.0, 2.0, 4.0)
DEFAULT_SLO_FACTOR = 10.0
DEFAULT_WARMUP = 2
DEFAULT_READY_TIMEOUT_S = 600.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def client_config(args: argparse.Namespace, base_url: str, model: str | None) -> ClientConfig:
    return ClientConfig(base_url=base_url, model=model, prompt_mode="text", max_total_s=args.max_total_s,
                        progress=False, mode=args.mode, temperature=args.temperature,
                        system_prompt=args.system_prompt, seed=args.seed)


def run_point(config: ClientConfig, requests: Sequence[Any], records_out: Path | None,
              transport: httpx.AsyncBaseTransport | None = None) -> tuple[RunSummary, list[dict[str, Any]]]:
    records = asyncio.run(run_requests(requests, config, transport))
    if records_out is not None:
        save_jsonl(records, records_out)
    return summarize([RequestRecord.from_dict(r) for r in records]), records


def point_row(s: RunSummary, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"completed": s.num_completed, "failed": s.num_failed,
            "per_token_mean_s": s.per_token.mean, "per_token_p95_s": s.per_token.p95,
            "ttft_mean_s": s.ttft.mean, "tpot_mean_s": s.tpot.mean,
            "output_tok_s": s.output_token_throughput, "request_throughput": s.request_throughput,
            "output_lengths": C.output_lengths(records).to_dict()}


def point_requests(args: argparse.Namespace, samples: list[P.PromptSample], rate: float,
                   part: int, num: int | None = None) -> list[W.Request]:
    num = args.num_prompts if num is None else num
    if args.mode == "chat":   # reference lengths, capped: the model decides where to stop
        reqs = P.text_requests(samples, num, rate, args.seed, 1.0, part)
        return C.cap_requests(reqs, C.eos_cap_from_args(args))
    return P.text_requests(samples, num, rate, args.seed, args.output_scale, part)


def warm_up(args: argparse.Namespace, samples: list[P.PromptSample], config: ClientConfig,
            transport: httpx.AsyncBaseTransport | None = None) -> None:
    """``/health``, then ``--warmup`` unrecorded requests (as ``vllm bench serve``): first requests pay
    one-off costs. Their prompts are the seeded shuffle's last, which no rate reaches."""
    waited = asyncio.run(wait_healthy(config.base_url, args.ready_timeout_s, transport))
    if args.warmup < 1:
        return
    last_part = len(samples) // args.warmup - 1
    for request in point_requests(args, samples, 1.0, last_part, args.warmup):
        records = asyncio.run(run_requests([replace(request, arrival_s=0.0)], config, transport))
        if records[0]["status"] != "ok":
            raise RuntimeError(f"warm-up request to {config.base_url} failed: {records[0]}")
    print(f"  {config.base_url}: healthy after {waited:.1f} s, {args.warmup} warm-up request(s) done",
          flush=True)


def conversation_point(args: argparse.Namespace, samples: list[P.PromptSample], rate: float,
                       part: int) -> list[PW.Conversation]:
    cap = C.eos_cap_from_args(args)
    # Each turn gets an equal share of the context, so the whole conversation fits.
    share = (cap.context_len - cap.template_margin) // (2 * args.turns)
    fitting = [x for x in samples if x.prompt_len <= share]
    num = max(args.num_prompts // args.turns, 1)
    pool = fitting[part * num * args.turns:] or fitting
    return PW.conversations(pool, num, args.turns, rate, args.seed + part,
                            min(cap.max_tokens or share, share))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f} %"


def race(args: argparse.Namespace,
         transports: dict[str, httpx.AsyncBaseTransport] | None = None) -> dict[str, Any]:
    """Run the race; ``transports`` replaces the network per system (tests)."""
    for url in (args.ours, args.peer):
        check_base_url(url)   # refuse a non-loopback server before sending anything
    rates = sorted(args.rates)
    samples = P.load_prompts(args.dataset)
    urls = {"ours": args.ours, "peer": args.peer}
    models = {"ours": args.ours_model, "peer": args.peer_model}
    points: dict[str, dict[float, dict[str, Any]]] = {name: {} for name in SYSTEMS}
    if args.workload != "independent" and args.mode != "chat":
        raise SystemExit(f"--workload {args.workload} needs --mode chat")
    if args.workload == "shared-system" and args.system_prompt is None:
        args.system_prompt = PW.shared_system_prompt(samples, args.system_words, args.seed)
    if args.warmup and len(rates) * args.num_prompts + args.warmup > len(samples):
        raise ValueError(f"{len(rates)} rates × {args.num_prompts} prompts + {args.warmup} warm-up "
                         f"exceed the {len(samples)} {args.dataset} prompts")
    for name in SYSTEMS:
        warm_up(args, samples, client_config(args, urls[name], models[name]), (transports or {}).get(name))
    for part, rate in enumerate(rates):
        # Each rate its own prompts: repeats would be served from the prefix caches.
        requests = point_requests(args, samples, rate, part)
        convs = conversation_point(args, samples, rate, part) if args.workload == "multi-turn" else []
        for name in SYSTEMS:
            out = None if args.out is None else args.out / f"{name}-rate{rate:g}.jsonl"
            config = client_config(args, urls[name], models[name])
            transport = (transports or {}).get(name)
            if convs:
                records = asyncio.run(PW.run_conversations(convs, config, transport))
                if out is not None:
                    save_jsonl(records, out)
                summary = summarize([RequestRecord.from_dict(r) for r in records])
            else:
                summary, records = run_point(config, requests, out, transport)
            points[name][rate] = point_row(summary, records)
            points[name][rate]["prefix_hit_rate"] = PW.hit_rate(records)
            row = points[name][rate]
            print(f"  {name:4} rate {rate:g}: per-token {_fmt(row['per_token_mean_s'])} s, "
                  f"TTFT {_fmt(row['ttft_mean_s'])} s, TPOT {_fmt(1e3 * row['tpot_mean_s'], 1)} ms, "
                  f"{_fmt(row['output_tok_s'], 1)} tok/s, {row['failed']} failed", flush=True)
    slo = args.slo if args.slo is not None else args.slo_factor * points["peer"][rates[0]]["per_token_mean_s"]
    ratios = {str(r): {
        "per_token_mean": ratio(points["ours"][r]["per_token_mean_s"], points["peer"][r]["per_token_mean_s"]),
        "per_token_p95": ratio(points["ours"][r]["per_token_p95_s"], points["peer"][r]["per_token_p95_s"]),
        "ttft_mean": ratio(points["ours"][r]["ttft_mean_s"], points["peer"][r]["ttft_mean_s"]),
        "tpot_mean": ratio(points["ours"][r]["tpot_mean_s"], points["peer"][r]["tpot_mean_s"]),
        "output_tok_s": ratio(points["ours"][r]["output_tok_s"], points["peer"][r]["output_tok_s"]),
    } for r in rates}
    mode: dict[str, Any] = {"mode": args.mode, "temperature": args.temperature}
    if args.mode == "chat":
        mode.update(system_prompt=args.system_prompt, eos_cap=asdict(C.eos_cap_from_args(args)))
    by_rate = {name: {str(r): row for r, row in pts.items()} for name, pts in points.items()}
    return {"cpu": cpu_model(), "dataset": args.dataset, "num_prompts": args.num_prompts, **mode,
            "workload": args.workload,
            "output_scale": args.output_scale, "seed": args.seed, "rates": rates, "slo_s": slo,
            "points": by_rate, **slo_throughputs(by_rate, rates, slo),
            "ratios_ours_over_peer": ratios}


#: The per-token statistic each SLO throughput is read from (the paper's mean; the tail's P95).
SLO_STATISTICS = {"mean": "per_token_mean_s", "p95": "per_token_p95_s"}


def slo_throughputs(points: dict[str, dict[str, dict[str, Any]]], rates: Sequence[float],
                    slo: float) -> dict[str, Any]:
    """Throughput at the SLO on mean and P95 per-token latency, and ours ÷ the peer's for each."""
    out: dict[str, Any] = {}
    for stat, key in SLO_STATISTICS.items():
        at = {name: throughput_at_slo(rates, [points[name][str(r)][key] for r in rates], slo) for name in SYSTEMS}
        suffix = "" if stat == "mean" else f"_{stat}"
        out[f"throughput_at_slo{suffix}"] = {name: t.to_dict() for name, t in at.items()}
        out[f"throughput_at_slo{suffix}_ratio"] = slo_ratio(at["ours"], at["peer"]).to_dict()
    return out


def print_table(result: dict[str, Any]) -> None:
    outputs = (f"chat, real EOS, max_tokens cap {result['eos_cap']}" if result["mode"] == "chat"
               else f"completions with ignore_eos, outputs × {result['output_scale']}")
    print(f"\n{result['dataset']}, {result['num_prompts']} prompts per rate, {outputs}, "
          f"temperature {result['temperature']}, seed {result['seed']}, CPU: {result['cpu']}")
    print(f"{'system':6} {'rate':>5} | {'per-token mean':>14} {'p95':>7} | {'TTFT':>7} | {'TPOT ms':>8} | "
          f"{'tok/s':>7} | failed")
    for name in SYSTEMS:
        for rate in result["rates"]:
            row = result["points"][name][str(rate)]
            print(f"{name:6} {rate:>5g} | {_fmt(row['per_token_mean_s']):>14} {_fmt(row['per_token_p95_s']):>7} | "
                  f"{_fmt(row['ttft_mean_s']):>7} | {_fmt(1e3 * row['tpot_mean_s'], 1):>8} | "
                  f"{_fmt(row['output_tok_s'], 1):>7} | {row['failed']}")
    print(f"\noutput tokens received (completion_tokens){'':9} | finished by")
    print(f"{'system':6} {'rate':>5} | {'n':>4} {'mean':>7} {'P50':>6} {'P90':>6} {'P99':>6} {'max':>6} | "
          f"{'stop':>5} {'length':>6}")
    for name in SYSTEMS:
        for rate in result["rates"]:
            lengths = result["points"][name][str(rate)]["output_lengths"]
            print(f"{name:6} {rate:>5g} | {lengths['count']:>4} {_fmt(lengths['mean'], 1):>7} "
                  f"{_fmt(lengths['p50'], 0):>6} {_fmt(lengths['p90'], 0):>6} {_fmt(lengths['p99'], 0):>6} "
                  f"{lengths['max']:>6} | {_pct(lengths['stop_share']):>5} {_pct(lengths['length_share']):>6}")
    print("\nratios ours ÷ peer (lower is better for latencies, higher for tok/s):")
    for rate, r in result["ratios_ours_over_peer"].items():
        print(f"  rate {rate}: per-token {_fmt(r['per_token_mean'], 2)} (p95 {_fmt(r['per_token_p95'], 2)}), "
              f"TTFT {_fmt(r['ttft_mean'], 2)}, TPOT {_fmt(r['tpot_mean'], 2)}, tok/s {_fmt(r['output_tok_s'], 2)}")
    for stat in SLO_STATISTICS:
        suffix = "" if stat == "mean" else f"_{stat}"
        t, r = result[f"throughput_at_slo{suffix}"], result[f"throughput_at_slo{suffix}_ratio"]
        print(f"throughput at SLO {result['slo_s']:.3f} s/token ({stat} per-token): ours {t['ours']['rate']:.3f} "
              f"({t['ours']['status']}), peer {t['peer']['rate']:.3f} ({t['peer']['status']}), "
              f"ratio {SLORatio(r['value'], r['kind'])}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ours", required=True, help="our server's base URL (loopback)")
    parser.add_argument("--peer", required=True, help="the peer's base URL (loopback)")
    parser.add_argument("--ours-model", default=None, help="model name; default: the first /v1/models lists")
    parser.add_argument("--peer-model", default=None)
    parser.add_argument("--dataset", choices=P.DATASETS, default="sharegpt")
    parser.add_argument("--output-scale", type=float, default=0.25,
                        help="completions mode: scale reference output lengths")
    C.add_mode_args(parser)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_RATES),
                        help="comma-separated Poisson arrival rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--workload", choices=("independent", "shared-system", "multi-turn"),
                        default="independent",
                        help="prefix sharing (chat mode): one long system prompt in front of every "
                             "request, or multi-turn conversations (fastserve.bench.prefix_workloads)")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    parser.add_argument("--system-words", type=int, default=PW.DEFAULT_SYSTEM_WORDS,
                        help="shared-system: words of the generated system prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=None, help="per-token latency SLO in s (default: factor × peer)")
    parser.add_argument("--slo-factor", type=float, default=DEFAULT_SLO_FACTOR)
    parser.add_argument("--max-total-s", type=float, default=600.0, help="bound on each run")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help="unrecorded requests sent to each server, one at a time, before the first rate")
    parser.add_argument("--ready-timeout-s", type=float, default=DEFAULT_READY_TIMEOUT_S,
                        help="bound on waiting for each server's /health before the warm-up")
    parser.add_argument("--out", type=Path, default=None, help="folder for per-run request records")
    return parser.parse_args(argv)


def recheck(path: Path, slo: float | None = None) -> dict[str, Any]:
    """A saved race's JSON with its SLO throughputs computed again (at ``slo`` if given)."""
    result = json.loads(path.read_text())
    result["slo_s"] = result["slo_s"] if slo is None else slo
    result.update(slo_throughputs(result["points"], result["rates"], result["slo_s"]))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--recheck":
        parser = argparse.ArgumentParser(description="recompute a saved race's SLO throughputs")
        parser.add_argument("--recheck", type=Path, required=True, help="a race's JSON (its last stdout line)")
        parser.add_argument("--slo", type=float, default=None)
        args = parser.parse_args(argv)
        result = recheck(args.recheck, args.slo)
    else:
        result = race(parse_args(argv))
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
