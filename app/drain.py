"""How long a replica being replaced may drain: Serve's ``graceful_shutdown_timeout_s``, sized.

Owns ``DrainArgs`` (the ``drain:`` section of a YAML's ``args``) and the timeout it gives both
deployments. When Serve stops a replica (a redeploy, a downscale), it stops routing new requests
to it and waits while it has requests in flight, at most ``graceful_shutdown_timeout_s``; then
the replica's ``__del__`` runs (our scheduler aborts what is left: its clients get an error
event). A stream must therefore fit in that time to complete:

    timeout = max(min_s, ceil(slack × max_tokens × tpot_s))

The sizing is asked for by setting ``max_tokens`` or ``tpot_s``; the other then defaults to the
model's context length (the longest stream a request can ask for) or to the profile's decode
step at ``scheduler.max_batch_size`` (the measured time per output token of a full batch).
``slack`` covers what a step time does not (other jobs' prefills, MLFQ waits, swaps). With
neither set the drain is ``min_s``: sized by default it made every redeploy slow, because each
ingress replica's delivery channel is a request in flight on a Scheduler replica, so a
Scheduler replica replaced while its ingresses stay waits out the whole timeout even when idle
(measured in the redeploy tests: the replacement could not be placed for 242 s). The YAML's
``deployments:`` section still overrides the result per deployment.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.scheduler.profile import Profile

if TYPE_CHECKING:
    from app.config import AppArgs


#: Multiplier over max_tokens × tpot_s (other jobs' prefills, MLFQ waits, swaps).
DEFAULT_SLACK = 1.5


class DrainArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The longest stream a draining replica lets finish; None = the model's context length when
    #: ``tpot_s`` is set, else no sizing (``min_s``).
    max_tokens: int | None = Field(default=None, ge=1)
    #: Time per output token that stream sees; None = the profile's decode step at
    #: ``scheduler.max_batch_size`` when ``max_tokens`` is set, else no sizing.
    tpot_s: float | None = Field(default=None, gt=0)
    #: Multiplier over ``max_tokens × tpot_s`` for what the step time leaves out.
    slack: float = Field(default=DEFAULT_SLACK, ge=1.0)
    #: Never drain for less (Serve's own default is 20 s for an ingress, ours was 5 s).
    min_s: float = Field(default=5.0, gt=0)

    @property
    def sized(self) -> bool:
        return self.max_tokens is not None or self.tpot_s is not None

    @model_validator(mode="after")
    def _slack_needs_sizing(self) -> DrainArgs:
        # (Compared with the default, not "was it set": the builder hands replicas every field.)
        if not self.sized and self.slack != DEFAULT_SLACK:
            raise ValueError("drain.slack scales a sized drain: set drain.max_tokens or drain.tpot_s too")
        return self


def graceful_shutdown_timeout_s(args: AppArgs) -> float:
    """Serve's ``graceful_shutdown_timeout_s`` for ``args`` (whole seconds)."""
    d = args.drain
    if not d.sized:
        return d.min_s
    max_tokens = d.max_tokens if d.max_tokens is not None else args.model.context_len()
    tpot = d.tpot_s if d.tpot_s is not None else _profile_tpot(args)
    return max(d.min_s, float(math.ceil(d.slack * max_tokens * tpot)))


def _profile_tpot(args: AppArgs) -> float:
    from app.config import resolve_path

    path = resolve_path(args.profile.path)
    if not path.is_file():
        raise ValueError(f"drain.tpot_s is unset and the profile {args.profile.path} it defaults from "
                         "is not on disk: set drain.tpot_s (seconds per output token)")
    return Profile.load(path).t_dec(args.scheduler.max_batch_size)
