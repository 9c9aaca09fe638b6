"""The Serve application builder: ``fastserve.main:build_app`` (what ``config/*.yaml`` import).

Owns the application graph, each deployment's name and default Serve options:

    Ingress (FastAPI, CPU)  ──generate──▶  Engine (× model copies, owns its executor)
                            ◀─channel──   (one message per step per ingress replica)

Both record their metrics into Ray's metrics pipeline (``fastserve.engine.metrics``); the ingress's
``/metrics`` reads them back from Ray's metrics agents (``fastserve.server.metrics_export``).

``args`` carry the model, scheduler and KV settings only. Replica counts, ``autoscaling_config``,
``max_ongoing_requests`` and ``ray_actor_options`` go in the YAML's standard ``deployments:``
section, which Serve applies over the defaults set here (``fastserve.config.INGRESS_DEFAULTS`` and
``ENGINE_DEFAULTS``, with ``graceful_shutdown_timeout_s`` sized by ``fastserve.config_drain``) as a
lightweight update. Each Engine replica reserves its whole model copy with
``placement_group_bundles`` (bundle 0 for the replica, one per pipeline stage with its TP ranks'
GPUs), so when Serve's autoscaler adds a replica, the KubeRay autoscaler behind it sees what one
more model copy needs.

The engine deployment was called ``Scheduler`` (a name it shared with the policy class its engine
holds). A YAML whose ``deployments:`` section still says ``name: Scheduler`` deploys under the old
name, with a deprecation message, for one release: Serve matches that section to the deployments
by name after this builder returns, so the builder reads the section from the Serve controller
(which holds the config being deployed) and names the deployment as the config does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from fastserve.config import AppArgs
from fastserve.engine.replica import EngineReplica
from fastserve.server.ingress_deployment import Ingress
from fastserve.server.routing import ROUTER_CLASS

APP_NAME = "fastserve"
INGRESS = "Ingress"
#: The deployment that holds the engine (one replica = one model copy).
ENGINE = "Engine"
#: The engine deployment's former name, accepted in a config's ``deployments:`` for one release.
DEPRECATED_ENGINE = "Scheduler"

log = logging.getLogger(__name__)


def build_app(args: AppArgs) -> Application:
    """Serve calls this with the YAML's ``args`` (a dict: the annotation is a string here, so
    Serve does not validate it); tests and scripts may pass them validated."""
    given = args
    if not isinstance(args, AppArgs):   # called directly with a dict (tests, scripts)
        args = AppArgs.model_validate(args)
    raw = args.replica_args()
    name = engine_deployment_name(declared_deployment_names(_deployed_app_configs(), given))
    # The router sends each ingress replica's delivery channel to the replica it asked for.
    engine = serve.deployment(name=name, **args.engine_deployment_defaults(),
                              request_router_config={"request_router_class": ROUTER_CLASS})(
        EngineReplica).bind(raw)
    return serve.deployment(name=INGRESS, **args.ingress_deployment_defaults())(Ingress).bind(engine, raw)


def engine_deployment_name(declared: Iterable[str]) -> str:
    """The engine deployment's name, given the names a config's ``deployments:`` section uses:
    ``Engine``, or the deprecated ``Scheduler`` (logged) where the config still says so."""
    names = set(declared)
    if DEPRECATED_ENGINE not in names:
        return ENGINE
    if ENGINE in names:
        raise ValueError(f"deployments: names both {ENGINE!r} and {DEPRECATED_ENGINE!r}, the engine "
                         f"deployment's new and deprecated names: keep one entry, named {ENGINE!r}")
    log.warning("deployments: names %r, the engine deployment's deprecated name: it is %r now. The "
                "old name is accepted for one release and then refused: rename the entry to %r.",
                DEPRECATED_ENGINE, ENGINE, ENGINE)
    return DEPRECATED_ENGINE


def declared_deployment_names(app_configs: Iterable[Mapping[str, Any]],
                              args: Mapping[str, Any] | AppArgs) -> set[str]:
    """The names in the ``deployments:`` sections of the Serve app configs built from ``args``
    (Serve passes the builder the YAML's ``args`` as they are; a caller may pass them validated)."""
    names: set[str] = set()
    for config in app_configs:
        theirs = config.get("args")
        if isinstance(args, AppArgs):
            try:
                same = theirs is not None and AppArgs.model_validate(theirs) == args
            except ValidationError:
                same = False
        else:
            same = theirs == args
        if same:
            names.update(d["name"] for d in config.get("deployments", ()))
    return names


def _deployed_app_configs() -> list[Mapping[str, Any]]:
    """The app configs the Serve controller is deploying or has deployed (Serve stores a config
    before it starts the build task that calls ``build_app``); none outside a Serve cluster."""
    if not ray.is_initialized():
        return []
    from ray.serve.context import _get_global_client  # Serve's own handle to its controller

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return []
    apps = client.get_serve_details().get("applications", {})
    return [app["deployed_app_config"] for app in apps.values() if app.get("deployed_app_config")]
