"""How long a replica being replaced may drain: Serve's ``graceful_shutdown_timeout_s``, sized.

Owns ``DrainArgs`` (the ``drain:`` section of a YAML's ``args``) and the timeout it gives both
deployments. When Serve stops a replica (a redeploy, a downscale), it stops routing new requests
to it and waits while it has requests in flight, at most ``graceful_shutdown_timeout_s``; then
the replica's ``__del__`` runs (our scheduler aborts what is left: its clients get an error
event). A stream must therefore fit in that time to complete:

    timeout = max(min_s, min(server.request_timeout_s, ceil(slack × max_tokens × tpot_s)))

``max_tokens`` defaults to the model's context length (the longest stream a request can ask
for) and ``tpot_s`` to the profile's decode step at ``scheduler.max_batch_size`` (the measured
time per output token of a full batch); ``slack`` covers what a step time does not (other jobs'
prefills, MLFQ waits, swaps). No request outlives ``server.request_timeout_s``, so no drain is
longer. A replica with nothing left in flight stops at once, whatever the timeout: its delivery
channels end once idle (``server.channel_idle_close_s``, ``fastserve.engine.delivery``), so a long timeout
costs only the streams it saves. The YAML's ``deployments:`` section still overrides the result
per deployment.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from fastserve.config_model import resolve_path
from fastserve.scheduler.profile import Profile

#: Multiplier over max_tokens × tpot_s (other jobs' prefills, MLFQ waits, swaps).
DEFAULT_SLACK = 1.5


class DrainArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The longest stream a draining replica lets finish; None = the model's context length.
    max_tokens: int | None = Field(default=None, ge=1)
    #: Time per output token that stream sees; None = the profile's decode step at
    #: ``scheduler.max_batch_size``.
    tpot_s: float | None = Field(default=None, gt=0)
    #: Multiplier over ``max_tokens × tpot_s`` for what the step time leaves out.
    slack: float = Field(default=DEFAULT_SLACK, ge=1.0)
    #: Never drain for less (Serve's own default is 20 s for an ingress).
    min_s: float = Field(default=5.0, gt=0)

    def timeout_s(self, max_tokens: int, tpot_s: float, request_timeout_s: float) -> float:
        """Serve's ``graceful_shutdown_timeout_s`` (whole seconds) for a stream of ``max_tokens``
        at ``tpot_s`` (this section's or their defaults, ``AppArgs.graceful_shutdown_timeout_s``),
        never past ``request_timeout_s``."""
        sized = float(math.ceil(self.slack * max_tokens * tpot_s))
        return max(self.min_s, min(request_timeout_s, sized))


def profile_tpot_s(profile_path: str, max_batch_size: int) -> float:
    """The profile's decode step at ``max_batch_size``: ``drain.tpot_s``'s default."""
    path = resolve_path(profile_path)
    if not path.is_file():
        raise ValueError(f"drain.tpot_s is unset and the profile {profile_path} it defaults from "
                         "is not on disk: set drain.tpot_s (seconds per output token)")
    return Profile.load(path).t_dec(max_batch_size)
