"""Service accounting: how much of a step each of its entries is charged (paper §4.1).

The quantum MLFQ enforces is a job's own service, so each entry of a plan is charged its own
share of the step, never the other entries' work: its profiled cost — ``t_init`` of its own
tokens for a first iteration (or recompute), an equal share of ``t_dec(#decodes)`` for a decode —
scaled so that the shares sum to the step's measured compute time. Time the forward waited for a
swap (``swap_wait``) or the plan waited for its swaps after the forward (``swap_tail``) is no
one's service. Skip-join placement (the first quantum covers the job's ``t_init``) and ENST's
division by the batch size both assume exactly this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from actors.messages import BatchEntry
from app.scheduler.profile import Profile


def compute_seconds(timings: Mapping[str, float], fallback_total: float) -> float:
    """The step's measured time minus what it spent waiting for swaps."""
    total = timings.get("total", fallback_total)
    waited = timings.get("swap_wait", 0.0) + timings.get("swap_tail", 0.0)
    return max(total - waited, 0.0)


def service_shares(entries: Sequence[BatchEntry], compute_s: float,
                   profile: Profile) -> dict[str, float]:
    """Seconds of service each entry's job attained in a step that computed ``compute_s``."""
    decodes = sum(1 for e in entries if not e.is_prefill)
    per_decode = profile.t_dec(decodes) / decodes if decodes else 0.0
    cost = {e.job_id: profile.t_init(len(e.token_ids)) if e.is_prefill else per_decode
            for e in entries}
    profiled = sum(cost.values())
    if profiled <= 0.0:
        return dict.fromkeys(cost, 0.0)
    scale = compute_s / profiled
    return {job_id: c * scale for job_id, c in cost.items()}
