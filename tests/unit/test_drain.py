"""Serve's graceful_shutdown_timeout_s sized for a max_tokens stream at a TPOT (fastserve.config_drain)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fastserve.config import INGRESS_DEFAULTS, AppArgs, resolve_path
from fastserve.scheduler.profile import Profile
from tests.harness.app_config import demo_args, error_of


def args(**drain: Any) -> AppArgs:
    raw = demo_args()
    raw["drain"] = drain
    return AppArgs.model_validate(raw)


def test_explicit_tokens_and_tpot_give_their_product_with_slack_rounded_up() -> None:
    a = args(max_tokens=600, tpot_s=0.2, slack=1.0)
    assert a.engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 120.0
    assert a.ingress_deployment_defaults() == {**INGRESS_DEFAULTS, "graceful_shutdown_timeout_s": 120.0}
    assert args(max_tokens=100, tpot_s=0.0301, slack=2.0).engine_deployment_defaults()[
        "graceful_shutdown_timeout_s"] == 7.0   # ceil(6.02)
    assert args(max_tokens=10, tpot_s=0.01).engine_deployment_defaults()[
        "graceful_shutdown_timeout_s"] == 5.0   # never below min_s
    assert args(max_tokens=10, tpot_s=0.01, min_s=30).ingress_deployment_defaults()[
        "graceful_shutdown_timeout_s"] == 30.0


def test_sized_by_default_for_a_context_length_stream_at_the_full_batch_step() -> None:
    a = args()
    tpot = Profile.load(resolve_path(a.profile.path)).t_dec(a.scheduler.max_batch_size)
    assert (a.model.context_len(), a.scheduler.max_batch_size) == (2048, 32)
    assert a.engine_deployment_defaults()["graceful_shutdown_timeout_s"] == \
        math.ceil(1.5 * 2048 * tpot) == 242.0
    assert a.ingress_deployment_defaults()["graceful_shutdown_timeout_s"] == 242.0
    assert args(max_tokens=2048).engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 242.0
    assert args(tpot_s=tpot).engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 242.0
    assert args(max_tokens=1024, slack=2.0).engine_deployment_defaults()[
        "graceful_shutdown_timeout_s"] == math.ceil(2.0 * 1024 * tpot) == 161.0


def test_no_drain_outlasts_the_request_timeout() -> None:
    raw = demo_args()
    raw["server"] = {**raw.get("server", {}), "request_timeout_s": 100.0}
    a = AppArgs.model_validate(raw)
    assert a.engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 100.0   # not 242
    raw["drain"] = {"min_s": 120.0}   # min_s wins over both
    assert AppArgs.model_validate(raw).engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 120.0


@pytest.mark.parametrize("drain,field", [({"max_tokens": 0}, "max_tokens"), ({"tpot_s": 0}, "tpot_s"),
                                         ({"slack": 0.5}, "slack"), ({"tpotS": 1}, "tpotS")])
def test_bad_drain_settings_name_themselves(drain: dict[str, Any], field: str) -> None:
    raw = demo_args()
    raw["drain"] = drain
    assert f"drain.{field}" in error_of(raw)


def test_a_missing_profile_needs_an_explicit_tpot() -> None:
    raw = demo_args()
    raw["profile"] = {"path": "config/profiles/not-there.json"}
    raw["drain"] = {"max_tokens": 2048}
    a = AppArgs.model_validate(raw, context={"require_profile": False})
    with pytest.raises(ValueError, match="drain.tpot_s is unset"):
        a.engine_deployment_defaults()
    raw["drain"] = {"tpot_s": 0.05}
    ok = AppArgs.model_validate(raw, context={"require_profile": False})
    assert ok.engine_deployment_defaults()["graceful_shutdown_timeout_s"] == 154.0   # 1.5 × 2048 × 0.05 → 153.6
