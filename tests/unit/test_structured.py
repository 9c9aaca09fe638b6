"""Structured outputs below the HTTP layer, without Ray or a model: the grammar engine
(``fastserve.structured``) on a small vocabulary (the 320-token llama3-style fixture), the
sampler's per-row grammar mask (``fastserve.worker.sampler.apply_token_masks``), and each job's
grammar state through the real scheduler while it is preempted, swapped, recomputed, chunked
and pipelined (``EngineCore`` driven by ``CoreDriver`` over a data plane of seeded random logits).

A job's logits here depend only on (job, step index), never on its batch or on what happened to
its KV, so a job's tokens must be the same however it was scheduled; its output must satisfy
its constraint and end with EOS (the grammar forces it once complete).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable

import jsonschema
import numpy as np
import pytest
import torch

from fastserve.engine.core import EngineCore, VirtualClock
from fastserve.errors import InvalidRequest
from fastserve.scheduler.config import SwapMode
from fastserve.scheduler.job import JobRequest
from fastserve.structured import GrammarCompiler, GrammarError, JobGrammars, TokenSpace, check_constraint
from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import BatchEntry, BatchPlan, OutputConstraint, SamplingParams, StepOutput
from fastserve.worker.sampler import Sampler, apply_token_masks
from tests.harness.engine_driver import CoreDriver
from tests.harness.scheduling import make
from tests.harness.tokenizers import LLAMA3_END_OF_TEXT, LLAMA3_EOT, LLAMA3_STYLE

TOK = Tokenizer.from_dir(LLAMA3_STYLE)
VOCAB = len(TOK)
EOS_IDS = frozenset({LLAMA3_END_OF_TEXT, LLAMA3_EOT})
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CHOICES = ("yes", "no", "maybe so")


def _json_valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


#: Each constraint, and what its complete outputs satisfy (all of them end: none can run on).
CASES: dict[str, tuple[OutputConstraint, Callable[[str], bool]]] = {
    "choice": (OutputConstraint.choice(CHOICES), lambda text: text in CHOICES),
    "regex": (OutputConstraint.regex(r"[0-9]{1,3}-[a-c]{2}"),
              lambda text: re.fullmatch(r"[0-9]{1,3}-[a-c]{2}", text) is not None),
    "json_schema": (OutputConstraint.json_schema(SCHEMA, any_whitespace=False), _json_valid),
    "lark": (OutputConstraint.grammar('start: "(" D ("," D)? ")"\nD: /[0-9]/'),
             lambda text: re.fullmatch(r"\([0-9](,[0-9])?\)", text) is not None),
    "gbnf": (OutputConstraint.grammar('root ::= "a" ("b" | "c") "d"?'),
             lambda text: re.fullmatch(r"a[bc]d?", text) is not None),
}


def compiler(cache_size: int = 8) -> GrammarCompiler:
    return GrammarCompiler(TokenSpace(TOK, VOCAB, EOS_IDS), cache_size)


def allowed(mask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return {int(t) for t in np.nonzero(bits)[0]}


def seeded_logits(job_id: str, step: int) -> torch.Tensor:
    """A job's logits at a step: the same whatever else happens (its batch, its KV's fate)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{job_id}:{step}".encode()))
    return 3.0 * torch.randn(VOCAB, generator=g)


class MaskedRandomModel:
    """A data plane: each sampling row's seeded logits, sampled by the real ``Sampler`` with the
    row's grammar mask. ``ignore_masks_of``: the (job, step index) rows whose masks it drops (a
    broken data plane)."""

    def __init__(self, ignore_masks_of: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.sampler = Sampler()
        self.ignore = ignore_masks_of
        self.masked_rows = 0

    def execute(self, plan: BatchPlan) -> StepOutput:
        entries = [e for e in plan.entries if e.samples]
        assert all(e.token_mask is None for e in plan.entries if not e.samples)
        if not entries:
            return StepOutput(plan.step_id, {}, {"total": 0.01})
        masks = [None if (e.job_id, e.step_index) in self.ignore else e.token_mask for e in entries]
        self.masked_rows += sum(m is not None for m in masks)
        logits = torch.stack([seeded_logits(e.job_id, e.step_index) for e in entries])
        tokens = self.sampler.sample(logits, [e.sampling for e in entries], [e.step_index for e in entries],
                                     None, masks)
        return StepOutput(plan.step_id, {e.job_id: t for e, t in zip(entries, tokens, strict=True) if t is not None},
                          {"total": 0.01})


def sampling(constraint: OutputConstraint | None, seed: int, max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=constraint)


# ---- the grammar engine ------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_rows_only_produce_allowed_tokens_and_complete_outputs(case: str) -> None:
    """Whatever the logits favour (here: every disallowed token boosted far above the rest),
    a masked row's token is one its grammar allows, and the walk ends in EOS with a valid output."""
    constraint, valid = CASES[case]
    grammars = JobGrammars(compiler())
    sampler = Sampler()
    for seed in range(12):
        job = f"{case}-{seed}"
        grammars.add(job, constraint)
        tokens: list[int] = []
        for step in range(40):
            mask = grammars.mask(job)
            ok = allowed(mask)
            logits = seeded_logits(job, step)
            logits[[t for t in range(VOCAB) if t not in ok]] += 50.0
            token = sampler.sample(logits[None], [sampling(constraint, seed)], [step], None, [mask])[0]
            assert token in ok
            if token in EOS_IDS:
                break
            tokens.append(token)
            grammars.advance(job, [token])
        else:
            raise AssertionError(f"{job}: no EOS after 40 tokens: {TOK.decode(tokens)!r}")
        assert valid(TOK.decode(tokens)), TOK.decode(tokens)
        grammars.drop(job)
    assert len(grammars) == 0


def test_a_complete_output_allows_only_eos_and_json_object_starts_with_a_brace() -> None:
    grammars = JobGrammars(compiler())
    grammars.add("c", OutputConstraint.choice(["yes", "no"]))
    first = allowed(grammars.mask("c"))
    assert {TOK.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"} and first
    grammars.advance("c", TOK.encode("yes", add_special_tokens=False))
    assert allowed(grammars.mask("c")) == EOS_IDS
    grammars.add("j", OutputConstraint.json_object(any_whitespace=False))
    assert {TOK.decode([t])[0] for t in allowed(grammars.mask("j"))} == {"{"}


@pytest.mark.parametrize("constraint,message", [
    (OutputConstraint.regex("[a-"), "the regex cannot be compiled: "),
    (OutputConstraint.grammar("start: foo"), 'the grammar cannot be compiled: at 1(8): unknown name: "foo"'),
    (OutputConstraint.json_schema({"type": "frob"}), "the json_schema cannot be compiled: Invalid type: frob"),
    (OutputConstraint.grammar("root ::= item"), "the grammar cannot be compiled: "),
])
def test_a_constraint_the_engine_cannot_compile_is_a_grammar_error_naming_it(constraint: OutputConstraint,
                                                                             message: str) -> None:
    with pytest.raises(GrammarError) as checked:
        check_constraint(constraint)
    assert str(checked.value).startswith(message)
    with pytest.raises(GrammarError) as compiled:
        JobGrammars(compiler()).add("j", constraint)
    assert str(compiled.value).startswith(message)


def test_each_distinct_constraint_compiles_once_and_the_cache_is_bounded() -> None:
    comp = compiler(cache_size=2)
    grammars = JobGrammars(comp)
    a, b, c = (OutputConstraint.regex(p) for p in ("a+", "b+", "c+"))
    for i, constraint in enumerate([a, a, b, a, c]):
        grammars.add(f"j{i}", constraint)
    assert comp.compiles == 3
    assert comp.cached(a) and comp.cached(c) and not comp.cached(b)   # b was the least recently used
    assert allowed(grammars.mask("j0")) == allowed(grammars.mask("j1"))   # copies, not one shared state
    grammars.advance("j0", TOK.encode("aaa", add_special_tokens=False))
    assert grammars.state("j1").consumed == 0


def test_a_plans_masks_computed_together_equal_each_computed_alone() -> None:
    together, alone = JobGrammars(compiler(), mask_threads=2), JobGrammars(compiler())
    entries = []
    for i, case in enumerate(sorted(CASES)):
        for grammars in (together, alone):
            grammars.add(case, CASES[case][0])
        entries.append(BatchEntry(case, (10,), 0, (0,), True, SamplingParams(), samples=i != 1))
    plan = together.with_masks(BatchPlan(0, tuple(entries)))
    masked = {e.job_id: e.token_mask for e in plan.entries}
    skipped = sorted(CASES)[1]
    assert masked == {case: None if case == skipped else alone.mask(case) for case in CASES}
    assert together.with_masks(BatchPlan(1, (BatchEntry("free", (10,), 0, (0,), True, SamplingParams()),))) \
        == BatchPlan(1, (BatchEntry("free", (10,), 0, (0,), True, SamplingParams()),))


def test_a_token_the_grammar_rejects_fails_the_matcher_and_empties_its_mask() -> None:
    grammars = JobGrammars(compiler())
    grammars.add("j", OutputConstraint.choice(["yes", "no"]))
    grammars.advance("j", TOK.encode("maybe", add_special_tokens=False)[:1])
    assert grammars.state("j").failed
    assert allowed(grammars.mask("j")) == set()


# ---- the sampler's mask ------------------------------------------------------------------------

def packed(tokens: set[int], vocab: int) -> bytes:
    bits = np.zeros(32 * ((vocab + 31) // 32), dtype=np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def test_the_sampler_masks_each_row_before_greedy_and_logprobs() -> None:
    vocab = 40
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1)
    logits[:, 5] = 100.0
    greedy_lp = SamplingParams(temperature=0.0, logprobs=2)
    masks = [packed({3, 7}, vocab), None, packed(set(), vocab)]
    tokens, lps = Sampler().sample_with_logprobs(logits, [greedy_lp] * 3, [0] * 3, None, masks)
    assert tokens == [7, 5, None]   # the best allowed token; an unmasked row; a row with nothing allowed
    expected = torch.log_softmax(torch.tensor([3.0, 7.0]), dim=-1)
    assert lps[0].logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in lps[0].top] == [7, 3]
    assert lps[0].top[1][1] == pytest.approx(float(expected[0]))
    assert lps[1].top[0][0] == 5 and 2 not in lps


def test_a_mask_shorter_than_the_logits_disallows_the_rest_and_a_longer_one_is_cut() -> None:
    logits = torch.zeros((3, 40))
    finite = [True, True, True]
    logits[0, 31] = logits[2, 1] = 1.0
    assert apply_token_masks(logits, [packed({1, 31}, 32), None, None], finite) == {0: 31}
    assert apply_token_masks(logits, [None, None, packed({1, 39, 50}, 64)], finite) == {2: 1}
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [[1, 31], list(range(40)), [1, 39]]
    assert apply_token_masks(logits, [None, None, None], finite) == {} and finite == [True, True, True]
    whole, both = torch.zeros((2, 40)), [True, True]
    assert apply_token_masks(whole, [packed({0}, 40), packed(set(), 40)], both)[0] == 0
    assert torch.isfinite(whole[0]).nonzero().flatten().tolist() == [0] and both == [True, False]


# ---- through the scheduler -----------------------------------------------------------------------

JOBS = [(f"job{i}", case, 6 + i % 4) for i, case in enumerate(sorted(CASES) * 2)]


def run_jobs(mode: SwapMode, device: int, batch: int = 16, chunk_tokens: int | None = None,
             inflight: int = 1, model: MaskedRandomModel | None = None) -> tuple[dict[str, list[int]], CoreDriver]:
    scheduler = make(batch=batch, device=device, host=256, mode=mode, eos=EOS_IDS, chunk_tokens=chunk_tokens)
    grammars = JobGrammars(compiler())
    driver = CoreDriver(scheduler, model or MaskedRandomModel(), grammars=grammars)
    for i, (job_id, case, prompt_len) in enumerate(JOBS):
        driver.add(JobRequest(job_id, tuple(range(10, 10 + prompt_len)), sampling(CASES[case][0], seed=i)))
    for _ in range(2000):
        while len(driver.inflight) < inflight and driver.schedule() is not None:
            pass
        if not driver.inflight:
            break
        driver.complete()
    assert not scheduler.has_work() and len(grammars) == 0
    return driver.tokens(), driver


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    tokens, driver = run_jobs("proactive", device=512)
    assert driver.scheduler.totals["swaps_out"] == 0 and driver.scheduler.totals["recomputes"] == 0
    for job_id, case, _ in JOBS:
        assert tokens[job_id][-1] in EOS_IDS, job_id
        assert CASES[case][1](TOK.decode(tokens[job_id][:-1])), (job_id, TOK.decode(tokens[job_id]))
    return tokens


@pytest.mark.parametrize("mode", ["proactive", "reactive", "recompute"])
def test_grammar_state_belongs_to_the_job_through_swaps_and_recompute(mode: SwapMode,
                                                                      alone: dict[str, list[int]]) -> None:
    tokens, driver = run_jobs(mode, device=14, batch=4)
    totals = driver.scheduler.totals
    assert (totals["recomputes"] if mode == "recompute" else totals["swaps_out"]) > 0
    assert tokens == alone


def test_grammar_state_through_chunked_prefill_and_two_plans_in_flight(alone: dict[str, list[int]]) -> None:
    tokens, driver = run_jobs("proactive", device=512, batch=2, chunk_tokens=4, inflight=2)
    assert driver.scheduler.totals["prefill_chunks"] > 0
    assert max(len({e.job_id for e in p.entries}) for p in driver.plans) == 2
    assert tokens == alone


def test_a_job_whose_mask_the_data_plane_drops_fails_alone(alone: dict[str, list[int]]) -> None:
    """job0's first row is sampled unmasked: its token off the grammar leaves its matcher failed,
    its next row has no allowed token, and the scheduler ends it with an error; the others are
    as ever."""
    tokens, driver = run_jobs("proactive", device=512, model=MaskedRandomModel(frozenset({("job0", 0)})))
    finish = driver.deltas["job0"][-1].finish
    assert finish is not None and finish.reason == "error"
    assert {k: v for k, v in tokens.items() if k != "job0"} == {k: v for k, v in alone.items() if k != "job0"}


def test_the_core_refuses_a_constraint_it_cannot_compile_or_hold() -> None:
    core = EngineCore(make(eos=EOS_IDS), VirtualClock(), grammars=JobGrammars(compiler()))
    with pytest.raises(InvalidRequest, match="the regex cannot be compiled"):
        core.add(JobRequest("bad", (10, 11), sampling(OutputConstraint.regex("(("), 0)))
    assert "bad" not in core.scheduler.jobs()
    core.add(JobRequest("a", (10, 11), sampling(OutputConstraint.regex("a+"), 0)))
    with pytest.raises(InvalidRequest, match="already queued"):
        core.add(JobRequest("a", (10, 11), sampling(OutputConstraint.regex("b+"), 0)))
    core.abort("a")
    assert core.grammars is not None and len(core.grammars) == 0
    bare = EngineCore(make(eos=EOS_IDS), VirtualClock())
    with pytest.raises(InvalidRequest, match="structured outputs are not available on this engine"):
        bare.add(JobRequest("b", (10, 11), sampling(OutputConstraint.regex("a+"), 0)))
