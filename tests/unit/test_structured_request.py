"""Structured-output request fields at the HTTP layer (``fastserve.server.structured_request``
through ``OpenAIServer`` over a scripted backend, no Ray, no model): each way of asking reaches
the job's ``SamplingParams.constraint`` as one ``OutputConstraint``, and a malformed or second
constraint is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastserve.scheduler.job import Finish, TokenDelta
from fastserve.worker.messages import OutputConstraint
from tests.harness.http_backends import MODEL, STATS, ScriptedBackend, post

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def backend() -> ScriptedBackend:
    """Answers every job with one token and a finish."""
    return ScriptedBackend(lambda req: [TokenDelta(req.job_id, (5,), Finish("length", STATS))])


def body(chat: bool, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 5}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    base.update(fields)
    return base


def constraint_of(chat: bool, **fields: Any) -> OutputConstraint | None:
    server = backend()
    resp = post(server, CHAT if chat else CMPL, body(chat, **fields))
    assert resp.status_code == 200, resp.json()
    return server.requests[0].sampling.constraint


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, OutputConstraint("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     OutputConstraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, OutputConstraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, OutputConstraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, OutputConstraint("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, OutputConstraint("choice", choices=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, OutputConstraint("grammar", 'start: "a"+')),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     OutputConstraint("json_object", any_whitespace=False)),
    ({"guided_json": SCHEMA}, OutputConstraint.json_schema(SCHEMA)),
    ({"guided_regex": "a+"}, OutputConstraint("regex", "a+")),
    ({"guided_choice": ["x", "y"], "guided_decoding_backend": "auto"}, OutputConstraint("choice", choices=("x", "y"))),
    ({"guided_grammar": "root ::= \"a\""}, OutputConstraint("grammar", "root ::= \"a\"")),
])
def test_each_way_of_asking_reaches_the_jobs_sampling(chat: bool, fields: dict[str, Any],
                                                       expected: OutputConstraint | None) -> None:
    assert constraint_of(chat, **fields) == expected


def test_equal_schemas_are_equal_constraints_whatever_their_key_order() -> None:
    reordered = {"required": ["name", "age"], "properties": SCHEMA["properties"], "type": "object"}
    assert OutputConstraint.json_schema(reordered) == OutputConstraint.json_schema(SCHEMA)
    assert hash(OutputConstraint.json_schema(reordered)) == hash(OutputConstraint.json_schema(SCHEMA))


def test_disable_additional_properties_closes_every_listed_object() -> None:
    nested = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    got = constraint_of(True, structured_outputs={"json": nested, "disable_additional_properties": True})
    assert got is not None
    schema = json.loads(got.spec)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["inner"]["additionalProperties"] is False


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "the output can follow one constraint, but response_format, guided_regex each set one; send one of them"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "the output can follow one constraint, but structured_outputs.regex, structured_outputs.choice each set one; "
     "send one of them"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format of type json_schema needs json_schema.schema (the JSON schema the output must follow)"),
    ({"structured_outputs": {}}, "structured_outputs",
     "structured_outputs must set one of json, regex, choice, grammar or json_object"),
    ({"guided_choice": []}, "guided_choice", "a choice constraint needs a non-empty list of non-empty strings, got []"),
    ({"guided_regex": ""}, "guided_regex", "a regex constraint needs a non-empty regex"),
    ({"guided_json": "{not json"}, "guided_json",
     "guided_json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"guided_json": "[1]"}, "guided_json", "guided_json must be a JSON schema (an object), got list"),
    ({"guided_grammar": "start: foo"}, "guided_grammar",
     'the grammar cannot be compiled: at 1(8): unknown name: "foo"\n   1 | start: foo\n              ^\n'),
    ({"structured_outputs": {"json": {"type": "frob"}}}, "structured_outputs.json",
     "the json_schema cannot be compiled: Invalid type: frob"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens",
     "min_tokens cannot be honoured with structured outputs: the grammar decides where the output ends"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend",
     "guided_decoding_backend 'xgrammar' is not available: this server's grammar engine is llguidance "
     "(send one of ['auto', 'guidance', 'llguidance'] or leave it out)"),
])
@pytest.mark.parametrize("chat", [False, True])
def test_a_malformed_or_second_constraint_is_a_400_naming_it(chat: bool, fields: dict[str, Any], param: str,
                                                              message: str) -> None:
    server = backend()
    resp = post(server, CHAT if chat else CMPL, body(chat, **fields))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["message"]) == (param, message)
    assert server.requests == []


@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs.frobnicate"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_options_we_do_not_honour_are_refused(fields: dict[str, Any], param: str) -> None:
    resp = post(backend(), CHAT, body(True, **fields))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
