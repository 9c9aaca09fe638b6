"""The engine deployment's name: ``Engine``, and the deprecated ``Scheduler`` accepted for one
release where a config's ``deployments:`` section still says it, with a logged message.

Serve matches ``deployments:`` entries to deployments by name after the builder returns, so the
builder reads the section from the configs the Serve controller holds; here they are given as
Serve's ``get_serve_details`` shapes them (``tests/integration/test_serve.py`` deploys an old
config on a real cluster).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import yaml

from fastserve.config import AppArgs
from fastserve.main import DEPRECATED_ENGINE, ENGINE, build_app, declared_deployment_names, engine_deployment_name
from tests.harness.serve import ROOT


def shipped_config() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "config" / "opt125m-dummy.yaml").read_text())
    app: dict[str, Any] = raw["applications"][0]
    return app


def test_the_new_name_is_used_and_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="fastserve.main"):
        assert engine_deployment_name(["Ingress", "Engine"]) == ENGINE == "Engine"
        assert engine_deployment_name([]) == "Engine"   # no deployments: section at all
    assert caplog.records == []


def test_the_old_name_is_kept_for_one_release_with_a_logged_deprecation(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fastserve.main"):
        assert engine_deployment_name(["Ingress", "Scheduler"]) == DEPRECATED_ENGINE == "Scheduler"
    assert [(r.name, r.levelno) for r in caplog.records] == [("fastserve.main", logging.WARNING)]
    assert caplog.records[0].getMessage() == (
        "deployments: names 'Scheduler', the engine deployment's deprecated name: it is 'Engine' now. "
        "The old name is accepted for one release and then refused: rename the entry to 'Engine'.")


def test_both_names_at_once_are_refused() -> None:
    with pytest.raises(ValueError, match="names both 'Engine' and 'Scheduler'.*keep one entry, named 'Engine'"):
        engine_deployment_name(["Ingress", "Engine", "Scheduler"])


def test_only_the_config_built_from_these_args_counts() -> None:
    ours = shipped_config()
    old = {**ours, "deployments": [{"name": "Ingress"}, {"name": "Scheduler", "num_replicas": 1}]}
    other_args = {**ours["args"], "server": {"retry_after_s": 7}}
    other = {"name": "other", "args": other_args, "deployments": [{"name": "Elsewhere"}]}
    no_section = {"name": "bare", "args": ours["args"]}
    assert declared_deployment_names([other, old, no_section], ours["args"]) == {"Ingress", "Scheduler"}
    assert declared_deployment_names([other], ours["args"]) == set()
    # Validated args (a direct caller) match the raw ones they were validated from.
    assert declared_deployment_names([other, old], AppArgs.model_validate(ours["args"])) == {"Ingress", "Scheduler"}


def test_the_built_application_names_its_deployments_engine_and_ingress() -> None:
    """Serve's own build step (what ``serve run`` does before applying ``deployments:``), no cluster."""
    from ray.serve._private.build_app import build_app as serve_build

    built = serve_build(build_app(shipped_config()["args"]), name="fastserve")
    assert sorted(d.name for d in built.deployments) == ["Engine", "Ingress"]
