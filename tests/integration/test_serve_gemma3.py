"""``serve run config/gemma3-demo.yaml`` end to end with the second real model family, Gemma 3 270M:
a chat completion through the folder's own Gemma template, tokenizer and end tokens, over HTTP.

The checkpoint is pretrained, not instruction-tuned; a few-shot conversation of one-word answers
makes it answer in one word and close its turn with ``<end_of_turn>``, the template's end token
the folder names as a second EOS: the reply ends with ``finish_reason: "stop"`` well before
``max_tokens``, and the template's specials never show. Skips where the folder has not been
converted (``make model``). One server for the module (``tests.harness.serve``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.harness.gemma3 import require_gemma3
from tests.harness.serve import AUTH, REQUEST_TIMEOUT_S, ROOT, Server, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "gemma3-270m"
MAX_TOKENS = 16
FEW_SHOT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Say goodbye."}, {"role": "assistant", "content": "Goodbye!"},
            {"role": "user", "content": "Say thank you."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_gemma3()
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "gemma3-demo.yaml").read_text())
    with serve_app(tmp_path_factory.mktemp("gemma3"), config, model=MODEL) as srv:
        yield srv


def test_gemma3_answers_a_chat_and_stops_at_its_end_of_turn(server: Server) -> None:
    body = {"model": MODEL, "messages": FEW_SHOT, "max_tokens": MAX_TOKENS, "temperature": 0}
    resp = httpx.post(server.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    answer = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", answer
    assert resp.json()["usage"]["completion_tokens"] < MAX_TOKENS
    assert "Thank" in answer
    assert "<end_of_turn>" not in answer and "<start_of_turn>" not in answer
