"""Service accounting (paper §4.1): what each entry of a step is charged toward its level's quantum.

A job's own work in profile units, whatever the batch: a decode costs ``q1``, a first iteration
(recompute, prefill chunk) ``t_init`` of the tokens it feeds. So a level gives the same tokens in
any batch; ENST (``fastserve.kv.enst``) turns service back into wall time.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.scheduler.profile import Profile
from fastserve.worker.messages import BatchEntry


def service_charges(entries: Sequence[BatchEntry], profile: Profile) -> dict[str, float]:
    """Seconds of service (profile units) each entry's job attained in one step."""
    return {e.job_id: profile.t_init(len(e.token_ids)) if e.is_prefill else profile.q1
            for e in entries}
