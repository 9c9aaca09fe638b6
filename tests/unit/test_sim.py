"""The simulator: it replays workloads through the real scheduler, agrees with the real engine loop
on completion order, beats FCFS with skip-join MLFQ at high load, and feeds fastserve.bench.metrics exact
values on hand-checkable cases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from fastserve.bench import client as C
from fastserve.bench import workloads as W
from fastserve.bench.metrics import latency_breakdown, request_metrics, summarize
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimOptions, SimSetup, Simulator, simulate
from fastserve.bench.sim.paper_profiles import (
    PAPER_SETTINGS,
    PCIE4_X16_BYTES_PER_S,
    build_profile,
    fit_cost_params,
    load_dims,
)
from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import KVCacheConfig, PolicyName, SchedulerConfig
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec

EXACT = 1e-12

# ---- hand-checkable cost model: every first iteration 0.5 s, every decode iteration 0.1 s -------
T_INIT = 0.5
T_DEC = 0.1
FLAT = Profile(model="flat", hardware="sim", init_lens=(1,), init_seconds=(T_INIT,),
               dec_batch_sizes=(1,), dec_seconds=(T_DEC,), swap_seconds_per_block=0.0)


def _run(requests: Sequence[W.Request], profile: Profile, policy: PolicyName = "fcfs",
         batch: int = 1, blocks: int = 64) -> list:
    cost = CostModel(profile)
    sched = SchedulerConfig(policy=policy, max_batch_size=batch)
    kv = KVCacheConfig(block_size=16, num_device_blocks=blocks, num_host_blocks=blocks)
    return Simulator(cost, sched, kv, SimOptions(check_invariants=True)).run(requests).records


def test_one_job_metrics_are_exact() -> None:
    # Prefill 0 → 0.5 (token 1), decodes → 0.6, 0.7: TTFT 0.5, TPOT 0.1, E2E 0.7, per-token 0.7/3.
    (rec,) = _run([W.Request("a", 0.0, prompt_len=8, output_len=3)], FLAT)
    assert rec.token_times == pytest.approx((0.5, 0.6, 0.7), abs=EXACT)
    m = request_metrics(rec)
    assert m is not None
    assert (m.ttft, m.tpot, m.e2e) == pytest.approx((0.5, 0.1, 0.7), abs=EXACT)
    assert m.per_token == pytest.approx(0.7 / 3, abs=EXACT)
    assert (rec.queue_s, rec.exec_s, rec.swap_s) == pytest.approx((0.0, 0.7, 0.0), abs=EXACT)


def test_two_jobs_fcfs_breakdown_is_exact() -> None:
    # Batch of one, FCFS: a runs 0 → 0.5 → 0.6; b waits 0.6 then prefills until 1.1.
    recs = _run([W.Request("a", 0.0, 8, 2), W.Request("b", 0.0, 8, 1)], FLAT)
    a, b = recs
    assert (a.end, b.first_token, b.end) == pytest.approx((0.6, 1.1, 1.1), abs=EXACT)
    assert (b.queue_s, b.exec_s) == pytest.approx((0.6, 0.5), abs=EXACT)
    s = summarize(recs, slo=0.5)
    assert s.per_token.mean == pytest.approx((0.6 / 2 + 1.1 / 1) / 2, abs=EXACT)
    assert s.slo_attainment == pytest.approx(0.5, abs=EXACT)
    bd = latency_breakdown(recs)
    assert bd.queue_share == pytest.approx(0.6 / 1.7, abs=EXACT)
    assert bd.exec_share == pytest.approx(1.1 / 1.7, abs=EXACT)


def test_pipeline_stages_overlap_two_plans() -> None:
    # PP 2, batch 1: a's prefill occupies stage 1 for 0.25 s, then b's prefill follows it there
    # while a is on stage 2: b's first token comes 0.25 s after a's, not 0.5 s.
    profile = Profile(model="flat", hardware="sim", init_lens=(1,), init_seconds=(T_INIT,),
                      dec_batch_sizes=(1,), dec_seconds=(T_DEC,), pp=2)
    a, b = _run([W.Request("a", 0.0, 8, 1), W.Request("b", 0.0, 8, 1)], profile)
    assert (a.end, b.end) == pytest.approx((0.5, 0.75), abs=EXACT)


def test_skip_join_beats_fcfs_on_sharegpt_at_high_load() -> None:
    reqs = W.workload(W.load_sharegpt_lengths(), num_requests=120, rate=4.0, seed=1)
    means = {}
    for policy in ("fcfs", "skip_join_mlfq"):
        res = simulate(reqs, PAPER_PROFILES["opt-13b"], SimSetup(policy=policy))
        s = summarize(res.records)
        assert s.num_completed == len(reqs)
        means[policy] = s.per_token.mean
    assert means["skip_join_mlfq"] < 0.5 * means["fcfs"], means


def test_swap_modes_replay_under_memory_pressure() -> None:
    # A 200-block device pool (3,200 tokens) for 40 ShareGPT jobs at 4/s: every mode must swap
    # (or drop) to make progress, keep the block invariants every step, and finish every job.
    reqs = W.workload(W.load_sharegpt_lengths(), num_requests=40, rate=4.0, seed=2)
    evictions = {}
    for mode in ("proactive", "reactive", "recompute"):
        res = simulate(reqs, PAPER_PROFILES["opt-13b"],
                       SimSetup(swap_mode=mode, num_device_blocks=200, num_host_blocks=1000),
                       SimOptions(check_invariants=True))
        assert all(r.ok for r in res.records), mode
        assert res.kv.peak_device_blocks <= 200
        evictions[mode] = res.totals.get("swaps_out", 0) + res.totals.get("recomputes", 0)
    assert all(n > 0 for n in evictions.values()), evictions


# ---- the simulator and the real engine loop agree on completion order -------------------------
TINY = OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=128, name="tiny")
# Service is charged in the profile's units (a decode = q1 = 100 s, a first iteration t_init),
# never the measured step, and α of days means no promotion: the order is fixed by each policy's
# rules, not by timing, demotions included. t_init(s) = 50 + 750·(s−1)/63 s puts prompts of
# 5/10/20/40 tokens on levels 1/2/3/4 (q1 = 100 s).
ORDER_PROFILE = Profile(model="tiny", hardware="sim", init_lens=(1, 64), init_seconds=(50.0, 800.0),
                        dec_batch_sizes=(1, 16), dec_seconds=(100.0, 100.0))
#: The simulated hardware is as quick as the tiny model (milliseconds), like the real run.
ORDER_HARDWARE = Profile(model="tiny", hardware="sim", init_lens=(1,), init_seconds=(1e-3,),
                         dec_batch_sizes=(1,), dec_seconds=(1e-3,))
NO_STARVATION_S = 1e6
ORDER_JOBS = (("a", 40, 3), ("b", 10, 5), ("c", 20, 2), ("d", 5, 4), ("e", 10, 1), ("f", 5, 6))
ORDER_BLOCK = 4
ORDER_BLOCKS = 64


def _order_configs(policy: PolicyName, batch: int) -> tuple[SchedulerConfig, KVCacheConfig]:
    return (SchedulerConfig(policy=policy, max_batch_size=batch, starvation_alpha_s=NO_STARVATION_S),
            KVCacheConfig(block_size=ORDER_BLOCK, num_device_blocks=ORDER_BLOCKS, num_host_blocks=ORDER_BLOCKS))


def _sim_order(policy: PolicyName, batch: int) -> list[str]:
    sched, kv = _order_configs(policy, batch)
    reqs = [W.Request(j, 0.0, p, o) for j, p, o in ORDER_JOBS]
    return Simulator(CostModel(ORDER_HARDWARE), sched, kv, scheduler_profile=ORDER_PROFILE).run(reqs).completion_order


async def _engine_order(policy: PolicyName, batch: int) -> list[str]:
    sched_cfg, kv_cfg = _order_configs(policy, batch)
    scheduler = Scheduler(sched_cfg, kv_cfg, ORDER_PROFILE, frozenset({TINY.eos_token_id}))
    executor = InProcessExecutor(ModelSpec(TINY, num_device_blocks=ORDER_BLOCKS, num_host_blocks=ORDER_BLOCKS,
                                 block_size=ORDER_BLOCK))
    engine = AsyncEngine(scheduler, ThreadedExecutor(executor))
    order: list[str] = []

    async def consume(stream: object, job_id: str) -> None:
        async for delta in stream:  # type: ignore[attr-defined]
            if delta.finished:
                assert delta.finish_reason == "length"
                order.append(job_id)

    await engine.start()
    try:
        # All added before the loop first runs, i.e. all arrive at the same decision.
        streams = [(engine.add_request([2] + [5] * (p - 1),
                                       SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True), job_id=j), j)
                   for j, p, o in ORDER_JOBS]
        await asyncio.wait_for(asyncio.gather(*(consume(s, j) for s, j in streams)), timeout=60)
    finally:
        await engine.stop()
    return order


@pytest.mark.parametrize("policy", ["fcfs", "skip_join_mlfq", "fixed_priority", "srpt_oracle", "naive_mlfq"])
@pytest.mark.parametrize("batch", [1, 2])
def test_sim_and_engine_agree_on_completion_order(policy: PolicyName, batch: int) -> None:
    sim = _sim_order(policy, batch)
    real = asyncio.run(_engine_order(policy, batch))
    assert sim == real
    assert sorted(sim) == sorted(j for j, _, _ in ORDER_JOBS)


def test_skip_join_order_by_entry_level_and_quanta() -> None:
    # Batch 1. Entry levels 1 (d, f), 2 (b, e), 3 (c), 4 (a); t_init(5) = 97.6, t_init(10) =
    # 157.1, t_init(20) = 276.2. d: prefill + 1 decode (197.6 > q1) -> L2; f likewise; b: prefill
    # + 1 decode (257.1 > q2) -> L3; e's prefill is its only token: e done first. d (L2, fresh):
    # 2 decodes, done. f: 3 decodes (300 > q2) -> L3 behind c, b. c: prefill + decode, done.
    # b: 3 decodes, done. f: its 6th token, done. a last.
    assert _sim_order("skip_join_mlfq", 1) == ["e", "d", "c", "b", "f", "a"]


# ---- paper-scale profiles -----------------------------------------------------------------------
def test_paper_profiles_reproduce_their_anchors() -> None:
    dims = load_dims()
    params = fit_cost_params(dims)
    profiles = {s.model: Profile.from_dict(build_profile(s, dims, params)) for s in PAPER_SETTINGS}
    assert profiles["opt-175b"].t_dec(1) == pytest.approx(0.060)
    assert profiles["opt-2.7b"].t_dec(1) == pytest.approx(0.002)
    assert profiles["opt-2.7b"].t_init(128) == pytest.approx(0.010, rel=0.1)
    assert profiles["opt-2.7b"].t_init(1024) == pytest.approx(0.090, rel=0.1)
    swap_512 = 512 * dims["opt-175b"].kv_bytes_per_token / profiles["opt-175b"].swap_bytes_per_block
    assert swap_512 * profiles["opt-175b"].swap_seconds_per_block == pytest.approx(0.036)
    # A swap moves one way: one GPU's PCIe 4.0 x16 link caps the single-GPU settings below the
    # anchor's 67 GB/s (both directions counted); 4 and 16 GPUs keep the anchor's rate.
    rate = {name: p.swap_bytes_per_block / p.swap_seconds_per_block for name, p in profiles.items()}
    assert rate["opt-13b"] == pytest.approx(PCIE4_X16_BYTES_PER_S)
    assert rate["opt-2.7b"] == pytest.approx(PCIE4_X16_BYTES_PER_S)
    assert rate["opt-66b"] == pytest.approx(params.swap_bytes_per_s)
    assert rate["opt-175b"] == pytest.approx(params.swap_bytes_per_s)
    assert params.swap_bytes_per_s == pytest.approx(67.1e9, rel=1e-3)
    for name, path in PAPER_PROFILES.items():
        shipped = json.loads(Path(path).read_text())
        assert shipped["t_dec"]["seconds"] == pytest.approx(list(profiles[name].dec_seconds)), name
        assert shipped["swap"]["seconds_per_block"] == pytest.approx(profiles[name].swap_seconds_per_block), name


# ---- HTTP client, on a mock transport -----------------------------------------------------------
def _sse_server(request: httpx.Request) -> httpx.Response:
    if request.url.path == C.MODELS_PATH:
        return httpx.Response(200, json={"data": [{"id": "m"}]})
    body = json.loads(request.content)
    assert body["ignore_eos"] is True and body["stream"] is True
    assert len(body["prompt"]) == 7
    chunks = [{"choices": [{"text": "x", "finish_reason": None}]} for _ in range(body["max_tokens"])]
    chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]},
                   C.SERVER_STATS_KEY: {"queue_s": 0.25, "exec_s": 1.0, "swap_blocked_s": 0.0}})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_client_records_tokens_and_server_accounting() -> None:
    reqs = [W.Request("r0", 0.0, 7, 3), W.Request("r1", 0.01, 7, 2)]
    cfg = C.ClientConfig(progress=False)
    records = asyncio.run(C.run_requests(reqs, cfg, transport=httpx.MockTransport(_sse_server)))
    assert [r["output_tokens"] for r in records] == [3, 2]
    assert all(r["status"] == "ok" and len(r["token_times"]) == r["output_tokens"] for r in records)
    assert records[0]["queue_s"] == 0.25 and records[0]["exec_s"] == 1.0


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1"])
def test_client_refuses_non_loopback_hosts(url: str) -> None:
    with pytest.raises(ValueError):
        C.check_base_url(url)
    if url.startswith("http://"):
        assert C.check_base_url(url, allow_remote=True) == url


def test_client_accepts_loopback_hosts() -> None:
    for url in ("http://127.0.0.1:8000/", "http://localhost:8000", "http://[::1]:8000"):
        assert C.check_base_url(url) == url.rstrip("/")


def test_client_records_http_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}})

    cfg = C.ClientConfig(model="m", progress=False)
    (rec,) = asyncio.run(C.run_requests([W.Request("r0", 0.0, 7, 3)], cfg, transport=httpx.MockTransport(refuse)))
    assert (rec["status"], rec["http_status"], rec["output_tokens"]) == (C.STATUS_HTTP_ERROR, 400, 0)
    assert "bad" in rec["error"]
