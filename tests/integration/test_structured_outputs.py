"""Structured outputs end to end with the real model and the official ``openai`` client: the demo
(SmolLM2-135M-Instruct, ``config/demo.yaml``) answers greedy requests held to a JSON schema
(``response_format`` json_schema, strict), a choice and a regex (vLLM's ``structured_outputs``
and its older ``guided_*`` names), streamed and not; a schema the engine cannot compile is a 400
naming the field.

Skips where the model folder has not been converted (``make model``). One server for the module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import yaml

from tests.harness.serve import API_KEY, REQUEST_TIMEOUT_S, ROOT, Server, serve_app
from tests.harness.tokenizers import require_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK_PERSON: list[Any] = [{"role": "user", "content": "Describe Alice, a 30 year old engineer from Paris, as JSON "
                                          "with her name, age and city."}]
ASK_SENTIMENT: list[Any] = [{"role": "user", "content": "Is this review positive or negative? 'I loved every minute.'"}]
ASK_DATE: list[Any] = [{"role": "user",
                        "content": "On what date did the French revolution start? Answer as YYYY-MM-DD."}]
CHOICES = ["positive", "negative"]
DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_smollm2()
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    with serve_app(tmp_path_factory.mktemp("structured"), config, model=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0)


def chat(client: openai.OpenAI, messages: list[Any], max_tokens: int = 64, **fields: Any) -> tuple[str, str]:
    """The answer's text and finish reason, greedy; ``fields`` go in the body as sent."""
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                         temperature=0, extra_body=fields)
    choice = out.choices[0]
    return choice.message.content or "", choice.finish_reason


def streamed(client: openai.OpenAI, messages: list[Any], max_tokens: int = 64,
             **fields: Any) -> tuple[str, str | None]:
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=fields)
    text, reason = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason


def test_response_format_json_schema_gives_schema_valid_json_streamed_or_not(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text, reason = chat(client, ASK_PERSON, 128, response_format=response_format)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)
    assert streamed(client, ASK_PERSON, 128, response_format=response_format) == (text, "stop")
    # The same schema by vLLM's names gives the same greedy answer.
    assert chat(client, ASK_PERSON, 128, structured_outputs={"json": PERSON}) == (text, "stop")
    assert chat(client, ASK_PERSON, 128, guided_json=json.dumps(PERSON)) == (text, "stop")


def test_json_object_gives_a_json_object(client: openai.OpenAI) -> None:
    text, reason = chat(client, ASK_PERSON, 128, response_format={"type": "json_object"})
    assert reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_a_choice_answers_one_of_the_choices(client: openai.OpenAI) -> None:
    text, reason = chat(client, ASK_SENTIMENT, structured_outputs={"choice": CHOICES})
    assert (text in CHOICES, reason) == (True, "stop"), text
    assert chat(client, ASK_SENTIMENT, guided_choice=CHOICES) == (text, "stop")
    assert streamed(client, ASK_SENTIMENT, guided_choice=CHOICES) == (text, "stop")


def test_a_regex_answer_matches_the_regex(client: openai.OpenAI) -> None:
    text, reason = chat(client, ASK_DATE, structured_outputs={"regex": DATE})
    assert reason == "stop" and re.fullmatch(DATE, text), text
    assert streamed(client, ASK_DATE, guided_regex=DATE) == (text, "stop")


def test_completions_take_a_grammar(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": 'root ::= " " ("yes" | "no")'}})
    assert out.choices[0].text in (" yes", " no") and out.choices[0].finish_reason == "stop"


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, ASK_PERSON, structured_outputs={"json": {"type": "frob"}})
    body: Any = caught.value.body
    assert body["param"] == "structured_outputs.json"
    assert body["message"] == "the json_schema cannot be compiled: Invalid type: frob"
    with pytest.raises(openai.BadRequestError) as both:
        chat(client, ASK_PERSON, response_format={"type": "json_object"}, guided_regex="a+")
    assert (both.value.body or {})["param"] == "guided_regex"   # type: ignore[index]
