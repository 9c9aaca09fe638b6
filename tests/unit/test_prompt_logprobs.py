"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on a tiny random model, through the real
scheduler and in-process executor: every prompt token but the first is scored, chunk by chunk
and with a cached prefix alike, and each value is the model's own next-token distribution.

The reference is the model itself: for each prefix ``prompt[:p + 1]`` a one-token job's logits
(recorded at the LM head), ``log_softmax``-ed and read at ``prompt[p + 1]``. Both sides run the
same float32 model over the same positions, in other batch shapes (one prompt row at a time
against a whole prompt or chunk), so they agree to float32 rounding of a 2-layer, 32-wide model:
``TOL`` is 1e-4 nats, about 100 float32 ulps of logits of magnitude ~1.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastserve.scheduler.config import ChunkedPrefillConfig, KVCacheConfig, SchedulerConfig
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, TokenLogprobs
from fastserve.worker.sampler import prompt_token_logprobs
from tests.harness.engine_driver import CoreDriver
from tests.harness.fields import BLOCK, PROFILE, TINY, recording, tiny_executor

TOL = 1e-4
#: 13 tokens: three full blocks of 4 (cacheable) and one more.
PROMPT = (2, 11, 23, 35, 47, 5, 90, 17, 64, 33, 8, 100, 41)
TOP = 3


def reference(prompt: tuple[int, ...]) -> list[torch.Tensor]:
    """Row ``p``: the model's log-probabilities after ``prompt[:p + 1]`` (one job per prefix)."""
    ex = tiny_executor()
    seen = recording(ex)
    rows = []
    for p in range(len(prompt) - 1):
        run(ex, {f"ref{p}": SamplingParams(max_tokens=1, temperature=0.0)}, prompt[:p + 1])
        rows.append(torch.log_softmax(seen[-1][0].float(), dim=-1))
    return rows


def run(ex: InProcessExecutor, jobs: dict[str, SamplingParams], prompt: tuple[int, ...],
        chunk: int | None = None, sequential: bool = False) -> dict[str, list[TokenDelta]]:
    """The jobs to their finish on one scheduler (``sequential``: each after the one before
    finished, so a later one may find the earlier one's blocks cached)."""
    config = SchedulerConfig(chunked_prefill=ChunkedPrefillConfig(enabled=chunk is not None, chunk_tokens=chunk or 1))
    s = Scheduler(config, KVCacheConfig(block_size=BLOCK, num_device_blocks=64, num_host_blocks=16), PROFILE,
                  frozenset({TINY.eos_token_id}))
    driver = CoreDriver(s, ex)
    for job_id, sampling in jobs.items():
        driver.add(JobRequest(job_id, prompt, sampling))
        if sequential:
            driver.run()
    driver.run()
    return {j: driver.deltas[j] for j in jobs}


def check(values: tuple[TokenLogprobs, ...], ref: list[torch.Tensor], prompt: tuple[int, ...], top: int) -> None:
    assert len(values) == len(prompt) - 1
    for p, (lp, row) in enumerate(zip(values, ref, strict=True)):
        target = prompt[p + 1]
        assert abs(lp.logprob - float(row[target])) <= TOL, (p, lp.logprob, float(row[target]))
        assert lp.rank == 1 + int((row > row[target]).sum())
        best = row.topk(top)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=TOL)


@pytest.fixture(scope="module")
def ref() -> list[torch.Tensor]:
    return reference(PROMPT)


def asked(top: int = TOP, **more: object) -> SamplingParams:
    return SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=top, **more)  # type: ignore[arg-type]


def test_every_prompt_token_after_the_first_is_scored_with_its_rank_and_top(ref: list[torch.Tensor]) -> None:
    (first, *rest) = run(tiny_executor(), {"a": asked()}, PROMPT)["a"]
    assert first.prompt_logprobs is not None
    check(first.prompt_logprobs, ref, PROMPT, TOP)
    # Only the first token's delta carries them; the tokens are the same as without asking.
    assert all(d.prompt_logprobs is None for d in rest)
    plain = run(tiny_executor(), {"b": SamplingParams(max_tokens=2, temperature=0.0)}, PROMPT)["b"]
    assert [t for d in plain for t in d.token_ids] == [t for d in (first, *rest) for t in d.token_ids]
    assert all(d.prompt_logprobs is None for d in plain)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_scores_every_chunk_s_rows(ref: list[torch.Tensor], chunk: int) -> None:
    first = run(tiny_executor(), {"a": asked()}, PROMPT, chunk=chunk)["a"][0]
    assert first.prompt_logprobs is not None
    check(first.prompt_logprobs, ref, PROMPT, TOP)


def test_a_cached_prefix_is_computed_again_for_a_job_that_asks(ref: list[torch.Tensor]) -> None:
    """The second and third jobs find the first's three full blocks cached: the plain one reads
    them, the asking one runs its whole prompt (and is scored over all of it)."""
    out = run(tiny_executor(), {"warm": SamplingParams(max_tokens=2, temperature=0.0),
                                "plain": SamplingParams(max_tokens=2, temperature=0.0),
                                "asks": asked(0)}, PROMPT, sequential=True)
    finish = {j: ds[-1].finish for j, ds in out.items()}
    assert all(f is not None and f.stats is not None for f in finish.values())
    assert finish["plain"].stats.cached_tokens == 3 * BLOCK   # type: ignore[union-attr]
    assert finish["asks"].stats.cached_tokens == 0   # type: ignore[union-attr]
    values = out["asks"][0].prompt_logprobs
    assert values is not None and all(lp.top == () for lp in values)
    check(values, ref, PROMPT, 0)


def test_a_one_token_prompt_has_nothing_to_score() -> None:
    first = run(tiny_executor(), {"a": asked()}, PROMPT[:1])["a"][0]
    assert first.prompt_logprobs == ()


def test_an_entry_with_targets_is_scored_by_the_stage_and_others_cost_nothing() -> None:
    """The data plane alone: one plan, a prompt-logprobs prefill beside a plain one; only the
    first comes back with rows, one per target."""
    ex = tiny_executor()
    sampling = asked(2)
    a = BatchEntry("a", PROMPT[:8], 0, (0, 1), True, sampling, prompt_targets=PROMPT[1:8])
    b = BatchEntry("b", PROMPT[:5], 0, (2, 3), True, SamplingParams(temperature=0.0))
    out = ex.execute(BatchPlan(0, (a, b)))
    assert set(out.prompt_logprobs) == {"a"}
    assert len(out.prompt_logprobs["a"]) == 7
    assert set(out.tokens) == {"a", "b"}


def test_prompt_token_logprobs_math() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 2.0], [3.0, -math.inf, 0.0, 1.0]])
    rows = prompt_token_logprobs(logits, [3, 1], 2)
    norm0 = math.log(1 + math.e + 2 * math.e ** 2)
    assert rows[0].logprob == pytest.approx(2.0 - norm0)
    assert rows[0].rank == 1   # a tie: no token strictly more likely
    assert rows[1].logprob == -math.inf and rows[1].rank == 4
    assert [t for t, _ in rows[1].top] == [0, 3]
