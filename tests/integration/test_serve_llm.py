"""Ray Serve LLM with our scheduler: ``serve run config/serve-llm-demo.yaml`` (Ray's own
``build_openai_app`` with ``server_cls: fastserve.server.llm_server:FastServeLLMServer``) answers completions,
chat and both streamed, through the official ``openai`` client; errors come in Ray's format.

Skipped only where the ``serve-llm`` extra is not installed (``make test`` installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

pytest.importorskip("ray.serve.llm", reason="needs the serve-llm extra: pip install -e '.[serve-llm]'")

from tests.harness.serve import (  # noqa: E402  (after the skip)
    MODEL,
    REQUEST_TIMEOUT_S,
    ROOT,
    TOK,
    Server,
    serve_app,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "serve-llm-demo.yaml").read_text())
    # Serve's proxy answers /-/healthz; Ray Serve LLM's ingress has no /health route.
    with serve_app(tmp_path_factory.mktemp("serve-llm"), config, health_path="/-/healthz") as srv:
        yield srv


def test_completions_chat_and_streams_through_ray_serve_llm(llm_server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=llm_server.url("/v1"), api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    fixed = {"ignore_eos": True}
    prompt = "Hello, my name is"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body=fixed)
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == len(TOK.encode(prompt))
    assert done.model_extra is not None and "queue_s" in done.model_extra["job_stats"]   # our scheduler's

    text, reasons = "", []
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                           extra_body={**fixed, "return_token_ids": True}):
        for c in chunk.choices:
            text += c.text
            reasons.append(c.finish_reason)
    assert reasons[-1] == "length" and reasons.count("length") == 1

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=6, extra_body=fixed)
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"

    pieces, chat_reasons = [], []
    for delta_chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=6, stream=True,
                                                      stream_options={"include_usage": True}, extra_body=fixed):
        for d in delta_chunk.choices:
            pieces.append(d.delta.content or "")
            chat_reasons.append(d.finish_reason)
        if delta_chunk.usage is not None:
            assert delta_chunk.usage.completion_tokens == 6
    assert chat_reasons[-1] == "length" and chat_reasons.count("length") == 1


def test_our_validation_errors_arrive_in_ray_serve_llms_error_format(llm_server: Server) -> None:
    # vLLM's request model accepts any n; our server allows at most server.max_choices (16).
    resp = httpx.post(llm_server.url("/v1/completions"), timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 17})
    assert resp.status_code == 400, resp.text
    # Ray's ingress re-raises our error as its OpenAIHTTPException: the status survives (as
    # error.code), our message is wrapped with the request id, our param and code name are lost.
    err = resp.json()["error"]
    assert err["code"] == 400 and err["type"] == "OpenAIHTTPException" and err["param"] is None
    assert err["message"].startswith("Message: n must be at most 16 (server.max_choices), got 17")


def test_tokenize_detokenize_and_model_card_through_ray_serve_llm(llm_server: Server) -> None:
    """Ray's router routes /tokenize and /detokenize to our engine (fastserve.server.tokenize_api answers) and
    answers /v1/models/{id} from its own model cards. It parses /tokenize bodies as vLLM's
    ``TokenizeCompletionRequest`` only: a chat body (``messages``) is refused there."""
    ids = TOK.encode("Hello world")
    tokenized = httpx.post(llm_server.url("/tokenize"), timeout=60,
                           json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 2048
    assert body["token_strs"] == ["</s>", "Hello", "Ġworld"]
    back = httpx.post(llm_server.url("/detokenize"), timeout=60, json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": "</s>Hello world"}

    chat = httpx.post(llm_server.url("/tokenize"), timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 400, chat.text
    assert "prompt" in chat.json()["error"]["message"]   # Ray's validation: the field it requires
    outside = httpx.post(llm_server.url("/detokenize"), timeout=60, json={"model": MODEL, "tokens": [1, 10**6]})
    assert outside.status_code == 400, outside.text   # ours, through Ray's error format
    assert "token id 1000000 is outside the vocabulary" in outside.json()["error"]["message"]
    unsupported = httpx.post(llm_server.url("/tokenize"), timeout=60,
                             json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 2})
    assert unsupported.status_code == 400 and "truncate_prompt_tokens" in unsupported.json()["error"]["message"]

    card = httpx.get(llm_server.url(f"/v1/models/{MODEL}"), timeout=60)
    assert card.status_code == 200 and card.json()["id"] == MODEL
    assert httpx.get(llm_server.url("/v1/models/not-served"), timeout=60).status_code == 404


def test_full_admission_queue_is_a_429_error_response_without_retry_after() -> None:
    """In process (no cluster): the engine turns our 429 into Ray's ``ErrorResponse``, which
    carries the status only — Ray's ingress has no place for our ``Retry-After`` header."""
    import asyncio
    import time

    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse
    from ray.serve.llm import LLMConfig

    from fastserve.server.llm_server import FastServeEngine, FastServeLLMServer

    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "serve-llm-demo.yaml").read_text())
    (llm,) = config["applications"][0]["args"]["llm_configs"]
    # FCFS, one job per batch, one job may wait: the third concurrent request is refused.
    llm["engine_kwargs"]["scheduler"].update(policy="fcfs", max_batch_size=1, admission_queue_limit=1)
    engine = FastServeEngine(LLMConfig(**{**llm, "server_cls": FastServeLLMServer}))

    def request() -> Any:
        return CompletionRequest(model=MODEL, prompt="Hi", max_tokens=500, ignore_eos=True, stream=True)

    async def run() -> None:
        await engine.start()
        assert engine.replica is not None
        running = engine.completions(request())
        try:
            assert (await running.__anext__()).startswith("data: ")   # admitted: streaming tokens
            waiting = asyncio.ensure_future(engine.completions(request()).__anext__())
            deadline = time.monotonic() + 30
            while engine.replica.scheduler.num_waiting() < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.replica.scheduler.num_waiting() == 1
            refused = [item async for item in engine.completions(request())]
            assert len(refused) == 1 and isinstance(refused[0], ErrorResponse)
            err = refused[0].error
            assert (err.code, err.type) == (429, "rate_limit_error")
            assert "admission_queue_limit=1" in err.message
            waiting.cancel()
        finally:
            await running.aclose()
            await engine.shutdown()

    asyncio.run(run())
