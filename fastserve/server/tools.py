"""A chat request's tools: their OpenAI shapes, ``tool_choice``, and the ``ToolPlan`` that says
what the prompt shows (natively, or written into the system message for a template that does not
read ``tools``) and how the output is read (the forced JSON schema, one parser per choice). Each
check vLLM makes is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastserve.chat_template import ChatOptions, ChatTemplateError
from fastserve.server.tool_parsers import (
    PARSERS,
    ForcedArgumentsParser,
    ForcedArrayParser,
    ToolCallParser,
)
from fastserve.tokenizer import Tokenizer

#: OpenAI's rule for a function name.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
#: vLLM's schema for a function that declares no parameters.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
ToolMode = Literal["none", "auto", "required", "named"]
#: How a tool's result is shown to a model whose template knows no tools (the Hermes convention).
TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


class _Closed(BaseModel):
    """A request part whose every field is known: an unknown one is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Closed):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    #: A JSON schema of the arguments object.
    parameters: dict[str, Any] | None = None
    #: OpenAI's: the arguments follow the schema exactly (only a grammar can promise it).
    strict: bool | None = None


class ToolDefinition(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: FunctionName


class FunctionCallMessage(_Closed):
    name: str
    #: A JSON object as a string, as OpenAI sends it back.
    arguments: str


class ToolCallMessage(_Closed):
    id: str
    type: Literal["function"]
    function: FunctionCallMessage

    def template_call(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments a dict (transformers' convention)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.arguments()}}

    def arguments(self) -> Any:
        raw = self.function.arguments
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ValueError(f"tool call {self.id!r}: arguments are not JSON: {raw[:80]!r}") from None


class ToolRequestError(ValueError):
    """A request's tools or tool_choice refused; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    tools: tuple[ToolDefinition, ...]
    parser_name: str
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` the chat template receives (OpenAI's dicts), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output; None for plain content."""
        max_calls = None if self.parallel else 1
        if self.mode == "named":
            assert self.named is not None
            return ForcedArgumentsParser(self.named)
        if self.mode == "required":
            return ForcedArrayParser(max_calls)
        if self.mode == "auto":
            return PARSERS[self.parser_name](max_calls)
        return None

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is constrained to (vLLM's), None unless forced."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return _parameters(tool)
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        items = [_call_schema(t, defs) for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def fallback_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` for a template that does not read ``tools``: tools in the system message,
        calls in assistant text, results as a user turn in ``<tool_response>`` tags (such a
        template knows no ``tool`` role either)."""
        fmt = PARSERS[self.parser_name]
        out: list[dict[str, Any]] = []
        after_result = False
        for m in messages:
            is_result = m.get("role") == "tool"
            calls = m.get("tool_calls")
            if calls:
                written = fmt.render_calls([c["function"] for c in calls])
                text = m.get("content") or ""
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = f"{text}\n{written}" if text else written
            if is_result:
                result = f"{TOOL_RESPONSE[0]}\n{m.get('content') or ''}\n{TOOL_RESPONSE[1]}"
                if after_result:
                    out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
                    continue
                m = {"role": "user", "content": result}
            out.append(m)
            after_result = is_result
        if not self.tools:
            return out
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.template_tools() or [])
        prompt = f"You can call these functions (JSON schemas):\n<tools>\n{listing}\n</tools>\n{fmt.instructions()}"
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out


#: Text in a chat template that tells its tool-call format; first match wins.
TEMPLATE_FORMAT_HINTS = (("[func_name1(", "pythonic"), ("<tool_call>", "hermes"),
                         ("<|python_tag|>", "llama3_json"))
#: When the template says nothing: Hermes's tags (Qwen 2.5/3, Hermes, SmolLM2 write them).
DEFAULT_TOOL_FORMAT = "hermes"


def resolve_tool_call_parser(configured: str, template_source: str) -> str | None:
    """The configured tool-call format, or (``auto``) the template's; None for ``none``."""
    if configured == "none":
        return None
    if configured != "auto":
        return configured
    return next((name for hint, name in TEMPLATE_FORMAT_HINTS if hint in template_source), DEFAULT_TOOL_FORMAT)


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], options: ChatOptions,
                    plan: ToolPlan) -> list[int]:
    """A conversation's prompt ids with the plan's tools; ``ChatTemplateError`` also for a
    message ``name`` the template cannot show."""
    if not tokenizer.chat_template.may_read_names:
        named = next((i for i, m in enumerate(messages) if m.get("name") is not None), None)
        if named is not None:
            raise ChatTemplateError(f"messages[{named}].name: this model's chat template never reads a "
                                    "message's name; leave it out", f"messages[{named}].name")
    if tokenizer.chat_template.reads_tools:
        return tokenizer.encode_chat(messages, options, plan.template_tools())
    return tokenizer.encode_chat(plan.fallback_messages(messages), options)


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return dict(tool.function.parameters) if tool.function.parameters else dict(NO_PARAMETERS)


def _call_schema(tool: ToolDefinition, defs: dict[str, Any]) -> dict[str, Any]:
    """One item of ``required``'s array; ``$defs`` move to the top, as vLLM."""
    params = _parameters(tool)
    for name, schema in params.pop("$defs", {}).items():
        if defs.get(name, schema) != schema:
            raise ToolRequestError(f"tools define '$defs/{name}' twice, differently", "tools")
        defs[name] = schema
    return {"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"]}


def tool_plan(tools: Sequence[ToolDefinition] | None,
              tool_choice: str | NamedToolChoice | None,
              parallel_tool_calls: bool | None, parser_name: str | None) -> ToolPlan:
    """The request's ``ToolPlan`` (``parser_name`` None: calls not parsed); ``ToolRequestError``."""
    tools = tuple(tools or ())
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tools name a function twice", "tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    mode: ToolMode = "named" if named is not None else choice   # type: ignore[assignment]
    if mode != "none" and not tools:
        raise ToolRequestError(f"tool_choice {_shown(choice)} needs tools", "tool_choice")
    if named is not None and named not in names:
        raise ToolRequestError(f"tool_choice names the function '{named}', which tools do not define",
                               "tool_choice")
    if mode == "auto" and parser_name is None:
        raise ToolRequestError('tool_choice "auto" needs a tool-call parser: this server has none '
                               "(server.tool_call_parser)", "tool_choice")
    strict = [i for i, t in enumerate(tools) if t.function.strict]
    if strict and mode == "auto":
        raise ToolRequestError(f'tools[{strict[0]}].function.strict: true is only kept under tool_choice '
                               '"required" or a named function (a grammar forces the arguments); '
                               '"auto" cannot promise it', f"tools[{strict[0]}].function.strict")
    return ToolPlan(mode, tools, parser_name or DEFAULT_TOOL_FORMAT, named,
                    True if parallel_tool_calls is None else parallel_tool_calls)


def _shown(choice: str | NamedToolChoice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())


def template_message(role: str, content: str, name: str | None,
                     tool_calls: Sequence[ToolCallMessage] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """A message as chat templates read it, optional keys only when given."""
    out: dict[str, Any] = {"role": role, "content": content}
    extra: Mapping[str, Any] = {"name": name, "tool_call_id": tool_call_id,
                                "tool_calls": [c.template_call() for c in tool_calls] if tool_calls else None}
    out.update({k: v for k, v in extra.items() if v is not None})
    return out
