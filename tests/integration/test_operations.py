"""Operating the app on a Ray cluster the way an operator does: ``serve run`` of changed configs
on a running cluster, an Engine replica killed and replaced, engine autoscaling.

One private Ray head for the module (as ``test_serve``'s, with Ray's metrics reporting every
0.5 s); the app is (re)deployed with ``serve run --non-blocking <config>`` — the CLI an operator
uses, which applies the config to the running app like ``serve deploy`` — and inspected from
this process as a Ray driver through Serve's controller (what ``serve status`` shows).
Tests run in file order and build on each other's deployments to share one app's start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fastserve.config import AppArgs
from tests.harness import metrics_view
from tests.harness.serve import (
    AUTH,
    BIN,
    METRICS_REPORT_MS,
    MODEL,
    REQUEST_TIMEOUT_S,
    ROOT,
    STARTUP_TIMEOUT_S,
    dummy_opt_yaml,
    engine_options,
    free_port,
    private_ray_head,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

APP = "fastserve"
DEPLOY_TIMEOUT_S = 180.0


def ingress_options(config: dict[str, Any]) -> dict[str, Any]:
    (options,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress"]
    return options


@dataclass
class Cluster:
    address: str
    http: int
    tmp: Path
    env: dict[str, str]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def deploy(self, config: dict[str, Any], name: str) -> None:
        """``serve run --non-blocking`` of ``config``: submits it to the running Serve and returns."""
        config = copy.deepcopy(config)
        config["http_options"]["port"] = self.http
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            done = subprocess.run([str(BIN / "serve"), "run", "--non-blocking", str(path)], cwd=ROOT, env=self.env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=DEPLOY_TIMEOUT_S, check=False)
        assert done.returncode == 0, log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import ray

    tmp = tmp_path_factory.mktemp("ops")
    with private_ray_head(tmp) as head:
        ray.init(address=head.address, log_to_driver=False, configure_logging=False)
        try:
            yield Cluster(head.address, free_port(), tmp, head.env)
        finally:
            ray.shutdown()


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:.0f} s")
        time.sleep(0.5)


def details() -> dict[str, Any]:
    """Serve's view of the app (what ``serve status`` and the dashboard show)."""
    from ray.serve.context import _get_global_client

    out: dict[str, Any] = _get_global_client().get_serve_details()
    return out


def deployment(name: str) -> dict[str, Any]:
    dep: dict[str, Any] = details()["applications"][APP]["deployments"][name]
    return dep


def running_replicas(name: str) -> list[dict[str, Any]]:
    with contextlib.suppress(KeyError):
        return [r for r in deployment(name)["replicas"] if r["state"] == "RUNNING"]
    return []


def settled(name: str, replicas: int, **config: Any) -> bool:
    """``name`` is HEALTHY with exactly ``replicas`` running and ``config`` applied."""
    try:
        dep = deployment(name)
    except KeyError:
        return False
    applied = all(dep["deployment_config"].get(k) == v for k, v in config.items())
    return dep["status"] == "HEALTHY" and len(running_replicas(name)) == replicas and applied


def complete(cluster: Cluster, prompt: str, max_tokens: int) -> None:
    resp = httpx.post(cluster.base + "/v1/completions", headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert resp.status_code == 200, resp.text


def engine_actor_ids() -> set[str]:
    return {r["actor_id"] for r in running_replicas("Engine")}


def quiet_metrics(cluster: Cluster) -> metrics_view.Scrape:
    return metrics_view.quiet_metrics(cluster.base, "fastserve:generation_tokens_total",
                                      3 * int(METRICS_REPORT_MS) / 1000, REQUEST_TIMEOUT_S)


# ---- the tests, in order: each starts from the deployment the previous one left ----------------

#: The deployments v1–v3 (the first three tests) keep an idle delivery channel open this long: the
#: kill test checks that its stream's job travels on a channel, and with the 2 s default an idle
#: channel can close between its "every ingress has a channel" check and the stream on a loaded
#: machine (CI saw it: the job went on its own stream). Short enough that the replicas the
#: autoscaling test replaces still drain soon; the drain test keeps the default.
CHANNEL_IDLE_CLOSE_S = 30.0


def test_ingress_count_and_scheduler_max_ongoing_are_lightweight_updates(cluster: Cluster) -> None:
    config = dummy_opt_yaml()
    config["applications"][0]["args"]["server"]["channel_idle_close_s"] = CHANNEL_IDLE_CLOSE_S
    cluster.deploy(config, "v1")
    wait_until("v1 running", lambda: settled("Engine", 1) and settled("Ingress", 1), STARTUP_TIMEOUT_S)
    complete(cluster, "Hello", 4)
    (actor,) = engine_actor_ids()

    ingress_options(config)["num_replicas"] = 2
    cluster.deploy(config, "v2")
    wait_until("2 ingress replicas", lambda: settled("Ingress", 2), DEPLOY_TIMEOUT_S)
    assert engine_actor_ids() == {actor}

    engine_options(config)["max_ongoing_requests"] = 512
    cluster.deploy(config, "v3")
    wait_until("max_ongoing_requests 512", lambda: settled("Engine", 1, max_ongoing_requests=512),
               DEPLOY_TIMEOUT_S)
    assert engine_actor_ids() == {actor}   # the model copy was not restarted
    complete(cluster, "Hello again", 4)


COUNTERS = ("fastserve:generation_tokens_total", "fastserve:prompt_tokens_total", "fastserve:scheduler_steps_total",
            "fastserve:request_success_total")


def test_counters_do_not_decrease_when_a_scheduler_replica_is_replaced(cluster: Cluster) -> None:
    import ray

    tokens = "fastserve:generation_tokens_total"
    quiet = quiet_metrics(cluster)
    complete(cluster, "Before the kill", 8)
    before = metrics_view.wait_metrics(cluster.base, lambda m: m.total(tokens) == quiet.total(tokens) + 8)
    assert all(before.total(c) > 0 for c in COUNTERS)
    (old,) = running_replicas("Engine")
    ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
    wait_until("a replacement replica", lambda: engine_actor_ids() not in (set(), {old["actor_id"]}),
               STARTUP_TIMEOUT_S)
    complete(cluster, "After the kill", 8)
    # Token counters move at each metrics tick, so the last token may land a tick after the
    # new replica's series first appears: wait for both.
    after = metrics_view.wait_metrics(
        cluster.base, lambda m: len(m.replicas(tokens)) == 2
        and m.total(tokens) >= before.total(tokens) + 8)
    for name in COUNTERS:
        assert after.total(name) >= before.total(name), name
    # The dead replica's series keep their last value beside the new replica's own.
    assert after.total(tokens, replica=old["replica_id"]) == before.total(tokens, replica=old["replica_id"])
    assert after.total(tokens) == before.total(tokens) + 8


def scheduler_stats(cluster: Cluster) -> dict[str, Any]:
    """The engine replica's stats through the ingress (``/debug/engine``). Not a handle from
    this process: a Serve handle's router outlives ``ray.shutdown`` here, and once the cluster
    is gone Ray's core worker ends the whole test process after 60 s without GCS."""
    resp = httpx.get(cluster.base + "/debug/engine", headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    stats: dict[str, Any] = resp.json()
    return stats


def test_a_stream_on_a_killed_scheduler_replica_ends_with_an_error_and_service_resumes(cluster: Cluster) -> None:
    """The stream's job travels on its ingress replica's delivery channel; the replica dies
    mid-stream: the client gets an error event and [DONE] (not a hang), and the next requests
    are served by the replacement, which gets channels of its own."""
    import json

    import ray

    ingresses = len(running_replicas("Ingress"))

    def every_ingress_has_a_channel() -> bool:
        complete(cluster, "Open a channel", 2)   # a job's accepted event opens its ingress's channel
        return len(scheduler_stats(cluster)["delivery_channels"]) == ingresses

    wait_until("a delivery channel from every ingress replica", every_ingress_has_a_channel, REQUEST_TIMEOUT_S)
    (old,) = running_replicas("Engine")
    body = {"model": MODEL, "prompt": "Go on forever", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.base + "/v1/completions", json=body, headers=AUTH,
                      timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        chunks = 0
        while chunks < 3:
            chunks += next(lines).startswith("data: ")
        assert sum(scheduler_stats(cluster)["delivery_channels"].values()) == 1   # the job is on a channel
        ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["type"] == "internal_error", error
    wait_until("a replacement replica", lambda: engine_actor_ids() not in (set(), {old["actor_id"]}),
               STARTUP_TIMEOUT_S)
    wait_until("delivery channels to the replacement", every_ingress_has_a_channel, REQUEST_TIMEOUT_S)


def test_scheduler_autoscales_to_two_model_copies_and_both_serve(cluster: Cluster) -> None:
    """Each new replica reserves its whole model copy: its own placement group holding the
    replica's bundle and its stage worker's (a Ray pipeline of one stage; plain actor calls, as a
    compiled graph's idle threads would take a core of this 2-core box)."""
    from ray.util import placement_group_table

    config = dummy_opt_yaml()
    args = config["applications"][0]["args"]
    args["parallel"].update(use_ray_pipeline=True, transport="actor")
    bundles = AppArgs.model_validate(args).placement_group_bundles()
    assert len(bundles) == 2
    options = engine_options(config)
    del options["num_replicas"]
    options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                     "upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 0.5,
                                     "look_back_period_s": 2}
    cluster.deploy(config, "autoscaling")
    wait_until("autoscaling applied", lambda: settled("Engine", 1) and
               deployment("Engine")["deployment_config"].get("autoscaling_config") is not None, DEPLOY_TIMEOUT_S)
    before = metrics_view.scrape(cluster.base)

    async def burst() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=REQUEST_TIMEOUT_S) as client:
            async def one(i: int) -> None:
                body = {"model": MODEL, "prompt": f"Burst {i}", "max_tokens": 60, "ignore_eos": True}
                resp = await client.post(cluster.base + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text

            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while len(running_replicas("Engine")) < 2 and time.monotonic() < deadline:
                await asyncio.gather(*(one(i) for i in range(6)))   # 6 ongoing vs a target of 1
    asyncio.run(burst())
    replicas = running_replicas("Engine")
    assert len(replicas) == 2
    groups = placement_group_table().values()
    for r in replicas:   # Serve names a replica's placement group after the replica's actor
        (group,) = [g for g in groups if g["name"] == r["actor_name"]]
        assert group["state"] == "CREATED" and list(group["bundles"].values()) == bundles

    def both_served(m: metrics_view.Scrape) -> bool:
        return all(m.total("fastserve:generation_tokens_total", replica=r["replica_id"]) >
                   before.total("fastserve:generation_tokens_total", replica=r["replica_id"]) for r in replicas)

    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    m = metrics_view.scrape(cluster.base)
    while not both_served(m) and time.monotonic() < deadline:
        for i in range(4):
            complete(cluster, f"Spread {i}", 4)
        m = metrics_view.wait_metrics(cluster.base, both_served, timeout=5)
    assert both_served(m), "both model copies should have generated tokens"


#: Streams started one at a time before a downscale 2 → 1 until each replica has one in flight,
#: at most this many (see ``FRESH_QUEUE_LENGTHS``: at most four are needed); each long enough to
#: be in flight while the downscale is applied (~5 s) even on a quiet box (~35 ms a token), and
#: short enough to end well within the bound below on a loaded one (4 × 500 tokens on two
#: replicas did not end within 180 s here with other work on the 2 cores).
MAX_DRAIN_STREAMS, DRAIN_STREAM_TOKENS = 6, 800
#: The drain test's ingress replicas ask both Engine replicas their queue length for every call.
#: With Serve's default (a replica's length cached 10 s by each ingress router, and a replica with
#: a cached length preferred to one without), one ingress replica sent all six streams to the
#: replica it had just used (CI, 2026-12-02: {6, 0}). Probed fresh, the two lengths differ by the
#: delivery channels (at most one per ingress replica, so by at most 2) plus the streams, and
#: the router takes the shorter: by the fourth stream each replica has one.
FRESH_QUEUE_LENGTHS = {"env_vars": {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "0"}}
#: Bound on the streams' end: the server's own request timeout (server.request_timeout_s).
STREAMS_END_WITHIN_S = 600.0
#: How soon after its last stream ends a drained replica must be gone: the idle delivery channels
#: end (server.channel_idle_close_s, 2 s), Serve's drain loop looks every 2 s
#: (graceful_shutdown_wait_loop_s), the controller then reaps it; far below the 242 s timeout.
GONE_AFTER_LAST_STREAM_S = 30.0


def test_a_downscale_during_streams_drains_them_whole_and_the_replica_stops_after_the_last(
        cluster: Cluster) -> None:
    """Engine 2 → 1 replicas (a lightweight update: Serve stops one of the two) while streams
    run on both. The stopped replica drains under the default ``graceful_shutdown_timeout_s``,
    sized for a context-length stream (242 s here): its streams complete with every token, and
    once the last one ends it stops within seconds, not at the timeout — its ingresses'
    delivery channels, idle from then on, no longer hold it."""
    import json
    import threading

    config = dummy_opt_yaml()
    config["applications"][0]["args"]["server"]["allow_reset_prefix_cache"] = True
    # Two model copies on two cores: their OpenMP threads sleep when out of work. Spinning (the
    # default), these streams took 240-272 s, past the drain timeout (a CI failure); passive 62-76 s.
    config["applications"][0]["args"]["parallel"]["omp_wait_policy"] = "passive"
    ingress_options(config)["num_replicas"] = 2                         # as the tests above left it
    ingress_options(config)["ray_actor_options"] = {"num_cpus": 0, "runtime_env": FRESH_QUEUE_LENGTHS}
    engine_options(config).update(num_replicas=2, max_ongoing_requests=512)
    timeout_s = AppArgs.model_validate(config["applications"][0]["args"]).engine_deployment_defaults()[
        "graceful_shutdown_timeout_s"]
    assert timeout_s == 242.0   # the default drain, not set in the config
    cluster.deploy(config, "drain-two")
    wait_until("two engine replicas", lambda: settled("Engine", 2, graceful_shutdown_timeout_s=timeout_s)
               and settled("Ingress", 2, graceful_shutdown_timeout_s=timeout_s), STARTUP_TIMEOUT_S)
    complete(cluster, "Warm up", 2)
    replica_ids = {r["replica_id"] for r in running_replicas("Engine")}
    assert scheduler_stats(cluster)["omp_wait_policy"] == "PASSIVE"   # the builder's runtime_env

    events: list[list[str]] = [[] for _ in range(MAX_DRAIN_STREAMS)]
    ended_at: list[float] = [0.0] * MAX_DRAIN_STREAMS

    def read_stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Keep going {i}", "max_tokens": DRAIN_STREAM_TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", cluster.base + "/v1/completions", json=body, headers=AUTH,
                              timeout=REQUEST_TIMEOUT_S) as resp:
                events[i].append(f"status {resp.status_code}")
                events[i] += [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        finally:
            ended_at[i] = time.monotonic()

    def running_on_both(m: metrics_view.Scrape) -> bool:
        return all(m.total("fastserve:num_requests_running", replica=r) >= 1 for r in replica_ids)

    readers: list[threading.Thread] = []
    on_both = metrics_view.scrape(cluster.base)
    while not running_on_both(on_both) and len(readers) < MAX_DRAIN_STREAMS:
        readers.append(threading.Thread(target=read_stream, args=(len(readers),), daemon=True))
        readers[-1].start()
        on_both = metrics_view.wait_metrics(cluster.base, running_on_both, timeout=5)
    assert running_on_both(on_both), {r: on_both.total("fastserve:num_requests_running", replica=r)
                                      for r in replica_ids}
    assert len(readers) <= 4, f"{len(readers)} streams to reach both replicas: FRESH_QUEUE_LENGTHS unheeded?"
    # The prefix-cache reset reaches both model copies, each with its own cache (sent once the
    # streams are placed, so that it cannot sway where they go). Jobs keep their own blocks.
    reset = httpx.post(cluster.base + "/reset_prefix_cache", headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    assert reset.status_code == 200 and reset.json()["replicas"] == 2, reset.text

    engine_options(config)["num_replicas"] = 1
    cluster.deploy(config, "drain-one")
    stopping: dict[str, Any] | None = None
    deadline = time.monotonic() + STREAMS_END_WITHIN_S
    while stopping is None and any(r.is_alive() for r in readers) and time.monotonic() < deadline:
        stopping = next((r for r in deployment("Engine")["replicas"] if r["state"] == "STOPPING"), None)
        time.sleep(0.2)
    assert stopping is not None, "no Engine replica was seen draining while the streams ran"
    running_while_stopping = metrics_view.scrape(cluster.base).total("fastserve:num_requests_running",
                                                                     replica=stopping["replica_id"])
    for reader in readers:
        reader.join(timeout=max(deadline - time.monotonic(), 1))
        assert not reader.is_alive(), f"a stream did not end within {STREAMS_END_WITHIN_S:.0f} s"
    assert running_while_stopping >= 1, "the drained replica had no stream left when it was seen draining"
    last_end = max(ended_at[:len(readers)])

    for i, got in enumerate(events[:len(readers)]):
        assert got[0] == "status 200" and got[-1] == "[DONE]", (i, got[:2], got[-3:])
        bodies = [json.loads(e) for e in got[1:-1]]
        assert not any("error" in b for b in bodies), [b for b in bodies if "error" in b]
        assert [c["finish_reason"] for b in bodies for c in b["choices"] if c["finish_reason"]] == ["length"]
        assert bodies[-1]["usage"]["completion_tokens"] == DRAIN_STREAM_TOKENS
        assert sum(1 for b in bodies for c in b["choices"] if c["text"]) >= 1

    def gone() -> bool:
        assert stopping is not None
        return stopping["replica_id"] not in {r["replica_id"] for r in deployment("Engine")["replicas"]}

    wait_until("the drained replica gone", gone, timeout_s)
    gone_after = time.monotonic() - last_end
    assert gone_after < GONE_AFTER_LAST_STREAM_S, f"gone {gone_after:.1f} s after the last stream ended"
    assert settled("Engine", 1)
    complete(cluster, "After the downscale", 4)
