"""The sampler's request features: penalties, min-p, min_tokens masking and logprobs, against
hand-computed references; and that a batch using none of them is left untouched."""

from __future__ import annotations

import math

import pytest
import torch

from fastserve.worker.messages import SamplingContext, SamplingParams
from fastserve.worker.sampler import Sampler, apply_penalties, filtered_probs

ROW = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
GREEDY = SamplingParams(temperature=0.0)


def test_presence_and_frequency_penalties_match_the_hand_computed_logits() -> None:
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(ROW, [p], [SamplingContext(output_ids=(0, 0, 3))])
    # token 0: twice -> 2.0 - 0.5 - 2 * 0.25 = 1.0; token 3: once -> -0.5 - 0.5 - 0.25 = -1.25
    assert out.tolist() == [[1.0, -1.0, 0.5, -1.25, 1.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_prompt_and_output_logits() -> None:
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(ROW, [p], [SamplingContext(output_ids=(0,), prompt_ids=(1, 1, 2))])
    # 0 (output): 2.0 / 2; 1 (prompt): -1.0 * 2; 2 (prompt): 0.5 / 2; 3, 4 untouched
    assert out.tolist() == [[1.0, -2.0, 0.25, -0.5, 1.0]]


def test_all_three_penalties_apply_in_vllms_order() -> None:
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    out = apply_penalties(ROW, [p], [SamplingContext(output_ids=(4, 4), prompt_ids=(3,))])
    # 4: 1.0 / 2 - 1.0 - 2 * 0.5 = -1.5; 3 (prompt only): -0.5 * 2 = -1.0
    assert out.tolist() == [[2.0, -1.0, 0.5, -1.0, -1.5]]


def test_penalised_greedy_row_takes_the_penalised_argmax_and_others_are_untouched() -> None:
    logits = ROW.repeat(2, 1)
    pen = SamplingParams(temperature=0.0, presence_penalty=2.0)
    ctx = [SamplingContext(output_ids=(0,)), None]
    assert Sampler().sample(logits, [pen, GREEDY], [1, 1], ctx) == [4, 0]
    assert logits.tolist() == ROW.repeat(2, 1).tolist()   # the caller's logits are not changed


def test_min_tokens_mask_holds_off_suppressed_ids() -> None:
    ctx = [SamplingContext(suppress_ids=(0, 4))]
    assert Sampler().sample(ROW, [GREEDY], [0], ctx) == [2]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability() -> None:
    probs = filtered_probs(ROW[0], SamplingParams(min_p=0.3))
    soft = torch.softmax(ROW[0], -1)   # 0.5x, 0.03x, 0.12x, 0.05x, 0.2x: keep >= 0.3 * top
    keep = [i for i in range(5) if soft[i] >= 0.3 * soft.max()]
    assert keep == [0, 4]
    assert (probs > 0).nonzero().flatten().tolist() == keep
    torch.testing.assert_close(probs[keep], soft[keep] / soft[keep].sum())


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3)])
def test_logprobs_are_the_raw_log_softmax_top_n_sorted_with_the_sampled_token(params: SamplingParams) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    asking = SamplingParams(**{**params.__dict__, "logprobs": 5})
    ctx = [SamplingContext(output_ids=(3, 7), prompt_ids=(1,)) if asking.uses_penalties else None] * 3
    tokens, lps = Sampler().sample_with_logprobs(logits, [asking, params, asking], [0, 0, 0],
                                                 ctx if asking.uses_penalties else None)
    assert sorted(lps) == [0, 2]   # only the rows that asked
    ref = torch.log_softmax(logits, -1)
    for row in (0, 2):
        lp = lps[row]
        token = tokens[row]
        assert token is not None
        assert math.isclose(lp.logprob, float(ref[row, token]), abs_tol=1e-4)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        expect = ref[row].topk(5)
        assert [t for t, _ in lp.top] == expect.indices.tolist()
        assert values == pytest.approx(expect.values.tolist(), abs=1e-4)
    if params.greedy:
        assert lps[0].top[0][0] == tokens[0]   # the sampled token leads the top-N


def test_logprobs_zero_gives_only_the_sampled_tokens() -> None:
    tokens, lps = Sampler().sample_with_logprobs(ROW, [SamplingParams(temperature=0.0, logprobs=0)], [0])
    assert tokens == [0] and lps[0].top == ()
    assert math.isclose(lps[0].logprob, float(torch.log_softmax(ROW, -1)[0, 0]), abs_tol=1e-6)


def test_context_naming_a_token_outside_the_vocabulary_fails_only_its_row() -> None:
    logits = ROW.repeat(2, 1)
    pen = SamplingParams(temperature=0.0, presence_penalty=1.5)
    ctx = [SamplingContext(output_ids=(99,)), SamplingContext(output_ids=(0,))]
    assert Sampler().sample(logits, [pen, pen], [0, 0], ctx) == [None, 4]


def test_a_batch_without_features_is_not_copied() -> None:
    logits = ROW.repeat(2, 1)
    sampler = Sampler()
    seen: list[torch.Tensor] = []
    real = sampler._adjusted
    sampler._adjusted = lambda *a: seen.append(real(*a)) or seen[-1]  # type: ignore[method-assign]
    sampler.sample(logits, [GREEDY, GREEDY], [0, 0], [None, None])
    assert seen[0] is logits


def test_logit_bias_steers_greedy_and_sampled_rows_and_leaves_logprobs_raw() -> None:
    # ROW's argmax is token 0 (2.0); +1.5 on token 4 makes it 2.5, the new argmax.
    steer = SamplingParams(temperature=0.0, logit_bias=((4, 1.5),), logprobs=0)
    tokens, lps = Sampler().sample_with_logprobs(ROW.repeat(2, 1), [steer, GREEDY], [0, 0])
    assert tokens == [4, 0]
    assert math.isclose(lps[0].logprob, float(torch.log_softmax(ROW, -1)[0, 4]), abs_tol=1e-6)
    # -100 on the argmax leaves token 4 (1.0) on top; +100 on token 1 makes a sampled row certain.
    banned = SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias=((1, 100.0),))
    for step in range(10):
        assert Sampler().sample(ROW.repeat(2, 1), [banned, forced], [step, step]) == [4, 1]


def test_logit_bias_naming_a_token_outside_the_vocabulary_fails_only_its_row() -> None:
    bad = SamplingParams(temperature=0.0, logit_bias=((99, 1.0),))
    assert Sampler().sample(ROW.repeat(2, 1), [bad, GREEDY], [0, 0]) == [None, 0]


def test_logit_bias_entries_are_checked() -> None:
    with pytest.raises(ValueError, match="logit_bias entry -1: 1.0 needs a token id >= 0 and a finite bias"):
        SamplingParams(logit_bias=((-1, 1.0),)).validate()
    with pytest.raises(ValueError, match="logit_bias entry 3: nan"):
        SamplingParams(logit_bias=((3, float("nan")),)).validate()


def test_allowed_token_ids_leave_only_those_tokens() -> None:
    # ROW = [2.0, -1.0, 0.5, -0.5, 1.0]: among tokens 1 and 3 the greedy pick is 3 (-0.5).
    only = SamplingParams(temperature=0.0, allowed_token_ids=(1, 3))
    biased = SamplingParams(temperature=0.0, allowed_token_ids=(1, 3), logit_bias=((1, 1.0),))
    assert Sampler().sample(ROW.repeat(3, 1), [only, biased, GREEDY], [0, 0, 0]) == [3, 1, 0]
    drawn = {Sampler(s).sample(ROW, [SamplingParams(temperature=2.0, allowed_token_ids=(1, 3))], [s])[0]
             for s in range(40)}
    assert drawn == {1, 3}
    outside = SamplingParams(temperature=0.0, allowed_token_ids=(1, 99))
    assert Sampler().sample(ROW.repeat(2, 1), [outside, GREEDY], [0, 0]) == [None, 0]
    with pytest.raises(ValueError, match=r"allowed_token_ids must be a non-empty list of token ids >= 0, got \[\]"):
        SamplingParams(allowed_token_ids=()).validate()


def test_bad_words_ban_a_words_last_token_when_the_tail_would_complete_it() -> None:
    p = SamplingParams(bad_words_ids=((5,), (7, 8), (1, 2, 3)))
    assert p.banned_words([]) == (5,)
    assert p.banned_words([4, 7]) == (5, 8)
    assert p.banned_words([1, 2]) == (5, 3)
    assert p.banned_words([2]) == (5,)
    ctx = SamplingParams(temperature=0.0, bad_words_ids=((0,), (2, 4))).context((9,), [2], frozenset())
    assert ctx == SamplingContext(suppress_ids=(0, 4))
    # ROW = [2.0, -1.0, 0.5, -0.5, 1.0]: with 0 and 4 banned the greedy pick is 2.
    assert Sampler().sample(ROW, [SamplingParams(temperature=0.0)], [0], [ctx]) == [2]
    with pytest.raises(ValueError, match="bad_words_ids must hold non-empty token id sequences"):
        SamplingParams(bad_words_ids=((),)).validate()
