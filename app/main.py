"""The Serve application builder: ``app.main:build_app`` (what ``config/*.yaml`` import).

Owns the application graph and each deployment's default Serve options:

    Ingress (FastAPI, CPU)  ──generate──▶  Scheduler (× model copies, owns its executor)
                            ◀─channel──   (one message per step per ingress replica)

Both record their metrics into Ray's metrics pipeline (``app.engine.metrics``); the ingress's
``/metrics`` reads them back from Ray's metrics agents (``app.server.metrics_export``).

``args`` carry the model, scheduler and KV settings only. Replica counts, ``autoscaling_config``,
``max_ongoing_requests`` and ``ray_actor_options`` go in the YAML's standard ``deployments:``
section, which Serve applies over the defaults set here (``app.config.INGRESS_DEFAULTS`` and
``SCHEDULER_DEFAULTS``, with ``graceful_shutdown_timeout_s`` sized by ``app.config_drain``) as a
lightweight update. Each Scheduler replica reserves its whole model
copy with ``placement_group_bundles`` (bundle 0 for the replica, one per pipeline stage with its
TP ranks' GPUs), so when Serve's autoscaler adds a replica, the KubeRay autoscaler behind it sees
what one more model copy needs.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from app.config import AppArgs
from app.engine.replica import SchedulerReplica
from app.server.ingress_deployment import Ingress
from app.server.routing import ROUTER_CLASS

APP_NAME = "fastserve"


def build_app(args: AppArgs) -> Application:
    """Serve calls this with the YAML's ``args`` validated as ``AppArgs`` (via the annotation)."""
    if not isinstance(args, AppArgs):   # called directly with a dict (tests, scripts)
        args = AppArgs.model_validate(args)
    raw = args.replica_args()
    # The router sends each ingress replica's delivery channel to the replica it asked for.
    scheduler = serve.deployment(name="Scheduler", **args.scheduler_deployment_defaults(),
                                 request_router_config={"request_router_class": ROUTER_CLASS})(
        SchedulerReplica).bind(raw)
    return serve.deployment(name="Ingress", **args.ingress_deployment_defaults())(Ingress).bind(scheduler, raw)
