"""Workloads: FastServe's filter, shipped length sources, arrivals, trace replay, prompts."""

from __future__ import annotations

import numpy as np
import pytest

from fastserve.bench.workloads import (
    AZURE_CODE_CSV,
    AZURE_CONV_CSV,
    BOS_TOKEN_ID,
    FIG14_RATIOS,
    LengthPair,
    Request,
    build_requests,
    fastserve_keep,
    filter_pairs,
    fixed_length_pairs,
    gamma_arrivals,
    load_alpaca_lengths,
    load_azure_trace,
    load_sharegpt_lengths,
    mean_rate,
    poisson_arrivals,
    ratio_sweep_pairs,
    rescale_to_rate,
    sample_pairs,
    scale_lengths,
    split_by_ratio,
    synthesize_prompt_ids,
    synthesize_prompt_text,
    trace_requests,
    with_prompt_text,
    workload,
)
from fastserve.tokenizer import Tokenizer

# Counts published in the shared data notes for the shipped files.
SHAREGPT_ROWS = 17400
SHAREGPT_KEPT = 15887
SHAREGPT_HUMAN_GPT_KEPT = 10225
ALPACA_ROWS = 5000
AZURE_CONV_ROWS = 19366
AZURE_CODE_ROWS = 8819
AZURE_CODE_SPAN_S = 3435.948056

SEED = 0
NUM_ARRIVALS = 20_000


# ---- filter --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "output", "kept"),
    [
        (3, 3, False),  # both short: dropped
        (3, 4, True),  # only one short: FastServe's rule is AND
        (4, 3, True),
        (1, 1, False),
        (4, 4, True),
        (1024, 1024, True),  # total exactly 2048 is allowed
        (1024, 1025, False),
        (1025, 1, False),  # prompt over 1024
        (1000, 1049, False),
    ],
)
def test_fastserve_keep(prompt: int, output: int, kept: bool) -> None:
    assert fastserve_keep(prompt, output) is kept


def test_filter_pairs_keeps_order() -> None:
    pairs = [LengthPair(3, 3), LengthPair(10, 20), LengthPair(2000, 1), LengthPair(5, 1)]
    assert filter_pairs(pairs) == [LengthPair(10, 20), LengthPair(5, 1)]


# ---- shipped length sources ----------------------------------------------------------------------


def test_sharegpt_lengths_include_bos_and_match_published_counts() -> None:
    raw = load_sharegpt_lengths(apply_filter=False)
    assert len(raw) == SHAREGPT_ROWS
    assert raw[0] == LengthPair(34 + 1, 259 + 1)  # first CSV row, QWJhYvA_0
    kept = load_sharegpt_lengths()
    assert len(kept) == SHAREGPT_KEPT
    assert all(fastserve_keep(p.prompt_len, p.output_len) for p in kept)
    # Published means exclude BOS: prompt 230.1, output 219.2.
    assert np.mean([p.prompt_len for p in kept]) - 1 == pytest.approx(230.1, abs=0.05)
    assert np.mean([p.output_len for p in kept]) - 1 == pytest.approx(219.2, abs=0.05)
    assert len(load_sharegpt_lengths(human_gpt_only=True)) == SHAREGPT_HUMAN_GPT_KEPT


def test_alpaca_lengths() -> None:
    pairs = load_alpaca_lengths()
    assert len(pairs) == ALPACA_ROWS  # no Alpaca pair trips the filter
    assert np.mean([p.output_len for p in pairs]) - 1 == pytest.approx(58.55, abs=0.01)


# ---- synthetic lengths ---------------------------------------------------------------------------


def test_fixed_length_pairs() -> None:
    assert fixed_length_pairs(3, 128, 64) == [LengthPair(128, 64)] * 3
    with pytest.raises(ValueError):
        fixed_length_pairs(3, 0, 64)


@pytest.mark.parametrize(
    ("ratio", "total", "expected"),
    [
        (1.0, 100, LengthPair(50, 50)),
        (0.25, 100, LengthPair(20, 80)),
        (4.0, 100, LengthPair(80, 20)),
        (256.0, 257, LengthPair(256, 1)),
        (1000.0, 10, LengthPair(9, 1)),  # both sides keep at least one token
        (0.001, 10, LengthPair(1, 9)),
    ],
)
def test_split_by_ratio(ratio: float, total: int, expected: LengthPair) -> None:
    assert split_by_ratio(ratio, total) == expected


def test_ratio_sweep_pairs() -> None:
    assert FIG14_RATIOS[0] == 0.25 and FIG14_RATIOS[-1] == 256.0 and len(FIG14_RATIOS) == 11
    assert ratio_sweep_pairs(3.0, 400, n=2) == [LengthPair(300, 100)] * 2
    per_job = ratio_sweep_pairs(1.0, [10, 20, 41])
    assert per_job == [LengthPair(5, 5), LengthPair(10, 10), LengthPair(20, 21)]
    assert all(p.prompt_len + p.output_len == t for p, t in zip(per_job, [10, 20, 41], strict=True))
    with pytest.raises(ValueError):
        ratio_sweep_pairs(1.0, 100)


def test_sample_pairs_deterministic() -> None:
    pairs = [LengthPair(i + 1, i + 2) for i in range(50)]
    a = sample_pairs(pairs, 20, seed=SEED)
    assert a == sample_pairs(pairs, 20, seed=SEED)
    assert a != sample_pairs(pairs, 20, seed=SEED + 1)
    assert len(set(a)) == 20  # without replacement when the source is big enough
    assert len(sample_pairs(pairs, 120, seed=SEED)) == 120


# ---- arrivals ------------------------------------------------------------------------------------


def test_poisson_arrivals_deterministic_and_rate() -> None:
    rate = 4.0
    a = poisson_arrivals(NUM_ARRIVALS, rate, seed=SEED)
    assert np.array_equal(a, poisson_arrivals(NUM_ARRIVALS, rate, seed=SEED))
    assert not np.array_equal(a, poisson_arrivals(NUM_ARRIVALS, rate, seed=SEED + 1))
    assert a[0] == 0.0
    assert np.all(np.diff(a) >= 0)
    # Fixed seed, so this cannot flake; the expected error is ~0.7 % at this n.
    assert mean_rate(a) == pytest.approx(rate, rel=0.05)
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_arrivals_cv() -> None:
    rate, cv = 2.0, 3.0
    a = gamma_arrivals(NUM_ARRIVALS, rate, cv, seed=SEED)
    assert mean_rate(a) == pytest.approx(rate, rel=0.1)
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.2)


def test_arrival_edge_cases() -> None:
    assert gamma_arrivals(0, 1.0, 1.0, SEED).size == 0
    assert np.array_equal(poisson_arrivals(3, float("inf"), SEED), np.zeros(3))
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, SEED)


def test_workload_common_random_numbers_across_rates() -> None:
    pairs = load_alpaca_lengths()
    slow = workload(pairs, 200, rate=1.0, seed=SEED)
    fast = workload(pairs, 200, rate=4.0, seed=SEED)
    assert slow == workload(pairs, 200, rate=1.0, seed=SEED)
    # Same jobs in the same order; arrivals scale by the rate ratio.
    assert [(r.prompt_len, r.output_len) for r in slow] == [
        (r.prompt_len, r.output_len) for r in fast
    ]
    np.testing.assert_allclose(
        [r.arrival_s for r in fast], [r.arrival_s / 4.0 for r in slow], rtol=1e-12
    )
    assert [r.request_id for r in slow[:3]] == ["req-0", "req-1", "req-2"]
    bursty = workload(pairs, 200, rate=1.0, seed=SEED, cv=4.0)
    assert [r.arrival_s for r in bursty] != [r.arrival_s for r in slow]


def test_build_requests_sorts_by_arrival() -> None:
    pairs = [LengthPair(1, 1), LengthPair(2, 2), LengthPair(3, 3)]
    reqs = build_requests(pairs, [2.0, 0.0, 1.0])
    assert [r.prompt_len for r in reqs] == [2, 3, 1]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError):
        build_requests(pairs, [0.0])


# ---- trace replay --------------------------------------------------------------------------------


def test_azure_trace_replay_ordering() -> None:
    conv = load_azure_trace(AZURE_CONV_CSV)
    assert len(conv) == AZURE_CONV_ROWS
    assert conv[0].arrival_s == 0.0
    assert conv[1].arrival_s == pytest.approx(4.314579, abs=1e-9)  # 18:15:50.9951690 - 46.6805900
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(conv, conv[1:], strict=False))
    code = load_azure_trace(AZURE_CODE_CSV)
    assert len(code) == AZURE_CODE_ROWS
    assert code[-1].arrival_s == pytest.approx(AZURE_CODE_SPAN_S, abs=1e-6)


def test_azure_trace_window_and_limit() -> None:
    window = load_azure_trace(AZURE_CONV_CSV, start_s=100.0, duration_s=60.0)
    assert window[0].arrival_s == 0.0
    assert window[-1].arrival_s < 60.0
    assert len(load_azure_trace(AZURE_CONV_CSV, limit=5)) == 5


def test_trace_requests_clip_and_rescale() -> None:
    rows = load_azure_trace(AZURE_CONV_CSV, limit=300)
    reqs = trace_requests(rows, time_scale=0.5, max_prompt_len=512, max_total_len=1024)
    assert [r.arrival_s for r in reqs] == [row.arrival_s * 0.5 for row in rows]
    assert all(1 <= r.prompt_len <= 512 for r in reqs)
    assert all(r.output_len >= 1 and r.prompt_len + r.output_len <= 1024 for r in reqs)
    assert any(r.prompt_len == 512 for r in reqs)  # some contexts were clipped
    untouched = [(row, r) for row, r in zip(rows, reqs, strict=True) if row.context_tokens < 400]
    assert all(r.prompt_len == row.context_tokens for row, r in untouched)


def test_rescale_to_rate() -> None:
    reqs = build_requests([LengthPair(1, 1)] * 5, [0.0, 1.0, 2.0, 3.0, 4.0])
    faster = rescale_to_rate(reqs, 4.0)
    assert [r.arrival_s for r in faster] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert mean_rate([r.arrival_s for r in faster]) == 4.0


# ---- length scaling and prompt synthesis ---------------------------------------------------------


def test_scale_lengths() -> None:
    reqs = [Request("a", 0.0, 100, 40, "text"), Request("b", 1.0, 3, 1)]
    scaled = scale_lengths(reqs, 0.1)
    assert [(r.prompt_len, r.output_len) for r in scaled] == [(10, 4), (1, 1)]
    assert scaled[0].prompt_text is None
    assert scaled[0].arrival_s == 0.0 and scaled[0].request_id == "a"
    with pytest.raises(ValueError):
        scale_lengths(reqs, 0.0)


def test_synthesize_prompt_ids() -> None:
    ids = synthesize_prompt_ids(50, seed=SEED)
    assert len(ids) == 50
    assert ids[0] == BOS_TOKEN_ID
    assert all(4 <= i < 50260 for i in ids[1:])
    assert ids == synthesize_prompt_ids(50, seed=SEED)
    assert ids != synthesize_prompt_ids(50, seed=SEED + 1)
    assert len(synthesize_prompt_ids(7, seed=SEED, add_bos=False)) == 7
    assert synthesize_prompt_ids(1, seed=SEED) == [BOS_TOKEN_ID]


@pytest.mark.parametrize("prompt_len", [1, 2, 17, 300])
def test_synthesized_text_has_exact_token_count(prompt_len: int) -> None:
    text = synthesize_prompt_text(prompt_len, seed=SEED)
    assert len(Tokenizer.default().encode(text)) == prompt_len


def test_with_prompt_text() -> None:
    reqs = workload(load_sharegpt_lengths(), 20, rate=1.0, seed=SEED)
    texted = with_prompt_text(reqs, seed=SEED)
    assert texted == with_prompt_text(reqs, seed=SEED)
    tok = Tokenizer.default()
    for r in texted:
        assert r.prompt_text is not None
        assert len(tok.encode(r.prompt_text)) == r.prompt_len
    assert texted[0].to_dict()["prompt_len"] == reqs[0].prompt_len
