"""``serve run config/demo.yaml`` end to end with the real model: SmolLM2-135M-Instruct answers a
chat completion through its own chat template, tokenizer and EOS, over real HTTP.

Skips where the model folder has not been converted (``make model``). One server for the module
(``tests.harness.serve``: a private Ray head, the demo config on a free port).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.harness.serve import AUTH, REQUEST_TIMEOUT_S, ROOT, Server, serve_app
from tests.harness.tokenizers import require_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 32
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_smollm2()
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    with serve_app(tmp_path_factory.mktemp("demo"), config, model=MODEL) as srv:
        yield srv


def _chat(srv: Server, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    return httpx.post(srv.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)


def _streamed_text(resp: httpx.Response) -> tuple[str, str | None]:
    text, reason = [], None
    for line in resp.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):]).get("choices", []):
            text.append(choice["delta"].get("content") or "")
            reason = choice.get("finish_reason") or reason
    return "".join(text), reason


def test_demo_answers_the_capital_of_france_and_streams_the_same_text(server: Server, tmp_path: Path) -> None:
    resp = _chat(server, stream=False)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    answer = choice["message"]["content"]
    assert "Paris" in answer
    # EOS (<|im_end|>) ends the answer before max_tokens, and the template's specials never show.
    assert choice["finish_reason"] == "stop"
    assert "<|im_" not in answer
    streamed = _chat(server, stream=True)
    assert streamed.status_code == 200, streamed.text
    assert _streamed_text(streamed) == (answer, "stop")


def test_demo_continues_a_partial_assistant_message(server: Server) -> None:
    partial = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": MODEL, "messages": partial, "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    resp = httpx.post(server.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"].startswith(" Paris")
