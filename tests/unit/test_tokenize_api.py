"""``/tokenize``, ``/detokenize``, ``/v1/models`` and ``/v1/models/{id}`` (fastserve.server.tokenize_api) over
the real FastAPI app and tokenizers, no Ray: vLLM's shapes, exact ids, refusals as OpenAI bodies."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from fastserve.server.http_api import make_api
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.tokenizer import Tokenizer
from tests.harness.http_backends import ScriptedBackend
from tests.harness.tokenizers import LLAMA3_BOS, LLAMA3_STYLE

MODEL = "opt-125m"
VOCAB = 50272
CONTEXT = 2048
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def call(method: str, path: str, body: Any = None, *, tokenizer: Tokenizer | None = None,
         headers: dict[str, str] | None = AUTH) -> httpx.Response:
    tok = tokenizer or Tokenizer.default()
    ctx = ServerContext(MODEL, tok, VOCAB, CONTEXT, api_key=KEY)
    server = OpenAIServer(ctx, ScriptedBackend(lambda req: []))

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=make_api(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            if method == "GET":
                return await c.get(path, headers=headers)
            return await c.post(path, json=body, headers=headers)
    return asyncio.run(run())


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_tokenize_a_prompt_with_and_without_specials_and_token_strings() -> None:
    tok = Tokenizer.default()
    ids = tok.encode("Hello world")
    resp = call("POST", "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids, "token_strs": None}
    assert ids[0] == tok.bos_token_id == 2   # OPT adds </s> as BOS

    bare = call("POST", "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                      "return_token_strs": True}).json()
    assert bare["tokens"] == ids[1:] and bare["count"] == len(ids) - 1
    assert bare["token_strs"] == ["Hello", "Ġworld"]


def test_tokenize_messages_gives_the_chat_endpoints_prompt_ids() -> None:
    tok = Tokenizer.from_dir(LLAMA3_STYLE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = tok.encode_chat(messages)
    resp = call("POST", "/tokenize", {"messages": messages}, tokenizer=tok)
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == expected and expected[0] == LLAMA3_BOS   # the template wrote BOS
    # add_special_tokens adds the tokenizer's specials on top of the template's (vLLM's meaning)
    doubled = call("POST", "/tokenize", {"messages": messages, "add_special_tokens": True}, tokenizer=tok).json()
    assert doubled["tokens"] == [LLAMA3_BOS, *expected]
    # OPT has no template: the fallback format, as /v1/chat/completions renders it
    opt = call("POST", "/tokenize", {"messages": messages}).json()
    assert opt["tokens"] == Tokenizer.default().encode_chat(messages)


def test_detokenize_keeps_special_tokens() -> None:
    tok = Tokenizer.default()
    ids = tok.encode("Hello world")
    resp = call("POST", "/detokenize", {"model": MODEL, "tokens": ids})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"prompt": "</s>Hello world"}
    assert call("POST", "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,param,says", [
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model", "'gpt-4' does not exist"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid value for 'prompt'"),
    ("/tokenize", {}, "prompt", "missing required field 'prompt'"),
    ("/tokenize", {"prompt": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "not supported"),
    ("/tokenize", {"messages": []}, "messages", "invalid value for 'messages'"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"},
     "chat_template", "not supported"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs", "chat_template_kwargs may not set 'messages'"),
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens", f"token id {VOCAB} is outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1 is outside"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "invalid value for 'tokens'"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens", "not supported"),
])
def test_bad_input_is_a_400_naming_the_field(path: str, body: dict[str, Any], param: str, says: str) -> None:
    err = error(call("POST", path, body), 400)
    assert err["param"] == param and says in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_missing_key() -> None:
    async def raw() -> httpx.Response:
        ctx = ServerContext(MODEL, Tokenizer.default(), VOCAB, CONTEXT, api_key=KEY)
        app = make_api(OpenAIServer(ctx, ScriptedBackend(lambda req: [])))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/tokenize", content=b"{not json", headers=AUTH)
    assert error(asyncio.run(raw()), 400)["code"] == "invalid_json"
    assert error(call("POST", "/detokenize", {"tokens": [1]}, headers=None), 401)["code"] == "invalid_api_key"


def test_models_list_and_one_model() -> None:
    listed = call("GET", "/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL]
    one = call("GET", f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json() == listed["data"][0]
    assert one.json()["object"] == "model" and one.json()["owned_by"] == "fastserve"
    err = error(call("GET", "/v1/models/meta-llama/Llama-3-8B"), 404)   # ids may hold slashes
    assert err["code"] == "model_not_found" and "'meta-llama/Llama-3-8B' does not exist" in err["message"]
    assert error(call("GET", f"/v1/models/{MODEL}", headers=None), 401)["code"] == "invalid_api_key"
