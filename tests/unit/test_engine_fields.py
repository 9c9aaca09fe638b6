"""Request fields through the real scheduler and in-process executor on a tiny random model:
``min_tokens`` holds off EOS, ``stop_token_ids`` stop with "stop", logprobs are the model's own
raw log-softmax, and per-choice seeds (``seed + index``) repeat and differ."""

from __future__ import annotations

import math

import torch

from fastserve.server.choices import choice_sampling
from fastserve.worker.messages import SamplingParams
from tests.harness.fields import TINY, boost, recording, run_jobs, tiny_executor

EOS = TINY.eos_token_id


def tokens(deltas: list) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_min_tokens_holds_off_eos_then_the_job_stops_at_eos() -> None:
    ex = tiny_executor()
    boost(ex, EOS)   # EOS is every row's argmax
    out = run_jobs(ex, {"free": SamplingParams(max_tokens=10, temperature=0.0),
                        "held": SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4)})
    assert tokens(out["free"]) == [EOS] and out["free"][-1].finish_reason == "stop"
    held = tokens(out["held"])
    assert len(held) == 5 and EOS not in held[:4] and held[4] == EOS
    assert out["held"][-1].finish_reason == "stop"


def test_min_tokens_also_holds_off_stop_token_ids() -> None:
    ex = tiny_executor()
    boost(ex, 77)
    out = run_jobs(ex, {"j": SamplingParams(max_tokens=10, temperature=0.0, min_tokens=2,
                                            stop_token_ids=(77,))})
    got = tokens(out["j"])
    assert len(got) == 3 and 77 not in got[:2] and got[2] == 77 and out["j"][-1].finish_reason == "stop"


def test_stop_token_ids_stop_with_stop() -> None:
    ex = tiny_executor()
    plain = tokens(run_jobs(ex, {"j": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)})["j"])
    stop_at = plain[3]
    first = plain.index(stop_at)
    out = run_jobs(tiny_executor(), {"j": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         stop_token_ids=(stop_at,))})["j"]
    assert tokens(out) == plain[:first + 1]
    assert out[-1].finish_reason == "stop"


def test_logprobs_equal_the_log_softmax_of_the_models_own_logits() -> None:
    ex = tiny_executor()
    seen = recording(ex)
    # Penalties and temperature change what is sampled, never the logprobs (raw model output).
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True,
                            repetition_penalty=1.5, frequency_penalty=0.5, logprobs=5)
    out = run_jobs(ex, {"j": params})["j"]
    lps = [lp for d in out for lp in d.logprobs]
    got = tokens(out)
    assert len(lps) == len(got) == 6 == len(seen)
    for logits, token, lp in zip(seen, got, lps, strict=True):
        ref = torch.log_softmax(logits[0].float(), -1)
        assert math.isclose(lp.logprob, float(ref[token]), abs_tol=1e-4)
        top = ref.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(math.isclose(v, float(r), abs_tol=1e-4) for (_, v), r in zip(lp.top, top.values, strict=True))


def test_jobs_that_do_not_ask_get_no_logprobs() -> None:
    out = run_jobs(tiny_executor(), {"j": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)})["j"]
    assert all(d.logprobs == () for d in out)


def test_choice_seeds_repeat_across_requests_and_differ_between_choices() -> None:
    base = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    choices = {f"c{i}": choice_sampling(base, i) for i in range(2)}
    assert [p.seed for p in choices.values()] == [1234, 1235]
    first = {j: tokens(d) for j, d in run_jobs(tiny_executor(), choices).items()}
    again = {j: tokens(d) for j, d in run_jobs(tiny_executor(), choices).items()}
    assert first == again
    assert first["c0"] != first["c1"]
