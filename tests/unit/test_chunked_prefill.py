"""Chunked prefill (``scheduler.chunked_prefill``): a long first iteration runs as several chunks.

* the model: a chunk at ``start_pos > 0`` attends to its earlier chunks' cached KV, so chunked
  logits equal one unchunked prefill's, also mixed with decodes and fresh prefills, and a job
  swapped out part-way through its prompt resumes to the same tokens;
* the engine: greedy tokens with chunking equal those without, for every policy, under swap
  pressure, and a chunk short of the last emits no token and sets no TTFT;
* the scheduler: chunks are charged as service in the level the whole prompt chose;
* the config: bad values are named; the simulator replays a workload in chunks.

Models are tiny and random (dummy weights; nothing is downloaded).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from fastserve.bench import workloads as W
from fastserve.bench.sim import PAPER_PROFILES, CostModel, SimOptions, SimSetup, simulate
from fastserve.bench.sim.driver import CostModelExecutor, constant_tokens, drive
from fastserve.config import AppArgs
from fastserve.engine.async_engine import AsyncEngine, ThreadedExecutor
from fastserve.scheduler.config import (
    SWAP_MODES,
    ChunkedPrefillConfig,
    KVCacheConfig,
    PolicyName,
    SchedulerConfig,
    SwapMode,
)
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, StepOutput, SwapCommand
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec
from tests.harness.app_config import demo_args, error_of
from tests.harness.engine_driver import CoreDriver

TINY = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=256, name="tiny")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 4
PROMPT = tuple([2] + [5 + (7 * i) % 100 for i in range(40)])   # 41 tokens
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 64], "seconds": [0.01, 0.1]},
    "t_dec": {"batch_sizes": [1, 4], "seconds": [0.01, 0.015]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.001},
})


def _executor(device: int = 64, host: int = 64) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY, num_device_blocks=device, num_host_blocks=host,
                                       block_size=BLOCK, seed=3))


def _logits(ex: InProcessExecutor, plan: BatchPlan) -> torch.Tensor:
    runner = ex.runner
    batch = runner.build_batch(plan)
    with torch.inference_mode():
        return runner.model.logits(runner.forward(batch, None, {}))


# ---- the kernel ----------------------------------------------------------------------------

def _naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention over one whole sequence [T, H, D], in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def test_context_prefill_attention_equals_attention_over_the_whole_sequence() -> None:
    """Two sequences in one call: a chunk at position 13 over a cached prefix whose blocks are
    scattered (the prefix's last block holds a stale NaN past it), and a fresh prefill."""
    from fastserve import kernels

    gen = torch.Generator().manual_seed(5)
    heads, dim, block, scale = 2, 8, 4, 8**-0.5
    cache = torch.randn(12, 2, block, heads, dim, generator=gen)
    cache[4, :, 2] = float("nan")   # position 14: a stale slot in the prefix's last block
    full = [torch.randn(20, heads, dim, generator=gen) for _ in range(3)]   # q, k, v of seq 0
    table = torch.tensor([[7, 2, 11, 4, 9], [5, 0, 0, 0, 0]], dtype=torch.int32)
    for pos in range(13):                       # the prefix its earlier chunks cached
        blk, off = int(table[0, pos // block]), pos % block
        cache[blk, 0, off], cache[blk, 1, off] = full[1][pos], full[2][pos]
    fresh = [torch.randn(3, heads, dim, generator=gen) for _ in range(3)]
    q = torch.cat([full[0][13:], fresh[0]])
    k = torch.cat([full[1][13:], fresh[1]])
    v = torch.cat([full[2][13:], fresh[2]])
    out = kernels.context_prefill_attention(q, k, v, cache[:, 0], cache[:, 1],
                                            torch.tensor([0, 7, 10]), (13, 0), table, scale)
    torch.testing.assert_close(out[:7].double(), _naive_causal(*full, scale)[13:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[7:].double(), _naive_causal(*fresh, scale), rtol=1e-5, atol=1e-5)


# ---- the model -----------------------------------------------------------------------------

def test_chunked_prefill_logits_equal_one_prefill_also_mixed_with_other_work() -> None:
    ex = _executor()
    whole = _logits(ex, BatchPlan(0, (BatchEntry("u", PROMPT, 0, tuple(range(11)), True, GREEDY),)))
    table = tuple(range(20, 31))      # another copy of the prompt, fed in chunks of 16, 16, 9
    other = BatchEntry("o", (2, 9, 8, 7, 6), 0, (40, 41), True, GREEDY)
    rows = []
    out = _logits(ex, BatchPlan(1, (BatchEntry("c", PROMPT[:16], 0, table, True, GREEDY, 0, False),
                                    other)))
    rows.append(out[:16])
    # Second chunk beside a decode of "o" and a fresh prefill; prefills come first in the batch.
    decode = BatchEntry("o", (11,), 5, (40, 41), False, GREEDY, 1)
    fresh = BatchEntry("f", (2, 3, 4), 0, (50,), True, GREEDY)
    out = _logits(ex, BatchPlan(2, (decode, BatchEntry("c", PROMPT[16:32], 16, table, True,
                                                      GREEDY, 0, False), fresh)))
    rows.append(out[:16])
    out = _logits(ex, BatchPlan(3, (BatchEntry("c", PROMPT[32:], 32, table, True, GREEDY),)))
    rows.append(out)
    torch.testing.assert_close(torch.cat(rows), whole, rtol=1e-4, atol=1e-4)


def test_a_chunk_short_of_the_last_returns_no_token() -> None:
    ex = _executor()
    out = ex.execute(BatchPlan(0, (BatchEntry("c", PROMPT[:16], 0, tuple(range(11)), True,
                                              GREEDY, 0, False),
                                   BatchEntry("d", (2, 3), 0, (20,), True, GREEDY))))
    assert set(out.tokens) == {"d"}


def _greedy_by_hand(ex: InProcessExecutor, plans: list[BatchPlan], table: tuple[int, ...],
                    start_step: int) -> list[int]:
    """Run ``plans`` (the prompt's chunks and any swaps), then decode greedily."""
    tokens: list[int] = []
    for plan in plans:
        out = ex.execute(plan)
        tokens += [t for j, t in out.tokens.items() if j == "a"]
    step = start_step
    while len(tokens) < GREEDY.max_tokens:
        entry = BatchEntry("a", (tokens[-1],), len(PROMPT) + len(tokens) - 1, table, False,
                           GREEDY, len(tokens))
        tokens.append(ex.execute(BatchPlan(step, (entry,))).tokens["a"])
        step += 1
    return tokens


def test_job_swapped_out_part_way_through_its_prompt_resumes_to_the_same_tokens() -> None:
    need = -(-(len(PROMPT) + GREEDY.max_tokens) // BLOCK)
    first = tuple(range(need))
    expected = _greedy_by_hand(_executor(), [BatchPlan(0, (BatchEntry("a", PROMPT, 0, first, True,
                                                                       GREEDY),))], first, 1)
    ex = _executor()
    moved = tuple(range(30, 30 + need))
    host = tuple(range(need))
    plans = [
        BatchPlan(0, (BatchEntry("a", PROMPT[:12], 0, first, True, GREEDY, 0, False),)),
        # Out to the host after its first chunk; another job then overwrites its device blocks.
        BatchPlan(1, (), swap_out=(SwapCommand("out", "a", first, host),)),
        BatchPlan(2, (BatchEntry("b", tuple(range(3, 3 + 4 * need)), 0, first, True, GREEDY),)),
        # Back into other blocks; the second chunk runs in the very plan that swaps it in.
        BatchPlan(3, (BatchEntry("a", PROMPT[12:30], 12, moved, True, GREEDY, 0, False),),
                  swap_in=(SwapCommand("in", "a", host, moved),)),
        BatchPlan(4, (BatchEntry("a", PROMPT[30:], 30, moved, True, GREEDY),)),
    ]
    assert _greedy_by_hand(ex, plans, moved, 5) == expected


# ---- the engine ----------------------------------------------------------------------------

#: (job, prompt tokens, output tokens): most prompts are longer than a chunk.
JOBS = (("a", 41, 10), ("b", 6, 14), ("c", 23, 8), ("d", 3, 12), ("e", 30, 6), ("f", 17, 9))


class WatchingExecutor:
    """The real executor, counting the swaps of jobs part-way through their prompt."""

    def __init__(self, real: InProcessExecutor) -> None:
        self.real = real
        self.mid: set[str] = set()
        self.mid_prefill_swaps = 0
        self.chunks = 0

    def execute(self, plan: BatchPlan) -> StepOutput:
        moved = {c.job_id for c in (*plan.swap_out, *plan.swap_in)}
        self.mid_prefill_swaps += len(moved & self.mid)
        for e in plan.entries:
            if e.is_prefill and not e.samples:
                self.mid.add(e.job_id)
                self.chunks += 1
            else:
                self.mid.discard(e.job_id)
        return self.real.execute(plan)


async def _serve(policy: PolicyName, mode: SwapMode, chunk: int | None,
                 device_blocks: int) -> tuple[dict[str, list[int]], WatchingExecutor, Scheduler]:
    cfg = SchedulerConfig(policy=policy, max_batch_size=3, starvation_alpha_s=0.05,
                          max_num_batched_tokens=16 if chunk else 64,
                          chunked_prefill=ChunkedPrefillConfig(enabled=chunk is not None,
                                                               chunk_tokens=chunk or 1))
    kv = KVCacheConfig(block_size=BLOCK, num_device_blocks=device_blocks, num_host_blocks=64,
                       swap_mode=mode)
    scheduler = Scheduler(cfg, kv, PROFILE, frozenset({TINY.eos_token_id}))
    watch = WatchingExecutor(_executor(device_blocks))
    engine = AsyncEngine(scheduler, ThreadedExecutor(watch))
    tokens: dict[str, list[int]] = {}

    async def consume(stream: Any, job_id: str) -> None:
        async for delta in stream:
            if delta.token_id is not None:
                tokens.setdefault(job_id, []).append(delta.token_id)
            if delta.finished:
                assert delta.finish_reason == "length"

    await engine.start()
    try:
        streams = [(engine.add_request([2] + [5 + (3 * i + len(j)) % 100 for i in range(p - 1)],
                                       SamplingParams(max_tokens=o, temperature=0.0,
                                                      ignore_eos=True), job_id=j), j)
                   for j, p, o in JOBS]
        await asyncio.wait_for(asyncio.gather(*(consume(s, j) for s, j in streams)), timeout=300)
    finally:
        await engine.stop()
    scheduler.check_invariants()
    return tokens, watch, scheduler


@pytest.mark.parametrize("policy,mode", [("skip_join_mlfq", m) for m in SWAP_MODES]
                         + [("naive_mlfq", "proactive"), ("fcfs", "recompute"),
                            ("fixed_priority", "reactive"), ("srpt_oracle", "proactive")])
def test_greedy_tokens_are_the_same_with_and_without_chunks(policy: PolicyName,
                                                            mode: SwapMode) -> None:
    # 14 device blocks of 4 hold ~one long job: jobs are swapped (or dropped) while prefilling.
    plain, _, _ = asyncio.run(_serve(policy, mode, None, 14))
    chunked, watch, scheduler = asyncio.run(_serve(policy, mode, 8, 14))
    assert chunked == plain
    assert {j: len(t) for j, t in chunked.items()} == {j: o for j, _, o in JOBS}
    assert watch.chunks == scheduler.totals["prefill_chunks"] > 0
    stats = {st.job_id: st for st in scheduler.drain_finished()}
    assert all(st.first_token_time is not None for st in stats.values())


def _drive(chunk: int | None) -> tuple[dict[str, list[int]], WatchingExecutor]:
    """A long prompt starts alone; short jobs arriving mid-prompt outrank it (skip-join) and
    need its blocks, so it is swapped out part-way through its chunks and resumed later."""
    cfg = SchedulerConfig(max_batch_size=3, max_num_batched_tokens=16 if chunk else 64,
                          chunked_prefill=ChunkedPrefillConfig(enabled=chunk is not None,
                                                               chunk_tokens=chunk or 1))
    kv = KVCacheConfig(block_size=BLOCK, num_device_blocks=16, num_host_blocks=64)
    s = Scheduler(cfg, kv, PROFILE, frozenset({TINY.eos_token_id}))
    ex = WatchingExecutor(_executor(16))   # real tokens and KV; the cost model prices each plan
    arrivals = [(0.0, JobRequest("long", PROMPT, GREEDY))] + [
        (0.015 + 0.001 * i, JobRequest(f"s{i}", (2, 9 + i, 30 + i, 4), SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))) for i in range(3)]
    result = drive(s, ex, arrivals, cost=CostModel(PROFILE), observe=lambda sched, plan, now: sched.check_invariants())
    return result.tokens, ex


def test_long_prompt_swapped_out_between_chunks_keeps_its_tokens() -> None:
    plain, _ = _drive(None)
    chunked, ex = _drive(4)
    assert chunked == plain
    assert ex.mid_prefill_swaps > 0, "the long prompt was never swapped part-way through"


# ---- the scheduler -------------------------------------------------------------------------

def test_chunks_are_service_in_the_level_the_whole_prompt_chose() -> None:
    cfg = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=16,
                          chunked_prefill=ChunkedPrefillConfig(enabled=True, chunk_tokens=16))
    s = Scheduler(cfg, KVCacheConfig(block_size=4, num_device_blocks=64, num_host_blocks=64),
                  PROFILE, eos_token_ids=frozenset({1}))
    job = s.add(JobRequest("a", PROMPT, GREEDY), 0.0)
    assert job.level == s.policy.entry_level(job)      # skip-join from t_init(41), not of a chunk
    assert PROFILE.t_init(len(PROMPT)) <= s.policy.quanta()[job.level - 1]
    driver = CoreDriver(s, CostModelExecutor(PROFILE, constant_tokens(7)), step_s=None)
    deltas: list[TokenDelta] = []
    for chunk in (16, 16, 9):
        plan = driver.schedule()
        assert plan is not None and [len(e.token_ids) for e in plan.entries] == [chunk]
        deltas = driver.complete()
        if chunk != 9:
            assert deltas == [] and job.stats.first_token_time is None
            assert job.num_computed_tokens == plan.entries[0].context_len and job.prefilling
    assert [d.token_id for d in deltas] == [7] and job.stats.first_token_time == driver.now
    # Every prompt position has KV; the decode feeds the token just sampled.
    assert job.num_computed_tokens == len(PROMPT) and job.decoding
    # Three chunks' t_init are the job's service (in its entry level, or it moved down).
    charged = 2 * PROFILE.t_init(16) + PROFILE.t_init(9)
    assert job.attained_s == pytest.approx(charged) or job.stats.demotions > 0
    s.check_invariants()


def test_a_recompute_in_chunks_moves_one_count_and_ends_in_a_decode() -> None:
    """Recompute is a first iteration over prompt + generated: ``num_computed_tokens`` goes
    0 → 16 → 32 in chunks; a last chunk that stops one short of the end leaves exactly a decode
    (one token, which samples), whose position the table already covers."""
    cfg = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=16,
                          chunked_prefill=ChunkedPrefillConfig(enabled=True, chunk_tokens=16))
    s = Scheduler(cfg, KVCacheConfig(block_size=4, num_device_blocks=64, num_host_blocks=64),
                  PROFILE, eos_token_ids=frozenset({1}))
    job = s.add(JobRequest("a", PROMPT[:32], GREEDY), 0.0)
    driver = CoreDriver(s, CostModelExecutor(PROFILE, constant_tokens(7)), step_s=None)

    def step() -> BatchPlan:
        plan = driver.step()
        assert plan is not None and len(plan.entries) == 1
        return plan

    assert [len(step().entries[0].token_ids) for _ in range(2)] == [16, 16]
    assert job.generated == [7] and job.num_computed_tokens == 32 and job.decoding
    s.lose_all_kv([])        # the workers were rebuilt: it recomputes prompt + its token
    assert job.num_computed_tokens == 0 and job.stats.recomputes == 1 and not job.decoding
    for end in (16, 32):
        entry = step().entries[0]
        assert (entry.start_pos, entry.context_len, entry.is_prefill, entry.samples) == (
            end - 16, end, True, False)
        assert job.num_computed_tokens == end and job.generated == [7]
    assert job.decoding and s.kv.num_tokens("a") == 33   # taken with the first chunk
    entry = step().entries[0]
    assert (entry.token_ids, entry.start_pos, entry.is_prefill, entry.samples) == (
        (7,), 32, False, True)
    assert job.generated == [7, 7] and job.num_computed_tokens == 33 and job.decoding


# ---- the config ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw,named", [
    ({"enabled": True, "chunk_tokens": 0}, "chunk_tokens"),
    ({"enabled": True, "chunk_tokens": "many"}, "chunk_tokens"),
    ({"enabled": "perhaps"}, "enabled"),
    ({"enabled": True, "chunk_size": 64}, "chunk_size"),
])
def test_bad_chunked_prefill_values_are_named(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        SchedulerConfig.model_validate({"chunked_prefill": raw})


def test_chunk_larger_than_the_token_budget_is_refused() -> None:
    args = demo_args()
    args["scheduler"]["chunked_prefill"] = {"enabled": True, "chunk_tokens": 4096}
    msg = error_of(args)
    assert "chunk_tokens=4096" in msg and "max_num_batched_tokens=2048" in msg


def test_chunking_lets_the_token_budget_be_below_the_context() -> None:
    args = demo_args()
    args["scheduler"]["max_num_batched_tokens"] = 256
    assert "max_num_batched_tokens=256 is below the context length" in error_of(args)
    args["scheduler"]["chunked_prefill"] = {"enabled": True, "chunk_tokens": 64}
    parsed = AppArgs.model_validate(args)
    assert parsed.scheduler.chunk_limit() == 64
    assert SchedulerConfig().chunk_limit() is None


# ---- the simulator -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", SWAP_MODES)
def test_simulator_replays_sharegpt_in_chunks_under_memory_pressure(mode: SwapMode) -> None:
    """The paper-scale simulator with chunks of 256 tokens and a 200-block pool: every job
    finishes, the block invariants hold every step, and each emits exactly its output length
    (a chunk emits nothing)."""
    reqs = W.workload(W.load_sharegpt_lengths(), num_requests=40, rate=4.0, seed=2)
    res = simulate(reqs, PAPER_PROFILES["opt-13b"],
                   SimSetup(swap_mode=mode, num_device_blocks=200, num_host_blocks=1000,
                            chunk_tokens=256),
                   SimOptions(check_invariants=True))
    assert all(r.ok for r in res.records), mode
    assert res.totals["prefill_chunks"] > 0
    for req, rec in zip(res.requests, res.records, strict=True):
        assert len(rec.token_times) == req.output_len
