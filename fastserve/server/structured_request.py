"""Structured outputs on the wire: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
its older ``guided_*`` fields, read into one ``OutputConstraint`` or refused with a 400 naming the
field. Two constraints are refused even when they agree (the client has a bug to know of); the
grammar engine checks the payload here, before the request reaches an engine.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastserve.structured import GrammarError, check_constraint
from fastserve.worker.messages import OutputConstraint, SamplingParams

#: ``guided_decoding_backend`` values we accept: there is one engine, and "auto" picks it.
ACCEPTED_BACKENDS = ("auto", "guidance", "llguidance")


class ConstraintError(ValueError):
    """A constraint field that cannot be honoured; ``param`` names it for the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``; enforced whatever ``strict`` says, as vLLM."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``): exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    #: Refused unless null: the engine has its own JSON whitespace rule (``any_whitespace``).
    whitespace_pattern: None = None
    #: Refused unless null (tool-call tags are the tool parser's, ``tool_choice``).
    structural_tag: None = None


def request_constraint(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
                       guided: dict[str, Any]) -> OutputConstraint | None:
    """The one constraint a request asks for (None: free text); ``guided`` holds ``guided_*`` by name."""
    found: list[tuple[str, OutputConstraint]] = []
    if response_format is not None:
        rf = _from_response_format(response_format)
        if rf is not None:
            found.append(("response_format", rf))
    if structured is not None:
        found.extend(_from_structured_outputs(structured))
    found.extend(_from_guided(guided))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(f"the output can follow one constraint, but {names} each set one; send one of them",
                              found[1][0])
    if not found:
        return None
    name, constraint = found[0]
    try:
        constraint.validate()
        check_constraint(constraint)
    except (ValueError, GrammarError) as exc:
        raise ConstraintError(str(exc), name) from None
    return constraint


def constrained(sampling: SamplingParams, constraint: OutputConstraint, param: str) -> SamplingParams:
    """``sampling`` held to ``constraint`` set by field ``param``; ``ConstraintError`` if one is set."""
    if sampling.constraint is not None and sampling.constraint != constraint:
        raise ConstraintError(f"{param} constrains the output, and so does another field "
                              f"({sampling.constraint.kind}); send one of them", param)
    return replace(sampling, constraint=constraint)


def _from_response_format(rf: ResponseFormat) -> OutputConstraint | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return OutputConstraint.json_object()
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise ConstraintError("response_format of type json_schema needs json_schema.schema (the JSON schema "
                              "the output must follow)", "response_format")
    return OutputConstraint.json_schema(rf.json_schema.json_schema)


def _from_structured_outputs(so: StructuredOutputs) -> list[tuple[str, OutputConstraint]]:
    found: list[tuple[str, OutputConstraint]] = []
    any_ws = not so.disable_any_whitespace
    if so.json_ is not None:
        schema = _schema("structured_outputs.json", so.json_)
        if so.disable_additional_properties:
            schema = closed_objects(schema)
        found.append(("structured_outputs.json", OutputConstraint.json_schema(schema, any_ws)))
    if so.regex is not None:
        found.append(("structured_outputs.regex", OutputConstraint.regex(so.regex)))
    if so.choice is not None:
        found.append(("structured_outputs.choice", OutputConstraint.choice(so.choice)))
    if so.grammar is not None:
        found.append(("structured_outputs.grammar", OutputConstraint.grammar(so.grammar)))
    if so.json_object:
        found.append(("structured_outputs.json_object", OutputConstraint.json_object(any_ws)))
    if not found:
        raise ConstraintError("structured_outputs must set one of json, regex, choice, grammar or json_object",
                              "structured_outputs")
    return found


def _from_guided(guided: dict[str, Any]) -> list[tuple[str, OutputConstraint]]:
    found: list[tuple[str, OutputConstraint]] = []
    if guided.get("guided_json") is not None:
        found.append(("guided_json", OutputConstraint.json_schema(_schema("guided_json", guided["guided_json"]))))
    if guided.get("guided_regex") is not None:
        found.append(("guided_regex", OutputConstraint.regex(guided["guided_regex"])))
    if guided.get("guided_choice") is not None:
        found.append(("guided_choice", OutputConstraint.choice(guided["guided_choice"])))
    if guided.get("guided_grammar") is not None:
        found.append(("guided_grammar", OutputConstraint.grammar(guided["guided_grammar"])))
    return found


def _schema(param: str, value: dict[str, Any] | bool | str) -> dict[str, Any] | bool:
    """A schema sent as an object, or as JSON text (vLLM accepts both)."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(parsed, dict | bool):
        raise ConstraintError(f"{param} must be a JSON schema (an object), got {type(parsed).__name__}", param)
    return parsed


def closed_objects(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """vLLM's ``disable_additional_properties``: ``false`` where an object lists properties only."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
            if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
                node["additionalProperties"] = False
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(out)
    return out
