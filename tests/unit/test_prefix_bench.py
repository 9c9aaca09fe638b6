"""fastserve.bench.prefix_bench: the applications it starts, and its checks of reported cached tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fastserve.bench.experiments.server import variant_config
from fastserve.bench.prefix_bench import DEMO, cache_checks, parse_system, recheck, setup_variants, slo_sweep
from fastserve.config import AppArgs


def test_cache_setup_differs_only_in_prefix_caching() -> None:
    raw = variant_config(setup_variants("cache", 192, 2048), 8123, DEMO, {"model": {"dtype": "float32"}})
    assert [a["route_prefix"] for a in raw["applications"]] == ["/cache-on", "/cache-off"]
    on, off = (AppArgs.model_validate(a["args"]) for a in raw["applications"])
    assert (on.kv_cache.prefix_caching, off.kv_cache.prefix_caching) == (True, False)
    assert on.model.dtype == off.model.dtype == "float32"
    demo = AppArgs.model_validate(variant_config({"demo": {}}, 8123, DEMO, {"model": {"dtype": "float32"}})
                                  ["applications"][0]["args"])
    assert on.kv_cache.num_device_blocks == off.kv_cache.num_device_blocks == demo.kv_cache.num_device_blocks
    assert on.model_dump(exclude={"kv_cache"}) == off.model_dump(exclude={"kv_cache"})


def test_host_tier_setup_shrinks_the_device_pool_and_switches_the_host_tier() -> None:
    # 192 blocks of 16 cannot hold the demo's 8,192-token context: the setup caps it at the
    # workload's 2,048.
    raw = variant_config(setup_variants("host-tier", 192, 2048), 8123, DEMO)
    apps = [AppArgs.model_validate(a["args"]) for a in raw["applications"]]
    assert [a.model.context_len() for a in apps] == [2048, 2048]
    on, off = (a.kv_cache for a in apps)
    assert (on.num_device_blocks, off.num_device_blocks) == (192, 192)
    assert (on.host_prefix_cache, off.host_prefix_cache) == (True, False)
    assert on.prefix_caching and off.prefix_caching
    assert on.num_host_blocks == off.num_host_blocks == 2048


def test_unknown_setup_and_bad_system_are_refused_by_value() -> None:
    with pytest.raises(ValueError, match="'tiers'"):
        setup_variants("tiers", 192, 2048)
    with pytest.raises(argparse.ArgumentTypeError, match="'vllm'"):
        parse_system("vllm")
    assert parse_system("vllm=http://127.0.0.1:8100") == ("vllm", "http://127.0.0.1:8100")


def _rec(rid: str, prompt: int, cached: int | None, turn: int | None = None,
         stats: int | None = None) -> dict[str, object]:
    out: dict[str, object] = {"request_id": rid, "prompt_tokens": prompt, "cached_tokens": cached}
    if turn is not None:
        out["turn"] = turn
    if stats is not None:
        out["server"] = {"cached_tokens": stats}   # the client's key for job_stats
    return out


def test_hit_rates_over_all_prompts_and_over_repeated_turns() -> None:
    records = [_rec("c0-t0", 100, 0, 0, 0), _rec("c0-t1", 200, 96, 1, 96),
               _rec("c1-t0", 50, 0, 0, 0), _rec("c1-t1", 150, 32, 1, 32)]
    out = cache_checks(records, 16)
    assert out["hit_rate"] == 128 / 500
    assert out["hit_rate_repeats"] == 128 / 350
    assert (out["prompt_tokens"], out["cached_tokens"], out["reported"]) == (500, 128, 4)
    assert out["bad_cached"] == []


def test_without_turns_every_request_after_the_first_repeats_the_shared_prefix() -> None:
    out = cache_checks([_rec("a", 700, 0), _rec("b", 800, 640), _rec("c", 700, None)], 16)
    assert out["hit_rate_repeats"] == 640 / 1500
    assert out["reported"] == 2


def test_impossible_or_disagreeing_cached_counts_are_listed() -> None:
    records = [_rec("whole", 64, 64, 1, 64), _rec("odd", 100, 40, 1, 40), _rec("mismatch", 100, 32, 1, 48),
               _rec("peer-odd", 100, 40, 1),   # a peer without job_stats: no block-size rule
               _rec("none-cached", 100, None, 1, 0), _rec("unreported", 100, None, 1, 32)]
    bad = {b["request_id"]: b["why"] for b in cache_checks(records, 16)["bad_cached"]}
    assert bad == {"whole": ["cached >= prompt"], "odd": ["cached not a multiple of 16"],
                   "mismatch": ["job_stats.cached_tokens 48"], "unreported": ["job_stats.cached_tokens 32"]}


def test_recheck_recomputes_the_cache_fields_from_the_saved_records(tmp_path: Path) -> None:
    lines = [json.dumps(_rec("c0-t0", 100, None, 0, 0)), json.dumps(_rec("c0-t1", 200, 96, 1, 80))]
    (tmp_path / "multi-turn-cache-on-rate0.25.jsonl").write_text("\n".join(lines) + "\n")
    result = {"workload": "multi-turn", "points": {"cache-on": {"0.25": {"hit_rate": None, "ttft_mean_s": 1.0}}}}
    row = recheck(result, tmp_path)["points"]["cache-on"]["0.25"]
    assert row["ttft_mean_s"] == 1.0
    assert (row["hit_rate"], row["hit_rate_repeats"]) == (96 / 300, 96 / 200)
    assert [b["request_id"] for b in row["bad_cached"]] == ["c0-t1"]


def test_slo_sweep_reads_each_systems_curve_at_every_slo() -> None:
    points = {"ours": {"0.5": {"per_token_mean_s": 0.1}, "2.0": {"per_token_mean_s": 0.4}},
              "peer": {"0.5": {"per_token_mean_s": 0.3}, "2.0": {"per_token_mean_s": 0.5}}}
    sweep = slo_sweep(points, [0.5, 2.0], [0.2, 0.6])
    assert sweep["0.2"]["ours"]["rate"] == pytest.approx(1.0)          # 0.5 + (0.1 / 0.3) x 1.5
    assert (sweep["0.2"]["peer"]["rate"], sweep["0.2"]["peer"]["status"]) == (0.0, "none_under")
    assert (sweep["0.6"]["ours"]["rate"], sweep["0.6"]["ours"]["status"]) == (2.0, "lower_bound")
