"""The metric families (fastserve.engine.metrics) and the app's /metrics view of Ray's agents
(fastserve.server.metrics_export).

No Ray: recorders write into fake sinks; the exposition is fed text in the format Ray 2.60's
metrics agent serves (names ``ray_<name>``, counters with ``_total``, Ray's own labels).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastserve.engine.delivery import Accepted, JobStream
from fastserve.engine.metrics import (
    ENGINE_FAMILIES,
    INGRESS_FAMILIES,
    TTFT_BUCKETS,
    CounterMirror,
    EngineMetrics,
    IngressMetrics,
    length_buckets,
)
from fastserve.scheduler.job import JobStats
from fastserve.server.http_api import make_api
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.server.metrics_export import our_families, render
from tests.harness.http_backends import CONTEXT, MODEL, TEXT_IDS, TOK, VOCAB, FakeBackend, FakeStream
from tests.harness.metric_sinks import FakeSink, sinks


def test_families_use_vllms_names_units_and_buckets() -> None:
    fam = ENGINE_FAMILIES
    for suffix, kind in (("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                         ("kv_cache_usage_perc", "gauge"), ("num_preemptions", "counter"),
                         ("prompt_tokens", "counter"), ("generation_tokens", "counter"),
                         ("time_to_first_token_seconds", "histogram"),
                         ("request_time_per_output_token_seconds", "histogram"),
                         ("inter_token_latency_seconds", "histogram"),
                         ("e2e_request_latency_seconds", "histogram"), ("request_queue_time_seconds", "histogram"),
                         ("request_prefill_time_seconds", "histogram"), ("request_decode_time_seconds", "histogram"),
                         ("request_inference_time_seconds", "histogram"), ("request_prompt_tokens", "histogram"),
                         ("request_generation_tokens", "histogram")):
        assert fam[suffix].kind == kind and fam[suffix].name == f"fastserve_{suffix}"
    assert INGRESS_FAMILIES["request_success"].labels == ("finished_reason",)
    assert fam["time_to_first_token_seconds"].buckets[:3] == (0.001, 0.005, 0.01)
    assert fam["time_to_first_token_seconds"].buckets[-1] == 2560.0 and TTFT_BUCKETS[-2] == 640.0
    assert fam["e2e_request_latency_seconds"].buckets[0] == 0.3
    assert fam["e2e_request_latency_seconds"].buckets[-1] == 7680.0
    assert fam["swaps"].labels == ("direction",) and fam["mlfq_jobs"].labels == ("level", "state")


def test_job_finished_records_the_schedulers_own_accounting() -> None:
    m = EngineMetrics(MODEL, FakeSink)
    stats = JobStats("j", arrival=10.0, prompt_len=7, first_token_time=10.5, finish_time=12.5,
                     finish_reason="length", num_generated=5, queueing_s=0.25, swap_blocked_s=0.125)
    stats.enst_pairs.append((1.0, 1.5))
    m.job_finished(stats)
    s = sinks(m)
    assert s["request_wait_time_seconds"].observed == [0.25]
    assert s["request_swap_blocked_time_seconds"].observed == [0.125]
    assert s["enst_error_seconds"].observed == [0.5]
    # vLLM's families come from the engine's timing (record_timing), not from here.
    assert s["prompt_tokens"].values == {} and s["e2e_request_latency_seconds"].observed == []
    assert all(sink.model_name == MODEL for sink in s.values())

    aborted = JobStats("k", arrival=0.0, prompt_len=3, finish_time=1.0, finish_reason="abort", num_generated=2)
    aborted.enst_pairs.append((2.0, 1.0))
    m.job_finished(aborted)   # its predictions count; latencies are of completed requests only
    assert s["enst_error_seconds"].observed == [0.5, 1.0] and s["request_wait_time_seconds"].observed == [0.25]


def test_length_buckets_are_vllms_1_2_5_series_up_to_the_context() -> None:
    assert length_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert length_buckets(2048)[-1] == 2000 and length_buckets(1999)[-1] == 1000
    m = EngineMetrics(MODEL, FakeSink, max_model_len=512)
    assert sinks(m)["request_prompt_tokens"].family.buckets == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert sinks(m)["request_generation_tokens"].family.buckets[-1] == 500
    assert sinks(m)["e2e_request_latency_seconds"].family.buckets[0] == 0.3   # others untouched


def test_counter_mirror_only_moves_forward() -> None:
    m = EngineMetrics(MODEL, FakeSink)
    mirror = CounterMirror()
    for total in (3, 3, 5, 2, 6):   # 2: a smaller total must not subtract
        mirror.advance(m, "swaps", total, direction="out")
    assert sinks(m)["swaps"].values == {(("direction", "out"),): 6.0}


AGENT_A = """# HELP ray_fastserve_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_fastserve_prompt_tokens_total counter
ray_fastserve_prompt_tokens_total{WorkerId="w1",deployment="Engine",model_name="opt-125m",replica="r1"} 12.0
# HELP ray_fastserve_e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE ray_fastserve_e2e_request_latency_seconds histogram
ray_fastserve_e2e_request_latency_seconds_bucket{le="0.3",model_name="opt-125m",replica="r1"} 1.0
ray_fastserve_e2e_request_latency_seconds_bucket{le="+Inf",model_name="opt-125m",replica="r1"} 2.0
ray_fastserve_e2e_request_latency_seconds_count{model_name="opt-125m",replica="r1"} 2.0
ray_fastserve_e2e_request_latency_seconds_sum{model_name="opt-125m",replica="r1"} 1.5
# HELP ray_serve_num_http_requests_total Serve's own.
# TYPE ray_serve_num_http_requests_total counter
ray_serve_num_http_requests_total{route="/"} 9.0
"""
AGENT_B = """# HELP ray_fastserve_prompt_tokens_total Number of prefill tokens processed.
# TYPE ray_fastserve_prompt_tokens_total counter
ray_fastserve_prompt_tokens_total{WorkerId="w2",deployment="Engine",model_name="opt-125m",replica="r2"} 30.0
# HELP ray_fastserve_kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE ray_fastserve_kv_cache_usage_perc gauge
ray_fastserve_kv_cache_usage_perc{model_name="opt-125m",replica="r2"} 0.25
"""


def test_exposition_renames_keeps_every_series_and_sums_nothing() -> None:
    text = render(our_families([AGENT_A, AGENT_B]))
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(parsed) == {"fastserve:prompt_tokens", "fastserve:e2e_request_latency_seconds",
                           "fastserve:kv_cache_usage_perc"}   # Serve's own families are left to Ray
    tokens = parsed["fastserve:prompt_tokens"]
    assert tokens.type == "counter"
    assert sorted((s.name, s.labels["replica"], s.value) for s in tokens.samples) == [
        ("fastserve:prompt_tokens_total", "r1", 12.0), ("fastserve:prompt_tokens_total", "r2", 30.0)]
    hist = parsed["fastserve:e2e_request_latency_seconds"]
    assert hist.type == "histogram"
    assert {s.name for s in hist.samples} == {"fastserve:e2e_request_latency_seconds_bucket",
                                              "fastserve:e2e_request_latency_seconds_count",
                                              "fastserve:e2e_request_latency_seconds_sum"}
    assert parsed["fastserve:kv_cache_usage_perc"].type == "gauge"
    assert "# TYPE fastserve:kv_cache_usage_perc gauge" in text


def ingress_outcomes(backend: FakeBackend, body: dict[str, Any]) -> dict[tuple[tuple[str, str], ...], float]:
    metrics = IngressMetrics(MODEL, FakeSink)
    server = OpenAIServer(ServerContext(MODEL, TOK, VOCAB, CONTEXT), backend, metrics)

    async def run() -> None:
        transport = httpx.ASGITransport(app=make_api(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
    asyncio.run(run())
    return sinks(metrics)["request_success"].values


def test_ingress_records_how_each_request_ended_for_its_client() -> None:
    assert ingress_outcomes(FakeBackend(TEXT_IDS), {}) == {(("finished_reason", "length"),): 1.0}
    # A stop string matched in the ingress cancels the scheduler's job, yet the request finished "stop".
    assert ingress_outcomes(FakeBackend(TEXT_IDS), {"stop": ["world"]}) == {(("finished_reason", "stop"),): 1.0}

    class Broken(FakeBackend):
        def generate(self, req: Any) -> JobStream:
            return FakeStream([Accepted("j")]).read()   # ends without a finish
    assert ingress_outcomes(Broken(TEXT_IDS), {"stream": True}) == {(("finished_reason", "error"),): 1.0}


def test_job_stats_report_the_enst_mean_absolute_error() -> None:
    stats = JobStats("j", arrival=0.0, prompt_len=3)
    assert stats.enst_mae_s is None and stats.as_dict()["enst_mae_s"] is None
    stats.enst_pairs += [(1.0, 1.5), (2.0, 1.0)]
    body = stats.as_dict()
    assert body["enst_mae_s"] == pytest.approx(0.75) and body["enst_predictions"] == 2
