"""The request fields at the HTTP layer (``fastserve.server.protocol``, ``fastserve.server.request_fields``,
``fastserve.server.choices``
through ``OpenAIServer`` over a scripted backend): every field we do not honour is a 400 naming
it, honoured fields reach the job's ``SamplingParams``, and the logprobs and ``n`` shapes, both
streaming and not."""

from __future__ import annotations

from typing import Any

import pytest

from fastserve.scheduler.job import Finish, JobRequest, TokenDelta
from fastserve.server.request_fields import HARMLESS, REFUSED
from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import SamplingParams, TokenLogprobs
from tests.harness.http_backends import MODEL, STATS, ScriptedBackend, post, sse_events

TOK = Tokenizer.default()
IDS = TOK.encode("Hello world", add_special_tokens=False)
LP = [TokenLogprobs(-0.5 - i, ((t, -0.5 - i), (t + 1, -2.0 - i))) for i, t in enumerate(IDS)]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def script(reason: str = "length", ids: list[int] | None = None,
           per_seed: bool = False) -> ScriptedBackend:
    """Each job emits ``ids`` one per event (shifted by its seed's offset when ``per_seed``),
    with logprobs if it asked."""
    def run(req: JobRequest) -> list[TokenDelta]:
        toks = list(IDS if ids is None else ids)
        if per_seed and req.sampling.seed is not None:
            toks = [t + req.sampling.seed % 7 for t in toks]
        asked = req.sampling.logprobs is not None
        out = [TokenDelta(req.job_id, (t,), logprobs=(LP[i % len(LP)],) if asked else ())
               for i, t in enumerate(toks)]
        out[-1] = TokenDelta(req.job_id, out[-1].token_ids, Finish(reason, STATS), out[-1].logprobs)  # type: ignore[arg-type]
        return out
    return ScriptedBackend(run)


def body(chat: bool, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 5}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    base.update(fields)
    return base


# ---- refused ----------------------------------------------------------------------------------

BAD_VALUE: dict[str, Any] = {"tools": [{"type": "function"}],
                             "tool_choice": "auto", "echo": True,
                             "suffix": "end", "length_penalty": 2.0,
                             "bad_words": ["x"]}


#: Refused on completions only: chat requests declare and honour them (``test_tool_requests``).
CHAT_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


@pytest.mark.parametrize(("field", "chat"), [(f, chat) for f in sorted(REFUSED) for chat in (False, True)
                                             if not (chat and f in CHAT_FIELDS)])
def test_every_refused_field_is_a_400_naming_it(field: str, chat: bool) -> None:
    backend = script()
    value = BAD_VALUE.get(field, True if REFUSED[field] == (False,) else "x")
    resp = post(backend, CHAT if chat else CMPL, body(chat, **{field: value}))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field} is not supported by this server")
    assert backend.requests == []


@pytest.mark.parametrize("field,value", [("response_format", {"type": "text"}), ("tools", []),
                                         ("tool_choice", "none"), ("logit_bias", {}), ("echo", False),
                                         ("suffix", ""), ("guided_json", None), ("user", "u1"),
                                         ("metadata", {"k": "v"}), ("store", False)])
def test_no_op_values_and_harmless_fields_are_accepted(field: str, value: Any) -> None:
    assert post(script(), CMPL, body(False, **{field: value})).status_code == 200


def test_unknown_fields_are_refused_and_harmless_ones_listed() -> None:
    assert {"user", "metadata", "store", "service_tier"} == HARMLESS
    err = post(script(), CMPL, body(False, thinking_budget=5)).json()["error"]
    assert err == {"message": "unknown field 'thinking_budget': this server does not support it",
                   "type": "invalid_request_error", "param": "thinking_budget", "code": None}


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "content": "hi", "refusal": "no"}, "messages[0].refusal"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "messages[0].function_call"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
     "messages[0].content[0].cache_control"),
])
def test_a_message_field_we_do_not_use_is_refused_not_dropped(message: dict[str, Any], param: str) -> None:
    backend = script()
    err = post(backend, CHAT, body(True, messages=[message])).json()["error"]
    assert (err["param"], err["message"]) == (param, f"unknown field '{param}': this server does not support it")
    assert backend.requests == []


def test_chat_logprobs_null_is_false() -> None:
    backend = script()
    assert post(backend, CHAT, body(True, logprobs=None)).status_code == 200
    assert backend.requests[0].sampling.logprobs is None


@pytest.mark.parametrize("fields,param,message", [
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens",
     "spaces_between_special_tokens=false is not supported (special tokens are decoded as the fast tokenizer does)"),
    ({"n": 2, "best_of": 3}, "best_of",
     "best_of must be 1 or equal to n (2), got 3: choosing the best of several samples is not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs to be true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
    ({"stop_token_ids": [50272]}, "stop_token_ids", "stop token id 50272 is outside the vocabulary [0, 50272)"),
])
def test_bad_honoured_values_name_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    err = post(script(), CHAT, body(True, **fields)).json()["error"]
    assert (err["param"], err["message"]) == (param, message)


# ---- honoured ---------------------------------------------------------------------------------

def test_honoured_fields_reach_the_jobs_sampling() -> None:
    backend = script()
    fields = {"stop_token_ids": [5, 9], "min_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25,
              "repetition_penalty": 1.2, "min_p": 0.1, "logprobs": True, "top_logprobs": 3, "seed": 7,
              "n": 2, "best_of": 2}
    assert post(backend, CHAT, body(True, **fields)).status_code == 200
    s0, s1 = (r.sampling for r in backend.requests)
    assert s0 == SamplingParams(max_tokens=5, seed=7, stop_token_ids=(5, 9), min_tokens=2, min_p=0.1,
                                presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                                logprobs=3)
    assert s1.seed == 8 and [r.job_id[-2:] for r in backend.requests] == ["-0", "-1"]


def test_a_stop_token_counts_as_generated_but_is_not_text() -> None:
    stop = TOK.encode("!", add_special_tokens=False)[0]
    resp = post(script("stop", IDS + [stop]), CMPL, body(False, stop_token_ids=[stop])).json()
    assert resp["choices"][0]["text"] == "Hello world"
    assert resp["usage"]["completion_tokens"] == len(IDS) + 1


def test_include_stop_str_in_output_keeps_the_stop_token_and_the_stop_string() -> None:
    stop = TOK.encode("!", add_special_tokens=False)[0]
    resp = post(script("stop", IDS + [stop]), CMPL, body(False, stop_token_ids=[stop], include_stop_str_in_output=True))
    assert resp.json()["choices"][0]["text"] == "Hello world!"
    choice = post(script(), CMPL, body(False, stop=" wor", include_stop_str_in_output=True)).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello wor", "stop")


def test_chat_options_shape_the_prompt_the_job_gets() -> None:
    backend = script()
    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    fields = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    assert post(backend, CHAT, body(True, **fields)).status_code == 200
    assert backend.requests[0].prompt_ids == tuple(TOK.encode("User: hi\nAssistant: Sure,"))
    err = post(backend, CHAT, body(True, continue_final_message=True)).json()["error"]
    assert err["param"] == "continue_final_message" and len(backend.requests) == 1
    err = post(backend, CMPL, body(False, continue_final_message=True)).json()["error"]
    assert err["message"] == "unknown field 'continue_final_message': this server does not support it"


def test_add_special_tokens_and_truncate_prompt_tokens_shape_the_prompt_ids() -> None:
    backend = script()
    for fields in ({}, {"add_special_tokens": False}, {"prompt": [5, 6, 7, 8], "truncate_prompt_tokens": 2},
                   {"prompt": [5, 6, 7, 8], "truncate_prompt_tokens": -1}):
        assert post(backend, CMPL, body(False, **fields)).status_code == 200
    assert [r.prompt_ids for r in backend.requests] == [
        tuple(TOK.encode("hi")), tuple(TOK.encode("hi", add_special_tokens=False)), (7, 8), (5, 6, 7, 8)]
    assert TOK.encode("hi")[0] == TOK.bos_token_id != TOK.encode("hi", add_special_tokens=False)[0]
    err = post(backend, CMPL, body(False, truncate_prompt_tokens=0)).json()["error"]
    assert (err["param"], err["message"]) == ("truncate_prompt_tokens",
                                              "truncate_prompt_tokens must be >= 1 or -1, got 0")
    assert post(backend, CHAT, body(True, truncate_prompt_tokens=1)).status_code == 200
    assert len(backend.requests[-1].prompt_ids) == 1


def test_skip_special_tokens_false_keeps_special_text() -> None:
    eos = TOK.eos_token_id
    kept = post(script("stop", IDS + [eos, IDS[0]]), CMPL, body(False, skip_special_tokens=False)).json()
    skipped = post(script("stop", IDS + [eos, IDS[0]]), CMPL, body(False)).json()
    special = TOK.decode([eos], skip_special_tokens=False)
    assert kept["choices"][0]["text"] == "Hello world" + special
    assert skipped["choices"][0]["text"] == "Hello world"


# ---- logprobs shapes --------------------------------------------------------------------------

def chat_entry(i: int) -> dict[str, Any]:
    def alt(t: int, v: float) -> dict[str, Any]:
        return {"token": TOK.decode([t], skip_special_tokens=False), "logprob": v,
                "bytes": list(TOK.token_bytes(t))}
    lp = LP[i]
    return {**alt(IDS[i], lp.logprob), "top_logprobs": [alt(t, v) for t, v in lp.top[:2]]}


def test_chat_logprobs_non_streaming() -> None:
    resp = post(script(), CHAT, body(True, logprobs=True, top_logprobs=2)).json()
    assert resp["choices"][0]["logprobs"] == {"content": [chat_entry(i) for i in range(len(IDS))]}


def test_chat_logprobs_streaming_one_entry_per_token() -> None:
    events = sse_events(post(script(), CHAT, body(True, logprobs=True, top_logprobs=2, stream=True)).text)
    chunks = [e for e in events[1:-1] if e["choices"]]
    assert [c["choices"][0]["logprobs"] for c in chunks] == [{"content": [chat_entry(i)]} for i in range(len(IDS))]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id() -> None:
    chat = post(script(), CHAT, body(True, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in IDS]
    assert [[a["token"] for a in e["top_logprobs"]] for e in entries] == \
        [[f"token_id:{t}" for t, _ in LP[i].top[:2]] for i in range(len(IDS))]
    cmpl = post(script(), CMPL, body(False, logprobs=1, return_tokens_as_token_ids=True)).json()["choices"][0]
    assert cmpl["logprobs"]["tokens"] == [f"token_id:{t}" for t in IDS]
    assert cmpl["logprobs"]["text_offset"] == [0, len(TOK.decode(IDS[:1]))]   # offsets stay in the text
    assert cmpl["text"] == "Hello world"


def legacy(i: int, offset: int) -> dict[str, Any]:
    text = TOK.decode([IDS[i]], skip_special_tokens=False)
    top = {TOK.decode([t], skip_special_tokens=False): v for t, v in LP[i].top}
    return {"tokens": [text], "token_logprobs": [LP[i].logprob], "top_logprobs": [top], "text_offset": [offset]}


def test_completion_logprobs_legacy_shape_both_ways() -> None:
    offsets = [0]
    for t in IDS[:-1]:
        offsets.append(offsets[-1] + len(TOK.decode([t], skip_special_tokens=False)))
    whole = post(script(), CMPL, body(False, logprobs=2)).json()["choices"][0]["logprobs"]
    parts = [legacy(i, offsets[i]) for i in range(len(IDS))]
    assert whole == {k: [v for p in parts for v in p[k]] for k in parts[0]}
    events = sse_events(post(script(), CMPL, body(False, logprobs=2, stream=True)).text)
    assert [e["choices"][0]["logprobs"] for e in events[:-1]] == parts


def test_no_logprobs_unless_asked() -> None:
    assert post(script(), CHAT, body(True)).json()["choices"][0]["logprobs"] is None


# ---- n ----------------------------------------------------------------------------------------

def test_n_non_streaming_choices_indexed_and_usage_summed() -> None:
    resp = post(script(per_seed=True), CMPL, body(False, n=3, seed=1)).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in resp["choices"]]
    assert texts == [TOK.decode([t + (1 + i) % 7 for t in IDS]) for i in range(3)]
    assert resp["usage"]["completion_tokens"] == 3 * len(IDS)
    prompt = len(TOK.encode("hi"))
    assert resp["usage"] == {"prompt_tokens": prompt, "completion_tokens": 3 * len(IDS),
                             "total_tokens": prompt + 3 * len(IDS)}


def test_n_streaming_chat_every_choice_indexed_with_usage_at_the_end() -> None:
    events = sse_events(post(script(per_seed=True), CHAT,
                             body(True, n=2, seed=3, stream=True, stream_options={"include_usage": True})).text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * len(IDS)
    text: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    roles = []
    for e in events[:-2]:
        (choice,) = e["choices"]
        delta = choice["delta"]
        if delta.get("role"):
            roles.append(choice["index"])
        text[choice["index"]] += delta.get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert roles == [0, 1] and finishes == {0: "length", 1: "length"}
    assert text == {i: TOK.decode([t + (3 + i) % 7 for t in IDS]) for i in range(2)}


def test_stop_strings_are_not_checked_before_min_tokens() -> None:
    assert len(IDS) == 2 and TOK.decode(IDS[:1]) == "Hello"
    cut = post(script(), CMPL, body(False, stop="Hello")).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("", "stop")
    held = post(script(), CMPL, body(False, stop="Hello", min_tokens=1)).json()["choices"][0]
    assert (held["text"], held["finish_reason"]) == ("Hello world", "length")


def test_stop_string_cut_trims_the_logprobs_with_the_tokens() -> None:
    choice = post(script(), CHAT, body(True, stop=" world", logprobs=True)).json()["choices"][0]
    assert choice["message"]["content"] == "Hello"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hello", " world"]
