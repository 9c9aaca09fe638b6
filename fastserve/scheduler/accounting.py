"""Service accounting: what each entry of a step is charged toward its level's quantum (paper §4.1).

The quantum MLFQ enforces is a job's own work, in the profile's units, so that "how many
tokens a level gives" is a property of the level, not of how full the batch was or how slow the
machine ran that step:

* a decode is charged one decode iteration, ``q1`` (the profile's smallest ``t_dec``, which is
  also the first quantum) — whatever the batch size, so a job in level i gets ~2^(i−1) tokens
  whether it decodes alone or in a full batch, even on a CPU whose ``t_dec`` grows with the batch;
* a first iteration (or a recompute, or one prefill chunk) is charged ``t_init`` of the tokens it
  feeds, the very quantity skip-join placed it by.

Nothing is split among the batch's jobs, and nothing is charged for another job's prefill or
for time spent waiting on swaps. ENST (``fastserve.kv.enst``) turns this service back into wall time
with the measured step time, dividing by the batch size once.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastserve.scheduler.profile import Profile
from fastserve.worker.messages import BatchEntry


def service_charges(entries: Sequence[BatchEntry], profile: Profile) -> dict[str, float]:
    """Seconds of service (profile units) each entry's job attained in one step."""
    return {e.job_id: profile.t_init(len(e.token_ids)) if e.is_prefill else profile.q1
            for e in entries}
