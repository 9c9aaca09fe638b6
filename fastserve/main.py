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
"""

from __future__ import annotations

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


def build_app(args: AppArgs) -> Application:
    """Serve calls this with the YAML's ``args`` (a dict: the annotation is a string here, so
    Serve does not validate it); tests and scripts may pass them validated."""
    if not isinstance(args, AppArgs):   # called directly with a dict (tests, scripts)
        args = AppArgs.model_validate(args)
    raw = args.replica_args()
    # The router sends each ingress replica's delivery channel to the replica it asked for.
    engine = serve.deployment(name=ENGINE, **args.engine_deployment_defaults(),
                              request_router_config={"request_router_class": ROUTER_CLASS})(
        EngineReplica).bind(raw)
    return serve.deployment(name=INGRESS, **args.ingress_deployment_defaults())(Ingress).bind(engine, raw)
