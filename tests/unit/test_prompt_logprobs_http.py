"""Prompt logprobs over HTTP, without Ray or a model: completions' ``echo`` (with and without
``logprobs``, and with ``max_tokens: 0``), vLLM's ``prompt_logprobs`` on both endpoints, token-id
prompts as evaluation harnesses send them, and the 400s that name a combination we refuse.

A scripted backend answers each job with fixed tokens; the first delta carries made-up prompt
logprobs (prompt token ``p + 1`` scored ``-(p + 1)``, rank ``p + 2``, its top alternative token 7
at ``-0.5``), so every value in a response says where it came from.
"""

from __future__ import annotations

from typing import Any

import pytest

from fastserve.scheduler.job import Finish, JobRequest, TokenDelta
from fastserve.worker.messages import TokenLogprobs
from tests.harness.http_backends import MODEL, STATS, TOK, ScriptedBackend, post, sse_events

PROMPT_IDS = TOK.encode(" The cat sat", add_special_tokens=False)
OUT = TOK.encode(" down", add_special_tokens=False) + TOK.encode(" now", add_special_tokens=False)
TOP_TOKEN = 7


def scripted(req: JobRequest) -> list[TokenDelta]:
    """Each generated token with logprob -0.25 (if asked); the prompt's made-up logprobs (if
    asked) on the first delta."""
    n = req.sampling.max_tokens
    tokens = OUT[:n]
    k = req.sampling.prompt_logprobs
    prompt = None if k is None else tuple(
        TokenLogprobs(-(p + 1.0), ((TOP_TOKEN, -0.5),)[:k], p + 2) for p in range(len(req.prompt_ids) - 1))
    asked = req.sampling.logprobs is not None
    deltas = []
    for i, t in enumerate(tokens):
        deltas.append(TokenDelta(req.job_id, (t,), Finish("length", STATS) if i == len(tokens) - 1 else None,
                                 (TokenLogprobs(-0.25, ((t, -0.25),)),) if asked else (),
                                 prompt_logprobs=prompt if i == 0 else None))
    return deltas


def completion(**body: Any) -> tuple[ScriptedBackend, Any]:
    backend = ScriptedBackend(scripted)
    resp = post(backend, "/v1/completions", {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2,
                                             "temperature": 0, **body})
    return backend, resp


def test_echo_with_logprobs_puts_the_prompt_first_with_a_null_first_logprob() -> None:
    backend, resp = completion(echo=True, logprobs=1)
    assert resp.status_code == 200, resp.text
    (req,) = backend.requests
    assert req.sampling.prompt_logprobs == 1 and req.sampling.logprobs == 1
    (choice,) = resp.json()["choices"]
    prompt_text = TOK.decode(PROMPT_IDS, skip_special_tokens=False)
    assert choice["text"] == prompt_text + TOK.decode(OUT)
    lp = choice["logprobs"]
    n = len(PROMPT_IDS)
    assert lp["tokens"] == [TOK.decode([t], skip_special_tokens=False) for t in PROMPT_IDS + OUT]
    assert lp["token_logprobs"] == [None, *(-(p + 1.0) for p in range(n - 1)), -0.25, -0.25]
    assert lp["top_logprobs"][0] is None
    top_name = TOK.decode([TOP_TOKEN], skip_special_tokens=False)
    assert lp["top_logprobs"][1] == {top_name: -0.5, lp["tokens"][1]: -1.0}
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    # As vLLM: the choice also carries the prompt logprobs in its own shape.
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == n


def test_lm_eval_loglikelihood_request_reads_as_it_expects() -> None:
    """What lm-eval 0.4.13's ``local-completions`` sends for a loglikelihood request: one
    token-id prompt in a list, ``max_tokens: 1``, ``logprobs: 1``, ``echo``; it sums
    ``token_logprobs[ctxlen:-1]`` and compares each to ``max(top_logprobs[i].values())``."""
    backend, resp = completion(prompt=[PROMPT_IDS], max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert resp.status_code == 200, resp.text
    assert backend.requests[0].prompt_ids == tuple(PROMPT_IDS)
    lp = resp.json()["choices"][0]["logprobs"]
    ctxlen = 1
    assert sum(lp["token_logprobs"][ctxlen:-1]) == -sum(p + 1.0 for p in range(len(PROMPT_IDS) - 1))
    greedy = [tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                           lp["top_logprobs"][ctxlen:-1], strict=True)]
    assert greedy == [False] * (len(PROMPT_IDS) - 1)   # token 7 at -0.5 beats each of them


def test_echo_with_max_tokens_0_returns_the_prompt_alone() -> None:
    backend, resp = completion(echo=True, logprobs=0, max_tokens=0)
    assert resp.status_code == 200, resp.text
    assert backend.requests[0].sampling.max_tokens == 1   # one token runs the prompt, not shown
    (choice,) = resp.json()["choices"]
    assert choice["text"] == TOK.decode(PROMPT_IDS, skip_special_tokens=False)
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT_IDS)
    assert choice["logprobs"]["top_logprobs"][1] == {choice["logprobs"]["tokens"][1]: -1.0}


def test_echo_without_logprobs_echoes_the_text_as_sent_and_asks_no_prompt_logprobs() -> None:
    backend, resp = completion(prompt=" The cat sat", echo=True)
    assert resp.status_code == 200, resp.text
    assert backend.requests[0].sampling.prompt_logprobs is None
    (choice,) = resp.json()["choices"]
    assert choice["text"] == " The cat sat" + TOK.decode(OUT)
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice


def test_streamed_echo_sends_the_prompt_and_its_logprobs_in_the_first_chunk() -> None:
    _, resp = completion(echo=True, logprobs=1, stream=True)
    assert resp.status_code == 200, resp.text
    chunks = [e for e in sse_events(resp.text) if e != "[DONE]"]
    first, second = chunks[0]["choices"][0], chunks[1]["choices"][0]
    assert first["text"] == TOK.decode(PROMPT_IDS, skip_special_tokens=False) + TOK.decode(OUT[:1])
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(PROMPT_IDS) + 1
    assert second["logprobs"]["token_logprobs"] == [-0.25]
    assert second["logprobs"]["text_offset"] == [len(first["text"])]


def test_vllm_prompt_logprobs_on_completions_and_chat() -> None:
    _, resp = completion(prompt_logprobs=1)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT_IDS)
    token = PROMPT_IDS[1]
    assert plp[1] == {str(token): {"logprob": -1.0, "rank": 2,
                                   "decoded_token": TOK.decode([token], skip_special_tokens=False)},
                      str(TOP_TOKEN): {"logprob": -0.5, "rank": 1,
                                       "decoded_token": TOK.decode([TOP_TOKEN], skip_special_tokens=False)}}
    assert choice["logprobs"] is None and choice["text"] == TOK.decode(OUT)

    backend = ScriptedBackend(scripted)
    resp = post(backend, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    chat_ids = backend.requests[0].prompt_ids
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(chat_ids)
    assert body["prompt_logprobs"][1] == {str(chat_ids[1]): {
        "logprob": -1.0, "rank": 2, "decoded_token": TOK.decode([chat_ids[1]], skip_special_tokens=False)}}
    assert "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "the whole vocabulary"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when stream is true"),
    ({"echo": True, "logprobs": 21}, "logprobs", "must be in [0, 20]"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt", "a list of 2 token-id prompts"),
    ({"prompt": ["a", "b"]}, "prompt", "a list of 2 prompts"),
])
def test_refused_combinations_are_named(body: dict[str, Any], param: str, says: str) -> None:
    backend, resp = completion(**body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert backend.requests == []


def test_chat_echo_is_still_refused() -> None:
    backend = ScriptedBackend(scripted)
    resp = post(backend, "/v1/chat/completions", {"model": MODEL, "echo": True,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
