"""How long a replica being replaced may drain: Serve's ``graceful_shutdown_timeout_s``, sized so a
whole stream fits (docs/operations.md)::

    timeout = max(min_s, min(server.request_timeout_s, ceil(slack × max_tokens × tpot_s)))
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from fastserve.config_model import resolve_path
from fastserve.scheduler.profile import Profile

DEFAULT_SLACK = 1.5


class DrainArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: None: the model's context length.
    max_tokens: int | None = Field(default=None, ge=1)
    #: None: the profile's decode step at ``scheduler.max_batch_size``.
    tpot_s: float | None = Field(default=None, gt=0)
    #: For what a step time leaves out: other jobs' prefills, MLFQ waits, swaps.
    slack: float = Field(default=DEFAULT_SLACK, ge=1.0)
    min_s: float = Field(default=5.0, gt=0)

    def timeout_s(self, max_tokens: int, tpot_s: float, request_timeout_s: float) -> float:
        """The module's formula, in whole seconds."""
        sized = float(math.ceil(self.slack * max_tokens * tpot_s))
        return max(self.min_s, min(request_timeout_s, sized))


def profile_tpot_s(profile_path: str, max_batch_size: int) -> float:
    """The profile's decode step at ``max_batch_size``: ``drain.tpot_s``'s default."""
    path = resolve_path(profile_path)
    if not path.is_file():
        raise ValueError(f"drain.tpot_s is unset and the profile {profile_path} it defaults from "
                         "is not on disk: set drain.tpot_s (seconds per output token)")
    return Profile.load(path).t_dec(max_batch_size)
