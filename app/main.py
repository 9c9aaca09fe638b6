"""The Serve application builder: ``app.main:build_app`` (what ``config/*.yaml`` import).

Owns the application graph and the Serve options of each deployment, all derived from the
validated ``AppArgs``:

    Ingress (FastAPI, autoscaled, CPU)  ──stream──▶  Scheduler (× model copies, owns executor)
          │                                                   │ publishes snapshots
          └────────────── render ─────────▶  Metrics  ◀───────┘

Each Scheduler replica reserves its whole model copy with ``placement_group_bundles`` (bundle 0
for the replica, one per pipeline stage with its TP ranks' GPUs) so Serve's autoscaler, and the
KubeRay autoscaler behind it, see what one more copy needs. Deployment options belong in
``args`` (where they are validated), not in the YAML's ``deployments:`` overrides.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from app.config import AppArgs
from app.ingress import Ingress
from app.metrics import MetricsHub
from app.serving import SchedulerReplica

APP_NAME = "fastserve"


class Metrics:
    """Holds every Scheduler replica's latest snapshot; renders the sum for ``/metrics``."""

    def __init__(self, stale_after_s: float) -> None:
        self.hub = MetricsHub(stale_after_s)

    async def publish(self, snapshot: dict[str, Any]) -> None:
        self.hub.publish(snapshot)

    async def render(self) -> str:
        return self.hub.render()


def build_app(args: AppArgs) -> Application:
    """Serve calls this with the YAML's ``args`` validated as ``AppArgs`` (via the annotation)."""
    if not isinstance(args, AppArgs):   # called directly with a dict (tests, scripts)
        args = AppArgs.model_validate(args)
    raw = args.model_dump(mode="json")
    zero_cpu = {"num_cpus": 0}

    metrics = serve.deployment(
        name="Metrics", num_replicas=1, ray_actor_options=zero_cpu, max_ongoing_requests=1024,
        # Every scheduler replica publishes a few times a second: keep those out of the access log.
        logging_config={"enable_access_log": False},
    )(Metrics).bind(args.server.metrics_stale_after_s)

    dep = args.scheduler_deployment
    scheduler = serve.deployment(
        name="Scheduler",
        num_replicas=dep.num_replicas,
        max_ongoing_requests=dep.max_ongoing_requests,
        ray_actor_options=args.scheduler_actor_options(),
        placement_group_bundles=args.placement_group_bundles(),
        placement_group_strategy=dep.placement_group_strategy,
        # The model and its engine hold the replica; only requests in flight gate shutdown.
        graceful_shutdown_timeout_s=5,
    )(SchedulerReplica).bind(raw, metrics)

    ing = args.ingress
    ingress_options: dict[str, Any] = {
        "name": "Ingress",
        "max_ongoing_requests": ing.max_ongoing_requests,
        "ray_actor_options": ing.ray_actor_options,
    }
    if ing.autoscaling_config is not None:
        ingress_options["autoscaling_config"] = ing.autoscaling_config
    else:
        ingress_options["num_replicas"] = ing.num_replicas or 1
    return serve.deployment(**ingress_options)(Ingress).bind(scheduler, metrics, raw)
