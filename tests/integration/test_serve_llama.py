"""``serve run`` of a LLaMA-architecture config answers the OpenAI endpoints.

``config/llama-demo.yaml`` with its model swapped for a tiny LLaMA of the same family (GQA, llama3
rope scaling, untied head, the OPT tokenizer's vocabulary) so the test stays quick on 2 cores:
the architecture is discovered from the config file, nothing else in the serving path changes.
Reuses ``tests/integration/test_serve.py``'s private Ray head + ``serve run`` fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.serve import API_KEY, REQUEST_TIMEOUT_S, ROOT, TOK, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
#: The demo model's config.json, shrunk: same family and features, a few MB of weights.
TINY_OVERRIDES = {"_name_or_path": MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2}


def tiny_llama_yaml(tmp: Path) -> dict[str, Any]:
    raw = json.loads((ROOT / "config/models/llama-demo-150m/config.json").read_text())
    model_dir = tmp / MODEL
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**raw, **TINY_OVERRIDES}))
    config: dict[str, Any] = yaml.safe_load((ROOT / "config/llama-demo.yaml").read_text())
    config["applications"][0]["args"]["model"].update(name=MODEL, config_path=str(model_dir))
    return config


def test_llama_config_answers_completions_and_chat(tmp_path: Path) -> None:
    import openai

    with serve_app(tmp_path, tiny_llama_yaml(tmp_path), model=MODEL) as srv:
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S)
        assert [m.id for m in client.models.list()] == [MODEL]
        fixed = {"ignore_eos": True}
        done = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, extra_body=fixed)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 8
        assert done.usage.prompt_tokens == len(TOK.encode("Hello, my name is"))
        # Greedy is deterministic across requests (the paged KV of the first is not reused stale).
        again = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8,
                                          temperature=0, extra_body=fixed)
        twice = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8,
                                          temperature=0, extra_body=fixed)
        assert again.choices[0].text == twice.choices[0].text

        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                              max_tokens=6, extra_body=fixed)
        assert chat.choices[0].message.role == "assistant" and chat.usage is not None
        assert chat.usage.completion_tokens == 6
        reasons = [c.finish_reason for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True, extra_body=fixed)
            for c in chunk.choices]
        assert reasons[-1] == "length" and reasons.count("length") == 1
