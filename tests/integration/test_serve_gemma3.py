"""``serve run config/gemma3-demo.yaml`` end to end with the second real model family, Gemma 3 270M:
a chat completion through the folder's own Gemma template, tokenizer and stop rules, over HTTP.

The checkpoint is the pretrained model, not the instruction-tuned one: its chat tokens were never
trained (transformers ranks ``<end_of_turn>`` below the 15,000th most likely token wherever the
template puts it), so it never closes a turn by itself. The request therefore ends its answer at
the first newline (``stop``), as a completion-style client would: ``finish_reason`` is ``"stop"``
well before ``max_tokens``, the prompt is exactly transformers' rendering of the template, and no
template special shows. Skips where the folder has not been converted (``make model``). One server
for the module (``tests.harness.serve``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.harness.gemma3 import require_gemma3
from tests.harness.serve import AUTH, REQUEST_TIMEOUT_S, ROOT, Server, serve_app
from tests.harness.tokenizers import hf_chat_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "gemma3-270m"
MAX_TOKENS = 32
QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_gemma3()
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "gemma3-demo.yaml").read_text())
    with serve_app(tmp_path_factory.mktemp("gemma3"), config, model=MODEL) as srv:
        yield srv


def test_gemma3_answers_a_chat_through_its_template_and_stops(server: Server) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": ["\n"]}
    resp = httpx.post(server.url("/v1/chat/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    (choice,) = out["choices"]
    answer = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", answer
    assert 0 < out["usage"]["completion_tokens"] < MAX_TOKENS
    assert out["usage"]["prompt_tokens"] == len(hf_chat_ids(require_gemma3(), QUESTION))
    assert answer.strip() and "\n" not in answer
    assert "<end_of_turn>" not in answer and "<start_of_turn>" not in answer
