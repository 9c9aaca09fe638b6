"""The real experiments' Serve config: one app per policy, the paper's admit-everything setting;
the environment its ``serve run`` gets."""

from __future__ import annotations

import pytest

from fastserve.bench.experiments.fig11_real import ADMIT_ALL
from fastserve.bench.experiments.server import multi_policy_config, serve_env
from fastserve.config import AppArgs


def test_one_app_per_policy_with_overrides_validated_by_app_args() -> None:
    raw = multi_policy_config(["fcfs", "skip_join_mlfq"], 8123, args_overrides=ADMIT_ALL)
    assert raw["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert [a["route_prefix"] for a in raw["applications"]] == ["/fcfs", "/skip_join_mlfq"]
    for app, policy in zip(raw["applications"], ["fcfs", "skip_join_mlfq"], strict=True):
        args = AppArgs.model_validate(app["args"])
        assert args.scheduler.policy == policy
        assert args.engine.max_jobs == 100_000
        assert args.scheduler.admission_queue_limit == 100_000
        assert args.scheduler.max_batch_size == 16   # the paper's, not the demo's 32
        assert args.kv_cache.num_device_blocks == 256  # the rest stays the demo's


def test_without_overrides_the_demo_limits_stay() -> None:
    app = multi_policy_config(["fcfs"], 8123)["applications"][0]
    assert app["args"]["engine"]["max_jobs"] == 64
    assert app["args"]["scheduler"]["admission_queue_limit"] == 64
    assert app["args"]["scheduler"]["max_batch_size"] == 32


def test_serve_env_runs_our_replicas_at_nice_0_unless_the_caller_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    env = serve_env("/tmp/ray-x")
    assert (env["RAY_worker_niceness"], env["RAY_TMPDIR"], "RAY_ADDRESS" in env) == ("0", "/tmp/ray-x", False)
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert serve_env("/tmp/ray-x")["RAY_worker_niceness"] == "5"
