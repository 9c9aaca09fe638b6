"""Chat prompts: a model's own Jinja chat template, rendered as transformers renders it.

`ChatTemplate` compiles a template in the sandboxed environment of transformers 5.x's
``apply_chat_template`` (same options, extensions, filters and globals) and renders with the same
variables; the text holds the template's specials, so it is encoded without adding them again.
`OPT_FALLBACK` is our plain format for models with no template. Plain ``jinja2``, not
transformers: that imports torch, which the CPU-only ingress never loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ASSISTANT_ROLE",
    "DEFAULT_CHAT_OPTIONS",
    "OPT_FALLBACK",
    "SYSTEM_ROLE",
    "USER_ROLE",
    "ChatOptions",
    "ChatTemplate",
    "ChatTemplateError",
    "apply_chat_template",
]

SYSTEM_ROLE = "system"
USER_ROLE = "user"
ASSISTANT_ROLE = "assistant"

#: What a template may raise while rendering a conversation it does not accept.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)


class ChatTemplateError(ValueError):
    """A conversation the template refuses or cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


#: Names the renderer passes itself: a ``chat_template_kwargs`` key may not replace them.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat request fields, with its defaults."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: The tokenizer's specials (BOS) on top of what the template writes.
    add_special_tokens: bool = False

    def check(self, special_tokens: Mapping[str, str]) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true",
                                    "continue_final_message")
        taken = sorted(set(self.template_kwargs) & (_RESERVED_VARIABLES | set(special_tokens)))
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set '{taken[0]}': the server passes it",
                                    "chat_template_kwargs")


DEFAULT_CHAT_OPTIONS = ChatOptions()


def continue_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``rendered`` cut after the final message's text, as transformers' ``continue_final_message``."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text to continue")
    stripped = final.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final "
                                "message's text into the prompt")
    kept = final.lstrip()
    end = at + (len(kept) if rendered[at:at + len(kept)] == kept else len(stripped))
    return rendered[:end]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}``: transformers' training-mask tag; a prompt just emits the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # noqa: N805 (Jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attribute {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


def _reads_key(tree: jinja2.nodes.Template, key: str) -> bool:
    """Whether any expression reads ``key``: ``x.key``, ``x['key']`` or ``x.get('key')``."""
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Call)):
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            return True
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == key:
            return True
        if isinstance(node, jinja2.nodes.Call) and node.args and isinstance(node.args[0], jinja2.nodes.Const) \
                and node.args[0].value == key:
            return True
    return False


class ChatTemplate:
    """A model's chat template, compiled once; `render` is thread-safe (jinja2 templates are)."""

    add_special_tokens = False
    #: Whether it reads ``tools`` / a message's ``name`` (else those go unseen).
    reads_tools = False
    may_read_names = False

    def __init__(self, source: str, special_tokens: Mapping[str, str], *, origin: Path | None = None) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens)
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            where = f" in {origin}" if origin is not None else ""
            raise ValueError(f"chat template{where} does not compile: {exc.message} "
                             f"(line {exc.lineno})") from None
        tree = _ENV.parse(source)
        self.reads_tools = "tools" in jinja2.meta.find_undeclared_variables(tree)
        self.may_read_names = _reads_key(tree, "name")

    def render(self, messages: Sequence[Mapping[str, Any]],
               options: ChatOptions = DEFAULT_CHAT_OPTIONS,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The text ``apply_chat_template(..., tokenize=False)`` gives; raises `ChatTemplateError`."""
        options.check(self._special_tokens)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            text = self._template.render(messages=chat, tools=list(tools) if tools else None, documents=None,
                                         add_generation_prompt=options.add_generation_prompt,
                                         **self._special_tokens, **options.template_kwargs)
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(f"the model's chat template refused these messages: "
                                    f"{type(exc).__name__}: {exc}") from None
        return continue_final_message(text, chat) if options.continue_final_message else text


_ROLE_PREFIX: dict[str, str] = {
    SYSTEM_ROLE: "System:",
    USER_ROLE: "User:",
    ASSISTANT_ROLE: "Assistant:",
}
_TURN_SEPARATOR = "\n"
_GENERATION_PROMPT = _ROLE_PREFIX[ASSISTANT_ROLE]


def apply_chat_template(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """Our format for models without a template: ``"<Role>: <content>"`` lines, system first,
    then ``"Assistant:"`` (no trailing space: the first token carries its own)."""
    system_lines: list[str] = []
    turn_lines: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        if role not in _ROLE_PREFIX:
            raise ChatTemplateError(f"message {index}: unsupported role {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {index}: content must be a string")
        text = content.strip()
        line = f"{_ROLE_PREFIX[role]} {text}" if text else _ROLE_PREFIX[role]
        (system_lines if role == SYSTEM_ROLE else turn_lines).append(line)
    prompt = [_GENERATION_PROMPT] if add_generation_prompt else []
    return _TURN_SEPARATOR.join([*system_lines, *turn_lines, *prompt])


class _FallbackTemplate(ChatTemplate):
    add_special_tokens = True

    def __init__(self) -> None:
        self.source = ""
        self._special_tokens = {}

    def render(self, messages: Sequence[Mapping[str, Any]],
               options: ChatOptions = DEFAULT_CHAT_OPTIONS,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        options.check(self._special_tokens)
        text = apply_chat_template(messages, options.add_generation_prompt)
        return continue_final_message(text, messages) if options.continue_final_message else text


OPT_FALLBACK: ChatTemplate = _FallbackTemplate()
