"""The Engine deployment's request router: Serve's power of two choices, except that a call with a
``pinned_replica`` keyword (a delivery channel's ``subscribe``) goes to that replica or waits for it
(the caller bounds the wait). The private import: Serve does not export its default router.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

#: Pins a call to the replica with this ``ReplicaID.unique_id``.
PIN_KWARG = "pinned_replica"


class PinnedReplicaRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = None if pending_request is None else pending_request.kwargs.get(PIN_KWARG)
        if target is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        return [[replica for replica in candidate_replicas if replica.replica_id.unique_id == target]]


#: ``serve.deployment(request_router_config=...)``'s value for the Engine deployment.
ROUTER_CLASS = f"{__name__}:{PinnedReplicaRouter.__name__}"
