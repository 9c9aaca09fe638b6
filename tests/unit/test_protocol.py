"""The OpenAI wire format (fastserve.server.protocol) and the HTTP layer (fastserve.server.ingress) over a fake
scheduler.

Exact error messages and bodies, sampling conversion, stop strings, SSE framing and usage; no Ray
cluster (the scheduler side is a scripted ``Backend``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from fastserve.engine.delivery import Accepted, JobEvent, JobStream
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.server.http_api import make_api, respond
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from fastserve.server.protocol_output import StopStringMatcher
from fastserve.server.request_limits import RequestLimits
from tests.harness.http_backends import CONTEXT, FAKE_STATS, MODEL, TEXT_IDS, TOK, VOCAB, FakeBackend, FakeStream


def parse_error(model: Any, body: Any) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_request(model, raw)
    assert info.value.status == 400
    return info.value.body()["error"]


# ---- parsing and sampling --------------------------------------------------------------------

def test_malformed_json() -> None:
    err = parse_error(CompletionRequest, b'{"model": ')
    assert err["code"] == "invalid_json" and err["message"].startswith("malformed JSON body: ")
    assert err["type"] == "invalid_request_error"


def test_body_must_be_an_object() -> None:
    err = parse_error(CompletionRequest, [1, 2])
    assert err["message"] == "request body must be a JSON object: Input should be an object"


def test_missing_prompt() -> None:
    err = parse_error(CompletionRequest, {"model": MODEL})
    assert err == {"message": "missing required field 'prompt'", "type": "invalid_request_error",
                   "param": "prompt", "code": None}


def test_prompt_shape_errors() -> None:
    err = parse_error(CompletionRequest, {"model": MODEL, "prompt": [1, "a"]})
    assert err["message"] == "invalid value for 'prompt': must be a string or a list of integer token ids"
    err = parse_error(CompletionRequest, {"model": MODEL, "prompt": ["a", "b"]})
    assert err["message"] == ("invalid value for 'prompt': a list of 2 prompts (batched request) is not "
                              "supported; send one prompt per request")
    assert parse_request(CompletionRequest, json.dumps({"model": MODEL, "prompt": ["one"]}).encode()).prompt == "one"


def test_wrong_types_name_the_field() -> None:
    err = parse_error(CompletionRequest, {"model": MODEL, "prompt": "x", "temperature": "hot"})
    assert err["param"] == "temperature"
    assert err["message"] == ("invalid value for 'temperature': Input should be a valid number, "
                              "unable to parse string as a number")
    err = parse_error(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]})
    assert err["param"] == "messages[0].role"


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens must be >= 1 (0 only with echo), got 0"),
    ("temperature", -0.5, "temperature must be >= 0, got -0.5"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -3, "top_k must be >= 0 (0 or -1 disables it), got -3"),
    ("seed", -1, "seed must be >= 0, got -1"),
    ("n", 0, "n must be >= 1, got 0"),
    ("logprobs", 21, "logprobs must be in [0, 20], got 21"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2], got -3.0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
    ("min_tokens", 17, "min_tokens must be in [0, max_tokens=16], got 17"),
    ("best_of", 3, "best_of must be 1 or equal to n (1), got 3: choosing the best of several samples "
                   "is not supported"),
    ("stop", [""], "stop strings must be non-empty"),
])
def test_bad_sampling_values(field: str, value: Any, message: str) -> None:
    req = parse_request(CompletionRequest, json.dumps({"model": MODEL, "prompt": "x", field: value}).encode())
    with pytest.raises(APIError) as info:
        req.to_sampling(16)
    param = "stop" if field == "stop" else field
    assert info.value.body()["error"] == {"message": message, "type": "invalid_request_error",
                                          "param": param, "code": None}


def test_sampling_conversion() -> None:
    req = parse_request(CompletionRequest, json.dumps({
        "model": MODEL, "prompt": "x", "max_tokens": 7, "temperature": 0, "top_k": -1, "top_p": 0.9,
        "seed": 3, "ignore_eos": True, "user": "someone"}).encode())
    s = req.to_sampling(16)
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.seed, s.ignore_eos) == (7, 0.0, 0, 0.9, 3, True)
    assert parse_request(CompletionRequest, b'{"model": "m", "prompt": "x"}').to_sampling(16).max_tokens == 16


def test_chat_max_completion_tokens() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 5}).encode())
    assert req.to_sampling(100).max_tokens == 5
    assert req.messages[0].text() == "hi"


def test_stop_string_matcher_holds_back_split_stops() -> None:
    m = StopStringMatcher(["STOP", "xy"])
    sent = [m.push(d) for d in ["ab", "cS", "TO", "Pzz"]]
    assert "".join(sent) + m.flush() == "abc" and m.stopped
    m = StopStringMatcher(["\n\n"])
    sent = [m.push(d) for d in ["one\n", "two\n", "\nthree"]]
    assert "".join(sent) + m.flush() == "one\ntwo"
    m = StopStringMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""


def test_stop_string_matcher_keeps_the_match_when_asked() -> None:
    m = StopStringMatcher(["STOP", "xy"], include=True)
    sent = [m.push(d) for d in ["ab", "cS", "TO", "Pzz"]]
    assert "".join(sent) + m.flush() == "abcSTOP" and m.stopped
    m = StopStringMatcher(["ST", "STOP", "b"], include=True)     # earliest wins: "b" at 1
    assert m.push("abSTOP") + m.flush() == "ab"
    m = StopStringMatcher(["ST", "STOP"], include=True)          # one position: the first listed
    assert m.push("aSTOP") + m.flush() == "aST"


# ---- the HTTP layer over a scripted backend --------------------------------------------------

def client(backend: FakeBackend, api_key: str | None = None) -> httpx.AsyncClient:
    ctx = ServerContext(MODEL, TOK, VOCAB, CONTEXT, api_key=api_key, retry_after_s=3)
    app = make_api(OpenAIServer(ctx, backend))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def post(backend: FakeBackend, path: str, body: Any, headers: dict[str, str] | None = None,
         api_key: str | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        async with client(backend, api_key) as c:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await c.post(path, content=content, headers=headers or {})
    return asyncio.run(run())


def sse_events(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out




def test_completion_response_has_text_usage_and_job_stats() -> None:
    backend = FakeBackend(TEXT_IDS)
    resp = post(backend, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 50,
                                             "return_token_ids": True})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == " Hello world. STOP here" and choice["finish_reason"] == "length"
    assert choice["token_ids"] == TEXT_IDS
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": len(TEXT_IDS),
                             "total_tokens": 2 + len(TEXT_IDS)}
    assert body["job_stats"] == FAKE_STATS.as_dict()
    assert backend.requests[0].prompt_ids == tuple(TOK.encode("Hi"))


def test_stop_string_trims_output_and_cancels_the_job() -> None:
    backend = FakeBackend(TEXT_IDS)
    resp = post(backend, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["STOP"]})
    body = resp.json()
    assert body["choices"][0]["text"] == " Hello world. " and body["choices"][0]["finish_reason"] == "stop"
    assert backend.streams[0].cancelled


def test_streaming_completion_chunks_usage_and_done() -> None:
    backend = FakeBackend(TEXT_IDS)
    resp = post(backend, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == " Hello world. STOP here"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["job_stats"] == FAKE_STATS.as_dict()
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(TEXT_IDS)
    assert all(c["usage"] is None for c in chunks[:-1])


def test_coalesced_items_stream_one_chunk_each_with_the_same_text() -> None:
    # A lagging reader gets several tokens per item: one SSE chunk per item, same text and count.
    backend = FakeBackend(TEXT_IDS, per_item=3)
    resp = post(backend, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = sse_events(resp)[:-1]
    token_chunks = [c for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"]]
    assert len(token_chunks) == -(-len(TEXT_IDS) // 3)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " Hello world. STOP here"
    assert chunks[-1]["usage"]["completion_tokens"] == len(TEXT_IDS)
    # A stop string inside a coalesced item still trims there and cancels the job.
    backend = FakeBackend(TEXT_IDS, per_item=len(TEXT_IDS))
    body = post(backend, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["STOP"]}).json()
    assert body["choices"][0]["text"] == " Hello world. " and body["choices"][0]["finish_reason"] == "stop"
    assert backend.streams[0].cancelled


def test_streaming_chat_starts_with_the_role() -> None:
    backend = FakeBackend(TEXT_IDS, reason="stop")
    resp = post(backend, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    chunks = sse_events(resp)[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == " Hello world. STOP here"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert backend.requests[0].prompt_ids == tuple(TOK.encode("User: Hi\nAssistant:"))


def test_chat_non_streaming() -> None:
    backend = FakeBackend(TEXT_IDS, reason="stop")
    body = post(backend, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " Hello world. STOP here"}
    # the default max_tokens is what the context leaves
    assert backend.requests[0].sampling.max_tokens == CONTEXT - len(TOK.encode("User: Hi\nAssistant:"))


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_http_errors_have_openai_bodies() -> None:
    b = FakeBackend([5])
    assert error(post(b, "/v1/completions", b"{nope"), 400)["code"] == "invalid_json"
    err = error(post(b, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 400)
    assert err == {"message": "the model 'gpt-4' does not exist; this server serves 'opt-125m'",
                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    err = error(post(b, "/v1/completions", {"model": MODEL, "prompt": [7] * 2040, "max_tokens": 9}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["message"] == ("prompt of 2040 tokens + max_tokens 9 exceeds the model's context of 2048 tokens")
    err = error(post(b, "/v1/completions", {"model": MODEL, "prompt": [VOCAB]}), 400)
    assert err["message"] == f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    err = error(post(b, "/v1/completions", {"model": MODEL, "prompt": []}), 400)
    assert err["message"] == "prompt is empty: at least one token id is required"
    err = error(post(b, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}), 400)
    assert err["param"] == "n" and err["message"] == "n must be at most 16 (server.max_choices), got 17"
    err = error(post(b, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    assert err["param"] == "messages"
    assert b.requests == []   # nothing invalid ever reached the scheduler


def test_chat_prompt_longer_than_the_context() -> None:
    b = FakeBackend([5])
    long = " ".join(["word"] * 2100)
    err = error(post(b, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long}]}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_full_admission_queue_is_429_with_retry_after() -> None:
    resp = post(FakeBackend([], first="rejected"), "/v1/completions", {"model": MODEL, "prompt": "x"})
    err = error(resp, 429)
    assert resp.headers["retry-after"] == "3"
    assert err["type"] == "rate_limit_error" and err["code"] == "admission_queue_full"
    assert "2 jobs already wait for admission" in err["message"]


def test_engine_errors_are_500_not_400() -> None:
    err = error(post(FakeBackend([5], reason="error"), "/v1/completions", {"model": MODEL, "prompt": "x"}), 500)
    assert err["type"] == "internal_error"


def test_api_key() -> None:
    b = FakeBackend([5])
    body = {"model": MODEL, "prompt": "x"}
    err = error(post(b, "/v1/completions", body, api_key="sekrit"), 401)
    assert err["code"] == "invalid_api_key"
    error(post(b, "/v1/completions", body, {"Authorization": "Bearer wrong"}, api_key="sekrit"), 401)
    ok = post(b, "/v1/completions", body, {"Authorization": "Bearer sekrit"}, api_key="sekrit")
    assert ok.status_code == 200


def test_models_health_metrics_and_unknown_routes() -> None:
    async def run() -> None:
        async with client(FakeBackend([5])) as c:
            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == MODEL and models["object"] == "list"
            assert (await c.get("/health")).status_code == 200
            metrics = await c.get("/metrics")
            assert metrics.text.startswith("fastserve:") and "text/plain" in metrics.headers["content-type"]
            missing = await c.get("/v2/nothing")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    asyncio.run(run())


def test_a_stream_that_breaks_mid_way_ends_with_an_error_event() -> None:
    class BrokenStream(FakeStream):
        async def __anext__(self) -> JobEvent:
            if len(self.items) == 0:
                raise RuntimeError("replica died")
            return await super().__anext__()

    class Broken(FakeBackend):
        def generate(self, req: JobRequest) -> JobStream:
            # accepted, one token, then the replica is gone
            return BrokenStream([Accepted("j"), TokenDelta("j", (TEXT_IDS[0],))]).read()

    resp = post(Broken(TEXT_IDS), "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"] == {"message": "internal error: RuntimeError", "type": "internal_error",
                                   "param": None, "code": "internal_error"}
    assert events[0]["choices"][0]["text"] == TOK.decode(TEXT_IDS[:1])


# ---- limits, timeouts and hang-ups owned by the ingress ---------------------------------------

class HangingBackend(FakeBackend):
    """Accepts, streams the first token, then never finishes (a slow or stuck job)."""

    def generate(self, req: JobRequest) -> JobStream:
        self.requests.append(req)
        stream = HangingStream([Accepted("j"), TokenDelta("j", (TEXT_IDS[0],))])
        self.streams.append(stream)
        return stream.read()


class HangingStream(FakeStream):
    async def __anext__(self) -> JobEvent:
        if not self.items:
            await asyncio.Event().wait()   # forever, until cancelled
        return await super().__anext__()


def limited_client(backend: FakeBackend, **limits: Any) -> httpx.AsyncClient:
    ctx = ServerContext(MODEL, TOK, VOCAB, CONTEXT, limits=RequestLimits(**limits))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=make_api(OpenAIServer(ctx, backend))),
                             base_url="http://test")


def post_limited(backend: FakeBackend, body: Any, **limits: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        async with limited_client(backend, **limits) as c:
            return await c.post("/v1/completions", content=json.dumps(body).encode())
    return asyncio.run(run())


def test_body_over_the_limit_is_refused_with_413_naming_the_limit() -> None:
    backend = FakeBackend(TEXT_IDS)
    resp = post_limited(backend, {"model": MODEL, "prompt": "x" * 5000}, max_request_bytes=4096)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert "server.max_request_bytes" in resp.json()["error"]["message"] and backend.requests == []


def test_stop_string_count_and_length_limits() -> None:
    backend = FakeBackend(TEXT_IDS)
    resp = post_limited(backend, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c"]}, max_stop_strings=2)
    assert resp.status_code == 400 and "server.max_stop_strings" in resp.json()["error"]["message"]
    resp = post_limited(backend, {"model": MODEL, "prompt": "x", "stop": "y" * 11}, max_stop_string_chars=10)
    assert resp.status_code == 400 and "server.max_stop_string_chars" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "stop" and backend.requests == []


def test_priority_is_refused_unless_the_config_allows_it() -> None:
    off, on = FakeBackend(TEXT_IDS), FakeBackend(TEXT_IDS)
    resp = post_limited(off, {"model": MODEL, "prompt": "x", "priority": -5})
    assert resp.status_code == 400 and off.requests == []
    assert resp.json()["error"]["param"] == "priority"
    assert resp.json()["error"]["message"] == ("priority -5 is not honoured: request priorities are off on this "
                                               "server (server.allow_priority); send 0 or leave it out")
    assert post_limited(off, {"model": MODEL, "prompt": "x", "priority": 0}).status_code == 200
    assert post_limited(on, {"model": MODEL, "prompt": "x", "priority": -5}, allow_priority=True).status_code == 200
    assert off.requests[0].priority == 0 and on.requests[0].priority == -5


def test_logit_bias_reaches_the_sampling_params_clamped_and_bad_keys_are_refused() -> None:
    backend = FakeBackend(TEXT_IDS)
    body = {"model": MODEL, "prompt": "x", "logit_bias": {"7": -300, "5": 2.5, " 9": 100}}
    assert post_limited(backend, body).status_code == 200
    assert backend.requests[0].sampling.logit_bias == ((5, 2.5), (7, -100.0), (9, 100.0))
    for bad, message in (({"a": 1}, "logit_bias key 'a' is not a token id (a non-negative integer)"),
                         ({"-3": 1}, "logit_bias key '-3' is not a token id (a non-negative integer)"),
                         ({str(VOCAB): 1}, f"logit_bias token id {VOCAB} is outside the vocabulary [0, {VOCAB})")):
        resp = post_limited(backend, {"model": MODEL, "prompt": "x", "logit_bias": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"
        assert resp.json()["error"]["message"] == message
    assert len(backend.requests) == 1


def test_allowed_token_ids_reach_the_sampling_params_and_bad_ones_are_refused() -> None:
    backend = FakeBackend(TEXT_IDS)
    assert post_limited(backend, {"model": MODEL, "prompt": "x", "allowed_token_ids": [3, 1, 3]}).status_code == 200
    assert backend.requests[0].sampling.allowed_token_ids == (1, 3)
    for bad, message in (([], "allowed_token_ids must be a non-empty list of token ids >= 0"),
                         ([-1], "allowed_token_ids must be a non-empty list of token ids >= 0"),
                         ([VOCAB], f"allowed token id {VOCAB} is outside the vocabulary [0, {VOCAB})")):
        resp = post_limited(backend, {"model": MODEL, "prompt": "x", "allowed_token_ids": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids"
        assert resp.json()["error"]["message"] == message
    assert len(backend.requests) == 1


def test_bad_words_are_tokenized_as_written_and_after_a_space() -> None:
    backend = FakeBackend(TEXT_IDS)
    assert post_limited(backend, {"model": MODEL, "prompt": "x", "bad_words": ["Hello", " the"]}).status_code == 200
    hello, spaced_hello = TOK.encode("Hello", add_special_tokens=False), TOK.encode(" Hello", add_special_tokens=False)
    the, spaced_the = TOK.encode("the", add_special_tokens=False), TOK.encode(" the", add_special_tokens=False)
    assert backend.requests[0].sampling.bad_words_ids == (tuple(hello), tuple(spaced_hello), tuple(the),
                                                          tuple(spaced_the))
    resp = post_limited(backend, {"model": MODEL, "prompt": "x", "bad_words": [" "]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words"


def test_cache_salt_reaches_every_choice_and_an_empty_one_is_refused() -> None:
    backend = FakeBackend(TEXT_IDS)
    assert post_limited(backend, {"model": MODEL, "prompt": "x", "n": 2, "cache_salt": "tenant-7"}).status_code == 200
    assert [r.cache_salt for r in backend.requests] == ["tenant-7", "tenant-7"]
    assert post_limited(backend, {"model": MODEL, "prompt": "x"}).status_code == 200
    assert backend.requests[-1].cache_salt is None
    for bad in ("", 7, ["a"]):
        resp = post_limited(backend, {"model": MODEL, "prompt": "x", "cache_salt": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", bad
    assert len(backend.requests) == 3


def test_a_request_past_its_timeout_ends_with_504_or_an_error_event_and_is_aborted() -> None:
    backend = HangingBackend(TEXT_IDS)
    resp = post_limited(backend, {"model": MODEL, "prompt": "x"}, request_timeout_s=0.3)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "request_timeout"
    resp = post_limited(backend, {"model": MODEL, "prompt": "x", "stream": True}, request_timeout_s=0.3)
    events = sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert [s.cancelled for s in backend.streams] == [True, True]


def test_a_non_streaming_client_that_hangs_up_aborts_its_job() -> None:
    backend = HangingBackend(TEXT_IDS)
    ctx = ServerContext(MODEL, TOK, VOCAB, CONTEXT)
    server = OpenAIServer(ctx, backend)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 500}).encode()

    async def run() -> None:
        with pytest.raises(APIError) as err:
            await respond(server, body, False, lambda: asyncio.sleep(0.2))   # the client leaves at 0.2 s
        assert err.value.status == 499

    asyncio.run(run())
    assert backend.streams[0].cancelled


def test_health_reports_the_schedulers_state() -> None:
    async def get(backend: FakeBackend) -> httpx.Response:
        async with client(backend) as c:
            return await c.get("/health")

    backend = FakeBackend(TEXT_IDS)
    assert asyncio.run(get(backend)).status_code == 200
    backend.healthy = False
    resp = asyncio.run(get(backend))
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "unhealthy: stuck"

    class Gone(FakeBackend):
        async def health(self) -> dict[str, Any]:
            raise RuntimeError("no replica")

    resp = asyncio.run(get(Gone(TEXT_IDS)))
    assert resp.status_code == 503 and "no engine replica answered" in resp.json()["error"]["message"]


def test_an_unavailable_engine_answers_503_with_retry_after() -> None:
    resp = post(FakeBackend(TEXT_IDS, first="unavailable"), "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
    assert resp.json()["error"]["code"] == "engine_unavailable"


def test_a_job_without_output_within_the_admission_timeout_gets_429_and_is_dropped() -> None:
    class Queued(FakeBackend):
        def generate(self, req: JobRequest) -> JobStream:
            stream = HangingStream([Accepted("j")])   # admitted to the queue, never run
            self.streams.append(stream)
            return stream.read()

    for stream in (False, True):
        backend = Queued(TEXT_IDS)
        resp = post_limited(backend, {"model": MODEL, "prompt": "x", "stream": stream}, admission_timeout_s=0.2)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "admission_timeout"
        assert "server.admission_timeout_s" in resp.json()["error"]["message"]
        assert backend.streams[0].cancelled
