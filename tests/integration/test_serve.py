"""The Serve application end to end: ``serve run config/opt125m-dummy.yaml`` on a local Ray, the official
``openai`` client, concurrency and preemption, every error case, client disconnects, the metrics
read back from Ray's agents; plus the GPU configs (the KubeRay manifests are checked in
``tests/unit/test_kuberay.py``) and the 429 path through a real scheduler in process.

The server fixture starts its own Ray head (``ray start --head --block``, small object store,
explicit CPUs and ports) and ``serve run`` on a copy of ``config/opt125m-dummy.yaml`` that differs only in
``http_options.port`` (a free port, so the test never collides with a server already on 8000).
Teardown stops exactly the processes it started, walking their process trees: ``ray stop`` would
also kill every other Ray on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fastserve.config import AppArgs
from fastserve.scheduler.job import JobRequest
from fastserve.worker.messages import SamplingParams
from tests.harness import metrics_view
from tests.harness.metrics_view import Scrape
from tests.harness.serve import (
    API_KEY,
    AUTH,
    METRICS_REPORT_MS,
    MODEL,
    REQUEST_TIMEOUT_S,
    ROOT,
    TOK,
    Server,
    dummy_opt_yaml,
    engine_options,
    greedy_completion,
    serve_app,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]



# ---- configs (no Ray) ------------------------------------------------------------------------

GPU_CONFIGS = {"opt13b": (1, 1, 1), "opt66b": (4, 4, 1), "opt175b": (16, 8, 2)}


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_validate_and_are_consistent(name: str) -> None:
    from fastserve.main import build_app

    raw = yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text())
    (app,) = raw["applications"]
    assert app["import_path"] == "fastserve.main:build_app"
    # Profiles of GPU layouts come from the simulator; the schema test alone may waive the file.
    args = AppArgs.model_validate(app["args"], context={"require_profile": False})
    gpus, tp, pp = GPU_CONFIGS[name]
    par = args.parallel
    assert (par.num_gpus, par.tensor_parallel_size, par.pipeline_parallel_size) == (gpus, tp, pp)
    assert par.tensor_parallel_size * par.pipeline_parallel_size == par.num_gpus
    assert args.model.device == "cuda" and args.model.dtype == "float16"
    assert (args.kv_cache.block_size, args.scheduler.max_batch_size, args.scheduler.max_num_batched_tokens) == \
        (16, 16, 2048)
    assert args.kv_cache.num_host_blocks > 0 and args.kv_cache.swap_mode == "proactive"
    engine = engine_options(raw)
    assert engine["autoscaling_config"]["min_replicas"] == 1 and "num_replicas" not in engine
    bundles = args.placement_group_bundles()
    assert sum(b.get("GPU", 0.0) for b in bundles) == gpus
    build_app(args)   # the application graph builds (no cluster needed to bind it)


# ---- the 429 path through a real scheduler, in process (no Ray) ------------------------------

def test_full_admission_queue_answers_429_and_aborts_free_blocks() -> None:
    from fastserve.engine.delivery import JobStream, LocalStream
    from fastserve.engine.metrics import EngineMetrics
    from fastserve.engine.replica import EngineReplica
    from fastserve.server.http_api import make_api
    from fastserve.server.ingress import OpenAIServer
    from fastserve.server.ingress_requests import ServerContext
    from tests.harness.metric_sinks import FakeSink

    raw = dummy_opt_yaml()["applications"][0]["args"]
    # FCFS, one job per batch, one job may wait: the third concurrent request is refused.
    raw["scheduler"].update(policy="fcfs", max_batch_size=1, admission_queue_limit=1)

    async def run() -> None:
        replica = await EngineReplica.create(raw)
        replica.metrics = EngineMetrics(MODEL, FakeSink)   # read back below
        recorded = replica.metrics._sinks

        class Backend:
            def generate(self, req: Any) -> JobStream:
                return JobStream(req.job_id, LocalStream(replica.generate(req)))

            async def metrics_text(self) -> str:
                return ""

            async def engine_stats(self) -> dict[str, Any]:
                return await replica.stats()

            async def health(self) -> dict[str, Any]:
                return await replica.health()

        backend = Backend()
        server = OpenAIServer(ServerContext.from_args(replica.args), backend)
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True}).encode()
        try:
            held = []
            for i in range(2):   # one runs, one waits for admission (held at the scheduler's stream:
                # the ingress itself would wait for the queued one's first output)
                prep = server.preparer.prepare_completion(body)
                stream = backend.generate(prep.job)
                assert await stream.start() is None   # accepted
                if i == 0:   # admitted once it has produced a token
                    tokens = await stream.__anext__()
                    assert tokens.token_ids and not tokens.finished
                held.append(stream)
            assert replica.scheduler.num_waiting() == 1
            transport = httpx.ASGITransport(app=make_api(server))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                resp = await client.post("/v1/completions", content=body)
                assert resp.status_code == 429, resp.text
                assert resp.headers["retry-after"] == "1"
                err = resp.json()["error"]
                assert err["code"] == "admission_queue_full" and err["type"] == "rate_limit_error"
                assert "admission_queue_limit=1" in err["message"]
                for stream in held:
                    stream.cancel()
                deadline = time.monotonic() + 30
                while replica.scheduler.has_work() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                stats = replica.scheduler.stats()
                assert stats["jobs"] == 0 and stats["device_blocks"]["free"] == stats["device_blocks"]["total"]
                replica.scheduler.check_invariants()
                replica._sample_metrics()
                assert recorded["requests_rejected"].values == {(): 1.0}
                assert recorded["num_requests_running"].values == {(): 0.0}
                assert recorded["kv_cache_usage_perc"].values == {(): 0.0}
        finally:
            await replica.close()

    asyncio.run(run())


def test_delivery_channel_carries_exact_tokens_one_message_per_step_and_breaking_it_frees_blocks() -> None:
    """A real engine replica and the ingress's ``ChannelClient``, in process (no Ray): the
    first job travels on its own stream and opens the channel; the next four share it."""
    from fastserve.engine.delivery import ChannelClient, JobStream, LocalStream
    from fastserve.engine.replica import EngineReplica
    from fastserve.server.ingress import OpenAIServer
    from fastserve.server.ingress_requests import ServerContext
    from fastserve.server.protocol import APIError

    raw = dummy_opt_yaml()["applications"][0]["args"]
    raw["server"]["channel_idle_close_s"] = 600.0   # idle while the own-stream runs below: kept open
    prompts = ["The capital of France", "Once upon a time", "def main():", "Hello"]

    async def run() -> None:
        replica = await EngineReplica.create(raw)
        client = ChannelClient("ingress-1", lambda ingress, replica_id, channel_id: LocalStream(
            replica.subscribe(ingress, channel_id, replica_id)), open_timeout_s=30)

        class Backend:
            def __init__(self, channels: bool) -> None:
                self.channels = channels

            def generate(self, req: JobRequest) -> JobStream:
                if not self.channels:
                    return JobStream(req.job_id, LocalStream(replica.generate(req)))
                return client.submit(req.job_id, lambda: LocalStream(replica.generate(req, client.ingress_id)))

        ctx = ServerContext.from_args(replica.args)
        on_channel, own = OpenAIServer(ctx, Backend(True)), OpenAIServer(ctx, Backend(False))  # type: ignore[arg-type]

        async def complete(server: OpenAIServer, prompt: str, tokens: int = 12) -> dict[str, Any]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            prep = server.preparer.prepare_completion(json.dumps(body).encode())
            return await server.complete(prep, await server.start(prep))

        def steps() -> float:
            return sum(kind["steps"] for kind in replica.engine.step_stats.totals().values())

        try:
            await complete(on_channel, "Opening")
            deadline = time.monotonic() + 30
            while not client.live_channels and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert client.live_channels == {replica.replica_id: next(iter(client.live_channels.values()))}
            before = steps()
            shared = await asyncio.gather(*(complete(on_channel, p) for p in prompts))
            ran = steps() - before
            alone = [await complete(own, p) for p in prompts]
            assert [r["choices"][0]["text"] for r in shared] == [r["choices"][0]["text"] for r in alone]
            assert all(r["usage"]["completion_tokens"] == 12 for r in shared)
            # One message per step carrying every job's token (48 tokens), not one per job.
            assert 12 <= client.messages <= ran < 48

            # The channel breaks mid-job: the job fails, the scheduler aborts it and frees its blocks.
            body = {"model": MODEL, "prompt": "Go on", "max_tokens": 400, "ignore_eos": True}
            prep = on_channel.preparer.prepare_completion(json.dumps(body).encode())
            stream = await on_channel.start(prep)
            await client.close()
            with pytest.raises(APIError) as failed:
                await asyncio.wait_for(on_channel.complete(prep, stream), 30)
            assert failed.value.status == 500
            deadline = time.monotonic() + 30
            while replica.scheduler.has_work() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stats = await replica.stats()
            assert stats["jobs"] == 0 and stats["device_blocks"]["free"] == stats["device_blocks"]["total"]
            assert stats["delivery_channels"] == {}
            replica.scheduler.check_invariants()
        finally:
            await replica.close()

    asyncio.run(run())


def test_an_idle_delivery_channel_ends_at_both_ends_and_the_next_job_reopens_it() -> None:
    """With ``server.channel_idle_close_s``, the engine replica ends a channel with no job on
    it (so Serve's drain of that replica is not held by it), not one with a job running; the
    ingress's next job there travels on its own stream and opens a new channel.

    Nothing here assumes a step is quicker than the idle time: on a loaded machine a channel
    opened by a job on its own stream idles out before that job's two tokens come, so the test
    watches each channel open and close rather than catch it open."""
    from fastserve.engine.delivery import ChannelClient, JobStream, LocalStream
    from fastserve.engine.replica import EngineReplica

    raw = dummy_opt_yaml()["applications"][0]["args"]
    raw["server"]["channel_idle_close_s"] = 0.3

    async def run() -> None:
        replica = await EngineReplica.create(raw)
        opened: list[str] = []

        def open_channel(ingress: str, replica_id: str, channel_id: str) -> Any:
            opened.append(channel_id)
            return LocalStream(replica.subscribe(ingress, channel_id, replica_id))

        client = ChannelClient("ingress-1", open_channel, open_timeout_s=30)

        async def submit(prompt: str, n: int) -> JobStream:
            req = JobRequest(f"{prompt}-{n}", tuple(TOK.encode(prompt)),
                             SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            stream = client.submit(req.job_id, lambda: LocalStream(replica.generate(req, client.ingress_id)))
            assert await stream.start() is None
            return stream

        async def read(stream: JobStream) -> tuple[int, str | None]:
            deltas = [d async for d in stream]
            return sum(len(d.token_ids) for d in deltas), deltas[-1].finish_reason

        async def at_engine() -> bool:
            return client.ingress_id in (await replica.stats())["delivery_channels"]

        async def gone_at_engine() -> bool:
            return not await at_engine()

        async def until(what: str, check: Callable[[], Any]) -> None:
            """Until ``check()`` (a bool, or a coroutine of one) holds; 30 s at most."""
            deadline = time.monotonic() + 30
            while not ((await ok) if asyncio.iscoroutine(ok := check()) else ok):
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.005)

        try:
            # The first job travels on its own stream and opens a channel, which has no job:
            # both ends drop it within the idle time (+ the loop's wake-ups).
            first = await submit("Opening", 2)
            assert not first.on_channel
            await until("a channel opened", lambda: bool(opened))
            await until("the idle channel ended at the engine replica", gone_at_engine)
            await until("the idle channel ended at the ingress", lambda: not client.live_channels)
            assert await read(first) == (2, "length")
            # The next job travels on its own stream and opens a new channel; a job accepted on
            # it keeps it open while it runs, however much longer than the idle time.
            again = await submit("Again", 3)
            assert not again.on_channel
            await until("a new channel at the engine replica", at_engine)
            long = await submit("A long one", 40)
            assert long.on_channel and len(opened) == 2 and opened[0] != opened[1]
            assert await read(long) == (40, "length") and await read(again) == (3, "length")
            assert client.live_channels == {replica.replica_id: opened[1]} and client.messages >= 2
        finally:
            await client.close()
            await replica.close()

    asyncio.run(run())


PIPELINE_PROMPTS = ("Hello", "The capital of France is", "Once upon a time")


def test_two_model_copies_each_with_a_ray_pipeline(tmp_path: Path) -> None:
    """Engine ``num_replicas: 2`` with PP 2: each copy places its stage workers in its own
    placement group (bundle 0 = replica, 1..2 = stages) and serves the same tokens as one
    in-process model. Runs before the demo server starts, so the two never share the box."""
    from fastserve.engine.delivery import JobStream, LocalStream
    from fastserve.engine.replica import EngineReplica

    args = dummy_opt_yaml()["applications"][0]["args"]

    async def reference() -> list[list[int]]:
        replica = await EngineReplica.create(args)
        try:
            out = []
            for prompt in PIPELINE_PROMPTS:
                req = JobRequest(prompt, tuple(TOK.encode(prompt)),
                                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                deltas = [d async for d in JobStream(req.job_id, LocalStream(replica.generate(req)))]
                out.append([t for d in deltas for t in d.token_ids])
            return out
        finally:
            await replica.close()

    expected = asyncio.run(reference())
    config = dummy_opt_yaml()
    app_args = config["applications"][0]["args"]
    app_args["parallel"].update(pipeline_parallel_size=2, worker_cpus=0.01)
    engine_options(config)["num_replicas"] = 2
    with serve_app(tmp_path, config) as srv:
        got = [greedy_completion(srv, p, 6) for p in PIPELINE_PROMPTS for _ in range(2)]
        assert got == [e for e in expected for _ in range(2)]
        m = wait_metrics(srv, lambda m: len(m.replicas("fastserve:num_requests_running")) == 2)
        assert len(m.replicas("fastserve:num_requests_running")) == 2   # both model copies record


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve_app(tmp_path_factory.mktemp("serve"), dummy_opt_yaml()) as srv:
        yield srv


def scrape(srv: Server) -> Scrape:
    return metrics_view.scrape(srv.base)


def wait_metrics(srv: Server, ok: Callable[[Scrape], bool], timeout: float = 30.0) -> Scrape:
    return metrics_view.wait_metrics(srv.base, ok, timeout)


# ---- the must-shows against the running server -----------------------------------------------

def test_openai_client_completions_and_chat(server: Server) -> None:
    import openai

    before = metrics_view.quiet_metrics(server.base, "fastserve:e2e_request_latency_seconds_count",
                                        3 * int(METRICS_REPORT_MS) / 1000, REQUEST_TIMEOUT_S)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    assert [m.id for m in client.models.list()] == [MODEL]
    fixed = {"ignore_eos": True}

    done = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, extra_body=fixed)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == len(TOK.encode("Hello, my name is"))
    assert isinstance(done.choices[0].text, str)

    text, usage = "", None
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}, extra_body=fixed):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 8

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=6, extra_body=fixed)
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    assert chat.usage.completion_tokens == 6
    assert chat.model_extra is not None and "queue_s" in chat.model_extra["job_stats"]

    pieces, reasons = [], []
    for delta_chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=6, stream=True, extra_body=fixed):
        for d in delta_chunk.choices:
            pieces.append(d.delta.content or "")
            reasons.append(d.finish_reason)
    assert reasons[-1] == "length" and reasons.count("length") == 1

    length, tokens = {"finished_reason": "length"}, "fastserve:generation_tokens_total"
    per_request = [f"fastserve:{suffix}_count" for suffix in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens")]
    # One inter-token latency per token after the first: 7 + 7 + 5 + 5.
    expected = {**{c: 4.0 for c in per_request}, "fastserve:inter_token_latency_seconds_count": 24.0,
                tokens: 28.0}
    # Ray exports families as they are reported, not together: wait for every one of them.
    after = wait_metrics(server, lambda m: m.total("fastserve:request_success_total", **length) >=
                         before.total("fastserve:request_success_total", **length) + 4 and
                         all(m.total(c) >= before.total(c) + n for c, n in expected.items()))
    assert after.total("fastserve:request_success_total", **length) == \
        before.total("fastserve:request_success_total", **length) + 4
    for name, n in expected.items():
        assert after.total(name) == before.total(name) + n, name
    # 8, 8, 6 and 6 generated tokens: all four in the (5, 10] bucket of vLLM's 1-2-5 series.
    bucket = "fastserve:request_generation_tokens_bucket"
    for le, n in (("5.0", 0), ("10.0", 4)):
        assert after.total(bucket, le=le) == before.total(bucket, le=le) + n, le
    assert after.total("fastserve:scheduler_steps_total") > before.total("fastserve:scheduler_steps_total")


LONG_TOKENS = 100
SHORT_LENGTHS = (4, 8, 12, 16, 24)


def test_concurrent_streams_complete_in_order_and_shorts_overtake_a_long_one(server: Server) -> None:
    import openai

    rng = random.Random(7)
    long_prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(120))

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)
        started = asyncio.Event()

        async def one(prompt: str, max_tokens: int, seed: int, signal_first: bool = False) -> dict[str, Any]:
            ids: list[int] = []
            text, usage, stats = "", None, None
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.text
                    ids += (c.model_extra or {}).get("token_ids", [])
                    if signal_first:
                        started.set()
                usage = chunk.usage or usage
                stats = (chunk.model_extra or {}).get("job_stats") or stats
            return {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "ids": ids, "text": text,
                    "usage": usage, "stats": stats, "done_at": time.monotonic()}

        long_task = asyncio.create_task(one("Tell me everything.", LONG_TOKENS, 1000, signal_first=True))
        await asyncio.wait_for(started.wait(), REQUEST_TIMEOUT_S)
        shorts = [one(long_prompt if i % 3 == 0 else f"Question {i}:", SHORT_LENGTHS[i % len(SHORT_LENGTHS)], i)
                  for i in range(19)]
        results = await asyncio.gather(long_task, *shorts)
        return results[0], list(results[1:])

    long, shorts = asyncio.run(run())
    for r in [long, *shorts]:
        assert r["usage"] is not None and r["usage"].completion_tokens == r["max_tokens"] == len(r["ids"])
        assert TOK.decode(r["ids"]) == r["text"]   # streamed text is exactly the streamed tokens, in order
        assert r["stats"] is not None
    assert max(r["done_at"] for r in shorts) < long["done_at"], "a short request finished after the long one"
    assert long["stats"]["demotions"] >= 1   # the long job was demoted below the newcomers (MLFQ)

    # Order check: the same seeded requests, not streamed and alone, give the same token ids.
    for r in shorts[:2]:
        body = {"model": MODEL, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "seed": r["seed"],
                "ignore_eos": True, "return_token_ids": True}
        again = httpx.post(server.url("/v1/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)
        assert again.json()["choices"][0]["token_ids"] == r["ids"]


ERROR_CASES: list[tuple[str, Any, int, dict[str, Any]]] = [
    ("/v1/completions", b'{"model": "opt-125m", "prompt": ', 400, {"code": "invalid_json"}),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 400, {"code": "model_not_found", "param": "model"}),
    ("/v1/completions", {"model": MODEL, "prompt": [7] * 2000, "max_tokens": 100}, 400,
     {"code": "context_length_exceeded", "param": "prompt"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w " * 2100}]}, 400,
     {"code": "context_length_exceeded", "param": "messages"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, {"param": "temperature"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, {"param": "top_p"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, {"param": "max_tokens"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, {"param": "n"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, {"param": "logit_bias"}),
    ("/v1/completions", {"model": MODEL, "prompt": [99999]}, 400, {"param": "prompt"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     {"param": "messages[0].role"}),
]


@pytest.mark.parametrize("path,body,status,expect", ERROR_CASES)
def test_error_cases(server: Server, path: str, body: Any, status: int, expect: dict[str, Any]) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url(path), content=content, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    for key, value in expect.items():
        assert err[key] == value, (key, err)


def test_api_key_is_required(server: Server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(server.url("/v1/completions"), json=body, headers=headers, timeout=60)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 401
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200   # probes need no key


@pytest.mark.parametrize("steer", [{"logit_bias": {"1437": 100}}, {"allowed_token_ids": [1437]}])
def test_logit_bias_and_allowed_token_ids_force_a_token_through_the_real_sampler(
        server: Server, steer: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0.8,
            "return_token_ids": True, **steer}
    resp = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == [1437] * 4


def test_bad_words_keep_a_word_out_through_the_scheduler_and_sampler(server: Server) -> None:
    the, a = 5, 10      # " the" and " a" in OPT's vocabulary
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0.8,
            "return_token_ids": True, "allowed_token_ids": [the, a], "bad_words": ["the"]}
    resp = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == [a] * 4


def test_a_cache_salt_shares_a_prefix_only_with_the_same_salt(server: Server) -> None:
    prompt = [2, *range(1000, 1047)]    # 48 tokens: 2 full blocks of 16 can come from the cache

    def cached(salt: str | None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **({} if salt is None else {"cache_salt": salt})}
        resp = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))

    assert [cached("tenant-a"), cached("tenant-a"), cached("tenant-b"), cached(None)] == [0, 32, 0, 0]


def kv_usage(m: Scrape) -> float:
    return m.total("fastserve:kv_cache_usage_perc")


def test_disconnected_stream_aborts_and_frees_its_blocks(server: Server) -> None:
    aborted = {"finished_reason": "abort"}
    idle = wait_metrics(server, lambda m: kv_usage(m) == 0)
    assert kv_usage(idle) == 0
    body = {"model": MODEL, "prompt": "Go on forever", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=AUTH,
                      timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()   # kept open: leaving a for-loop over it would close the response
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        # the job holds blocks while it streams (sampled every 0.5 s, reported to Ray every 0.5 s)
        busy = wait_metrics(server, lambda m: kv_usage(m) > 0, timeout=15)
    assert kv_usage(busy) > 0
    # 1,500 tokens take well over 20 s here; freed sooner means the disconnect aborted the job.
    after = wait_metrics(server, lambda m: kv_usage(m) == 0 and m.total("fastserve:request_success_total", **aborted)
                         > idle.total("fastserve:request_success_total", **aborted))
    assert kv_usage(after) == 0, "the disconnected job's blocks were not freed"
    assert after.total("fastserve:request_success_total", **aborted) == \
        idle.total("fastserve:request_success_total", **aborted) + 1
    assert after.total("fastserve:num_requests_running") == 0 and after.total("fastserve:num_requests_waiting") == 0


@contextlib.contextmanager
def driver(srv: Server) -> Iterator[None]:
    """This test process as a Ray driver of ``srv``'s cluster, disconnected afterwards (Serve's
    cached controller client too: a later cluster's first driver has the same job id, and Serve
    would take the dead controller's client for its own)."""
    import ray
    from ray.serve.context import _disconnect

    ray.init(address=srv.ray_address, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        _disconnect()
        ray.shutdown()


def test_gauges_match_the_schedulers_own_state_at_a_quiet_point(server: Server) -> None:
    from ray import serve

    body = {"model": MODEL, "prompt": "Count", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=AUTH,
                      timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        busy = wait_metrics(server, lambda m: m.total("fastserve:num_requests_running") == 1 and kv_usage(m) > 0)
    assert busy.total("fastserve:num_requests_running") == 1 and kv_usage(busy) > 0
    quiet = wait_metrics(server, lambda m: m.total("fastserve:num_requests_running") == 0 and kv_usage(m) == 0)
    with driver(server):
        handle = serve.get_deployment_handle("Engine", app_name="fastserve")
        stats = handle.stats.remote().result(timeout_s=60)
        info = handle.replica_info.remote().result(timeout_s=60)
    (running,) = quiet.series("fastserve:num_requests_running")   # one replica, one series
    (usage,) = quiet.series("fastserve:kv_cache_usage_perc")
    blocks = stats["device_blocks"]
    assert running.labels["replica"] == usage.labels["replica"] == info["replica_id"]
    assert running.labels["model_name"] == MODEL and running.labels["deployment"] == "Engine"
    assert running.value == stats["running"] == 0
    assert usage.value == (blocks["total"] - blocks["free"]) / blocks["total"] == 0.0


def test_metrics_families_have_their_types_and_parse(server: Server) -> None:
    from fastserve.engine.metrics import ENGINE_FAMILIES, INGRESS_FAMILIES

    resp = httpx.get(server.url("/metrics"), timeout=30)
    assert resp.headers["content-type"].startswith("text/plain")
    m = Scrape.parse(resp.text)   # prometheus_client's parser accepts the whole answer
    declared = {f"fastserve:{suffix}": f.kind for suffix, f in {**ENGINE_FAMILIES, **INGRESS_FAMILIES}.items()}
    assert set(m.types) <= set(declared)   # ours only: Ray's and Serve's own stay on the agents
    for name, kind in m.types.items():
        assert kind == declared[name], name
    # Gauges exist from the first sample; counters and histograms from their first event (as
    # vLLM's on Ray). These are the ones the earlier tests' requests produced (the demo's KV
    # pool never filled, so no swap, preemption or ENST prediction happened).
    gauges = {n for n, k in declared.items() if k == "gauge"}
    produced = {"fastserve:request_success", "fastserve:prompt_tokens", "fastserve:generation_tokens",
                "fastserve:scheduler_steps", "fastserve:demotions", "fastserve:time_to_first_token_seconds",
                "fastserve:inter_token_latency_seconds", "fastserve:request_time_per_output_token_seconds",
                "fastserve:e2e_request_latency_seconds", "fastserve:request_queue_time_seconds",
                "fastserve:request_prefill_time_seconds", "fastserve:request_decode_time_seconds",
                "fastserve:request_inference_time_seconds", "fastserve:request_prompt_tokens",
                "fastserve:request_generation_tokens", "fastserve:request_wait_time_seconds",
                "fastserve:request_swap_blocked_time_seconds"}
    assert gauges | produced <= set(m.types), sorted(gauges | produced - set(m.types))
    levels = {s.labels["level"] for s in m.series("fastserve:mlfq_jobs", state="waiting")}
    assert levels and levels == {s.labels["level"] for s in m.series("fastserve:mlfq_jobs", state="running")}
