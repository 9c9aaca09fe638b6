"""The application's deployments are named ``Engine`` and ``Ingress`` (the names a config's
``deployments:`` section uses to set their Serve options)."""

from __future__ import annotations

from typing import Any

import yaml

from fastserve.main import ENGINE, INGRESS, build_app
from tests.harness.serve import ROOT


def shipped_config() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "config" / "opt125m-dummy.yaml").read_text())
    app: dict[str, Any] = raw["applications"][0]
    return app


def test_the_built_application_names_its_deployments_engine_and_ingress() -> None:
    """Serve's own build step (what ``serve run`` does before applying ``deployments:``), no cluster."""
    from ray.serve._private.build_app import build_app as serve_build

    built = serve_build(build_app(shipped_config()["args"]), name="fastserve")
    assert sorted(d.name for d in built.deployments) == sorted([ENGINE, INGRESS]) == ["Engine", "Ingress"]


def test_the_shipped_configs_name_only_those_deployments() -> None:
    names = {d["name"] for path in sorted((ROOT / "config").glob("*.yaml"))
             for app in (yaml.safe_load(path.read_text()) or {}).get("applications", [])
             for d in app.get("deployments", [])}
    assert names <= {ENGINE, INGRESS}
