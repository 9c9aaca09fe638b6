"""The Serve application builder, ``fastserve.main:build_app`` (what ``config/*.yaml`` import): the
graph Ingress ─generate→ Engine (× model copies), tokens back over one channel, and each
deployment's name and default options; the YAML's ``deployments:`` section applies over them.
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
ENGINE = "Engine"


def build_app(args: AppArgs) -> Application:
    """Serve passes the YAML's ``args`` as a dict (the annotation is a string, so it does not validate)."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    raw = args.replica_args()
    engine = serve.deployment(name=ENGINE, **args.engine_deployment_defaults(),
                              request_router_config={"request_router_class": ROUTER_CLASS})(
        EngineReplica).bind(raw)
    return serve.deployment(name=INGRESS, **args.ingress_deployment_defaults())(Ingress).bind(engine, raw)
