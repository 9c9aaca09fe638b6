"""The race tool and its real-prompt workloads, against scripted OpenAI-compatible servers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from fastserve.bench import metrics, race
from fastserve.bench import prompts as P
from fastserve.bench.client import HEALTH_PATH


def test_prompt_datasets_load_with_bos_inclusive_lengths() -> None:
    sharegpt = P.load_sharegpt_prompts()
    assert len(sharegpt) == 3000
    first = json.loads(P.SHAREGPT_PROMPTS.read_text(encoding="utf-8").split("\n")[0])
    assert sharegpt[0] == P.PromptSample(first["prompt"], first["prompt_tokens"] + 1, first["output_tokens"] + 1)
    alpaca = P.load_alpaca_prompts()
    assert 0 < len(alpaca) <= 5000 and all(s.prompt_len + s.output_len <= 2048 for s in alpaca)
    with pytest.raises(ValueError, match="dataset must be one of"):
        P.load_prompts("wiki")  # type: ignore[arg-type]


def test_text_requests_are_seeded_and_scaled() -> None:
    samples = P.load_sharegpt_prompts()
    a = P.text_requests(samples, 20, rate=2.0, seed=3, output_scale=0.25)
    assert a == P.text_requests(samples, 20, rate=2.0, seed=3, output_scale=0.25)
    full = P.text_requests(samples, 20, rate=2.0, seed=3, output_scale=1.0)
    assert [r.prompt_text for r in a] == [r.prompt_text for r in full]
    assert [r.output_len for r in a] == [max(1, round(r.output_len * 0.25)) for r in full]
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:], strict=False))
    with pytest.raises(ValueError, match="num_prompts"):
        P.text_requests(samples, 0, 1.0, 0)


def test_parts_never_share_a_prompt() -> None:
    # The race gives each rate its own part, so a prefix cache cannot carry one rate's prompts
    # into the next; the same part is the same prompts whatever the rate.
    samples = P.load_sharegpt_prompts()
    parts = [P.text_requests(samples, 30, rate=1.0, seed=0, part=k) for k in range(4)]
    texts = [{r.prompt_text for r in part} for part in parts]
    assert all(len(t) == 30 for t in texts)
    assert len(set().union(*texts)) == 120
    again = P.text_requests(samples, 30, rate=4.0, seed=0, part=2)
    assert [r.prompt_text for r in again] == [r.prompt_text for r in parts[2]]
    with pytest.raises(ValueError, match=r"num_prompts × \(part \+ 1\)"):
        P.text_requests(samples, len(samples), 1.0, 0, part=1)


def scripted_server(model: str) -> httpx.MockTransport:
    """Streams exactly ``max_tokens`` one-token chunks, then usage and [DONE]."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == HEALTH_PATH:
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": model}]})
        body = json.loads(request.content)
        assert body["model"] == model and isinstance(body["prompt"], str) and body["ignore_eos"]
        n = body["max_tokens"]
        events = [{"choices": [{"text": "x", "finish_reason": None}]} for _ in range(n)]
        events.append({"choices": [], "usage": {"completion_tokens": n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_race_reports_both_systems_ratios_and_throughput_at_slo(capsys: pytest.CaptureFixture[str]) -> None:
    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2", "--rates", "50,100",
                            "--num-prompts", "4", "--output-scale", "0.05", "--slo", "10"])
    result = race.race(args, {"ours": scripted_server("ours-model"), "peer": scripted_server("peer-model")})
    assert result["rates"] == [50.0, 100.0] and result["slo_s"] == 10
    for name in race.SYSTEMS:
        for rate in ("50.0", "100.0"):
            point = result["points"][name][rate]
            assert point["completed"] == 4 and point["failed"] == 0
        # Every point is far under a 10 s/token SLO: the highest rate is a lower bound.
        assert result["throughput_at_slo"][name] == {"rate": 100.0, "status": "lower_bound", "bracket": None}
        assert result["throughput_at_slo_p95"][name] == {"rate": 100.0, "status": "lower_bound", "bracket": None}
    # Neither crossed: the quotient of two lower bounds says nothing.
    assert result["throughput_at_slo_ratio"] == result["throughput_at_slo_p95_ratio"] == {"value": None,
                                                                                          "kind": "unknown"}
    assert set(result["ratios_ours_over_peer"]) == {"50.0", "100.0"}
    race.print_table(result)
    out = capsys.readouterr().out
    assert "throughput at SLO 10.000 s/token (mean per-token)" in out
    assert "(p95 per-token): ours 100.000 (lower_bound), peer 100.000 (lower_bound), ratio unmeasured" in out


def _point(mean_s: float, p95_s: float) -> dict[str, float]:
    return {"per_token_mean_s": mean_s, "per_token_p95_s": p95_s}


def test_recheck_reads_each_slo_crossing_and_marks_a_bound(tmp_path: Path) -> None:
    """The peer's P95 crosses 0.5 s halfway between 2 and 3 req/s (0.4 → 0.6); ours never does,
    so ours ÷ peer at P95 is at least 3 / 2.5. Both means cross: 2.5 against 1.5 req/s exactly."""
    saved = {"rates": [1.0, 2.0, 3.0], "slo_s": 0.5, "points": {
        "ours": {"1.0": _point(0.1, 0.2), "2.0": _point(0.4, 0.3), "3.0": _point(0.6, 0.45)},
        "peer": {"1.0": _point(0.3, 0.35), "2.0": _point(0.7, 0.4), "3.0": _point(0.9, 0.6)}}}
    path = tmp_path / "race.json"
    path.write_text(json.dumps(saved))
    result = race.recheck(path)
    assert result["throughput_at_slo"]["ours"] == {"rate": 2.5, "status": "interpolated", "bracket": [2.0, 3.0]}
    assert result["throughput_at_slo"]["peer"] == {"rate": 1.5, "status": "interpolated", "bracket": [1.0, 2.0]}
    assert result["throughput_at_slo_ratio"] == {"value": 2.5 / 1.5, "kind": "exact"}
    assert result["throughput_at_slo_p95"]["ours"] == {"rate": 3.0, "status": "lower_bound", "bracket": None}
    assert result["throughput_at_slo_p95"]["peer"]["rate"] == pytest.approx(2.5)
    assert result["throughput_at_slo_p95_ratio"]["kind"] == "at_least"
    assert result["throughput_at_slo_p95_ratio"]["value"] == pytest.approx(1.2)
    # A tighter SLO: the peer's mean misses it at every rate, ours crosses between 1 and 2.
    tight = race.recheck(path, slo=0.2)
    assert tight["throughput_at_slo"]["peer"] == {"rate": 0.0, "status": "none_under", "bracket": None}
    assert tight["throughput_at_slo_ratio"] == {"value": None, "kind": "at_least"}
    assert str(metrics.SLORatio(None, "at_least")) == "unbounded (the peer missed the SLO at every rate)"
    assert str(metrics.SLORatio(1.2, "at_least")) == "≥ 1.20" and str(metrics.SLORatio(0.8, "at_most")) == "≤ 0.80"


def test_race_refuses_a_remote_peer() -> None:
    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://10.0.0.5:8000", "--rates", "1",
                            "--num-prompts", "1"])
    with pytest.raises(ValueError, match="not a loopback host"):
        race.race(args, {"ours": scripted_server("m")})


def test_race_waits_for_health_and_warms_each_server_up_unrecorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # /health answers 503 twice (an engine still starting), then 200; the warm-up requests go
    # one at a time before the first rate and are in no point's figures.
    monkeypatch.setattr("fastserve.bench.client.HEALTH_POLL_S", 0.01)
    log: dict[str, list[str]] = {"ours": [], "peer": []}

    def server(name: str) -> httpx.MockTransport:
        streams = scripted_server(f"{name}-model")
        health = iter([503, 503])

        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == HEALTH_PATH:
                status = next(health, 200)
                log[name].append(f"health {status}")
                return httpx.Response(status)
            if request.url.path != "/v1/models":
                log[name].append(f"prompt {json.loads(request.content)['prompt'][:20]!r}")
            return streams.handle_request(request)

        return httpx.MockTransport(handle)

    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2", "--rates", "50",
                            "--num-prompts", "3", "--output-scale", "0.05", "--slo", "10", "--warmup", "2"])
    result = race.race(args, {name: server(name) for name in race.SYSTEMS})
    for name in race.SYSTEMS:
        assert log[name][:3] == ["health 503", "health 503", "health 200"]
        assert len(log[name]) == 3 + 2 + 3
        assert result["points"][name]["50.0"]["completed"] == 3
    warm = log["ours"][3:5]
    assert warm == log["peer"][3:5] and not set(warm) & set(log["ours"][5:])


def test_race_gives_up_on_a_server_that_never_gets_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fastserve.bench.client.HEALTH_POLL_S", 0.01)
    sick = httpx.MockTransport(lambda request: httpx.Response(503))
    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2", "--rates", "50",
                            "--num-prompts", "1", "--ready-timeout-s", "0.05"])
    with pytest.raises(TimeoutError, match=r"http://127.0.0.1:1/health not healthy after 0.05 s \(last: HTTP 503\)"):
        race.race(args, {"ours": sick, "peer": scripted_server("m")})
