"""Tool-call parsers: a model's output split into content and OpenAI ``tool_calls``, whole or streamed.

``ToolCallParser`` (one per choice) releases on each ``push`` what may be sent now; its formats go by
vLLM's ``--tool-call-parser`` names (``PARSERS``), plus the shapes the grammar forces for
``tool_choice`` required and named. ``parse`` feeds a parser at once, so whole and streamed answers agree.
Our own rather than vLLM's, which are bound to vLLM's request and delta classes and re-parse the whole
text at every token: one character-level scanner here serves both and never retracts what it sent.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "PARSERS",
    "CallDelta",
    "ForcedArgumentsParser",
    "ForcedArrayParser",
    "HermesParser",
    "Llama3JsonParser",
    "ParsedDelta",
    "PythonicParser",
    "ToolCall",
    "ToolCallParser",
    "parse",
]

#: The length of the random part of a call id (OpenAI's ids are ``call_`` + 24 characters).
CALL_ID_CHARS = 24
_WS = " \t\r\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:CALL_ID_CHARS]


@dataclass
class ToolCall:
    """One parsed call: OpenAI's ``{"id", "type": "function", "function": {name, arguments}}``."""

    id: str
    name: str
    arguments: str = ""

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A streamed piece of call ``index``: its header (``name`` set: first delta only) and/or a
    fragment of its arguments."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def wire(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What one ``push`` (or ``finish``) releases: content text and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


# ---- the base: content, calls, whitespace ---------------------------------------------------

class ToolCallParser:
    """Content and calls of one choice's output, fed in pieces. A call is sent once its name is
    whole (arguments read before it wait for it); its arguments are the JSON text as written;
    whitespace next to a call is not content; calls past ``max_calls`` are not returned
    (``parallel_tool_calls: false``, as vLLM). A format implements ``_feed`` (and ``_flush``
    for what it holds at the end) through ``_outside`` (content), ``_open_call``,
    ``_call_args`` and ``_close_call``."""

    #: Text the format marks calls with (the tokenizer must not drop it as a special token).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls: list[ToolCall] = []
        self._max_calls = max_calls
        self._out = ParsedDelta()
        self._ws = ""                 # trailing whitespace of the content, held
        self._ws_after_call = False   # a call came last: whitespace now is never content
        self._gap = ""                # whitespace between content and the calls after it
        self._open = False            # a call is open (its arguments are being read)
        self._dropping = False        # the open call is past max_calls
        self._sent_content = False

    def push(self, text: str) -> ParsedDelta:
        if text:
            self._feed(text)
        return self._take()

    def finish(self) -> ParsedDelta:
        self._flush()
        if self._open:
            self._close_call()
        if not self.calls:
            self._emit_content(self._ws)
        self._ws = ""
        return self._take()

    @property
    def called(self) -> bool:
        return bool(self.calls)

    # -- for the formats --

    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Release what the format holds at the end of the output."""

    def _outside(self, text: str) -> None:
        """Text outside any call: content, its trailing whitespace held until more content
        follows (dropped if a call follows)."""
        if self._ws_after_call:
            text = text.lstrip(_WS)
        if not text:
            return
        body = text.rstrip(_WS)
        if not body:
            self._ws += text
            return
        self._emit_content((self._gap if self._ws_after_call else self._ws) + body)
        self._ws, self._gap = text[len(body):], ""
        self._ws_after_call = False

    def _open_call(self, name: str) -> None:
        if self._sent_content and not self._gap:
            self._gap = self._ws
        self._ws, self._ws_after_call = "", True
        self._open = True
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            self._dropping = True
            return
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        self._out.calls.append(CallDelta(len(self.calls) - 1, "", name, call.id))

    def _call_args(self, text: str) -> None:
        if not text or self._dropping or not self._open:
            return
        self.calls[-1].arguments += text
        index = len(self.calls) - 1
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == index:
            last.arguments += text
        else:
            self._out.calls.append(CallDelta(index, text))

    def _close_call(self) -> None:
        self._open = self._dropping = False
        self._ws, self._ws_after_call = "", True

    def _emit_content(self, text: str) -> None:
        self._out.content += text
        self._sent_content = self._sent_content or bool(text)

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out


def parse(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (the non-streamed response)."""
    first = parser.push(text)
    last = parser.finish()
    return first.content + last.content, parser.calls


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may be cut mid-marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---- a JSON call object, read a character at a time ----------------------------------------

_PRIMITIVE = frozenset("+-.0123456789eEtrufalsn")
#: What may come next in each state outside keys and values (whitespace aside).
_EXPECTED = {"start": "{", "key_or_end": '"}', "next_key": '"', "colon": ":", "after": ",}"}


class _JsonCall:
    """One ``{"name": <string>, <args key>: <value>, ...}`` object: its name once read, the raw
    text of its arguments value as it comes (``take_args``), whether it closed or broke.

    A structural scanner (strings, escapes, nesting), not a validator: the arguments are sent
    as the model wrote them, so they cannot wait for the object to end.
    """

    def __init__(self, args_keys: Sequence[str]) -> None:
        self.args_keys = tuple(args_keys)
        self.raw: list[str] = []
        self.name: str | None = None
        self.has_args = False
        self.done = False
        self.error = False
        self._args: list[str] = []
        self._state = "start"
        self._key: list[str] = []
        self._value_key: str | None = None
        self._value: list[str] = []
        self._nest = 0
        self._in_str = self._esc = False
        self._primitive = False

    def take_args(self) -> str:
        out = "".join(self._args)
        self._args.clear()
        return out

    def feed(self, text: str, start: int) -> int:
        """Read ``text`` from ``start`` until the object ends or breaks; the index after the
        last character read (a broken object does not read the offending character)."""
        i = start
        while i < len(text) and not (self.done or self.error):
            if self._step(text[i]):
                self.raw.append(text[i])
                i += 1
        return i

    def _step(self, ch: str) -> bool:
        """One character; False when it is not part of the object (it ends a primitive and
        is read again, or it breaks the object)."""
        if self._state == "value":
            return self._value_step(ch)
        if self._state == "key":
            return self._key_step(ch)
        if ch in _WS:
            return True
        if self._state == "value_start":
            self._begin_value(ch)
            return not self.error
        if ch not in _EXPECTED[self._state]:
            self.error = True
            return False
        if ch == "}":
            self.done = True
        elif ch == "{":
            self._state = "key_or_end"
        elif ch == '"':
            self._key, self._state = ['"'], "key"
        elif ch == ":":
            self._state = "value_start"
        elif ch == ",":
            self._state = "next_key"
        return True

    def _key_step(self, ch: str) -> bool:
        self._key.append(ch)
        if self._esc:
            self._esc = False
        elif ch == "\\":
            self._esc = True
        elif ch == '"':
            try:
                self._value_key = json.loads("".join(self._key))
            except ValueError:
                self.error = True
                return False
            self._state = "colon"
        return True

    def _begin_value(self, ch: str) -> None:
        if ch not in '{["' and ch not in _PRIMITIVE:
            self.error = True
            return
        self._state = "value"
        self._value = []
        self._primitive = ch in _PRIMITIVE
        self._nest = 0
        self._in_str = self._esc = False
        if self._value_key in self.args_keys:
            if self.has_args:   # both "arguments" and "parameters"
                self.error = True
                return
            self.has_args = True
        self._value_step(ch)

    def _value_step(self, ch: str) -> bool:
        if self._primitive and ch not in _PRIMITIVE:
            self._end_value()
            return False
        self._value.append(ch)
        if self._value_key in self.args_keys:
            self._args.append(ch)
        if self._primitive:
            return True
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._nest == 0:
                    self._end_value()
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._nest += 1
        elif ch in "}]":
            self._nest -= 1
            if self._nest == 0:
                self._end_value()
        return True

    def _end_value(self) -> None:
        self._state = "after"
        if self._value_key == "name":
            try:
                name = json.loads("".join(self._value))
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.error = True
                return
            self.name = name


class _JsonObjectParser(ToolCallParser):
    """A format whose calls are JSON objects, each streamed as read (header, then arguments)."""

    args_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    initial_state: ClassVar[str]
    #: Format text before the object that is content again when no call follows.
    call_prefix: ClassVar[str] = ""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._state = self.initial_state
        self._pending = ""
        self._call: _JsonCall | None = None
        self._sent_open = False

    def _advance_call(self, call: _JsonCall, buf: str, i: int) -> int:
        i = call.feed(buf, i)
        if call.name is not None and not self._sent_open:
            self._open_call(call.name)
            self._sent_open = True
        if self._sent_open:
            self._call_args(call.take_args())
        return i

    def _flush(self) -> None:
        if self._call is not None and not self._sent_open:
            self._outside(self.call_prefix + "".join(self._call.raw))
        self._call = None
        if self._pending:
            self._outside(self._pending)
            self._pending = ""


class _JsonCallsParser(_JsonObjectParser):
    """Outputs that are JSON call objects one after another: an optional ``leader`` token, an
    optional ``opener`` (``[``), objects separated by ``separator``, an optional ``closer``;
    whatever follows, or an output that does not start so, is content."""

    leader: ClassVar[str | None] = None
    opener: ClassVar[str | None] = None
    separator: ClassVar[str] = ";"
    closer: ClassVar[str | None] = None
    initial_state = "lead"

    def _feed(self, text: str) -> None:
        buf, self._pending = self._pending + text, ""
        i = 0
        while i < len(buf):
            if self._state == "plain":
                self._outside(buf[i:])
                return
            if self._state == "lead":
                i = self._lead(buf, i)
                if i < 0:
                    return
            elif self._state == "call":
                i = self._read_call(buf, i)
            else:   # between calls: a separator, the closer, or the end of the calls
                i = self._between(buf, i)

    def _lead(self, buf: str, i: int) -> int:
        """Decide whether the output is calls; -1 when it cannot be told yet (text held)."""
        rest = buf[i:].lstrip(_WS)
        start = len(buf) - len(rest)
        if self.leader and rest.startswith(self.leader):
            rest = rest[len(self.leader):].lstrip(_WS)
            start = len(buf) - len(rest)
        wanted = self.opener or "{"
        if not rest or (self.leader and self.leader.startswith(rest) and rest != self.leader):
            self._pending = buf[i:]
            return -1
        if not rest.startswith(wanted):
            self._state = "plain"
            return i
        self._state = "call"
        return start + (len(self.opener) if self.opener else 0)

    def _read_call(self, buf: str, i: int) -> int:
        if self._call is None:
            while i < len(buf) and buf[i] in _WS:
                i += 1
            if i == len(buf):
                return i
            self._call, self._sent_open = _JsonCall(self.args_keys), False
        call = self._call
        i = self._advance_call(call, buf, i)
        if call.done or call.error:
            self._end_call(call)
        return i

    def _end_call(self, call: _JsonCall) -> None:
        self._call = None
        if not self._sent_open:   # never a call: what was read is content
            self._state = "plain"
            self._outside("".join(call.raw))
            return
        if call.done and not call.has_args:
            self._call_args("{}")
        self._close_call()
        self._state = "between" if call.done else "plain"

    def _between(self, buf: str, i: int) -> int:
        while i < len(buf) and buf[i] in _WS:
            i += 1
        if i == len(buf):
            return i
        if buf[i] == self.separator:
            self._state = "call"
            return i + 1
        if self.closer is not None and buf[i] == self.closer:
            self._state = "plain"
            return i + 1
        self._state = "plain"
        return i

    @classmethod
    def render_calls(cls, calls: Iterable[Mapping[str, Any]]) -> str:
        """Calls (``{"name", "arguments": dict}``) written as this format writes them."""
        key = cls.args_keys[0]
        objects = [json.dumps({"name": c["name"], key: c["arguments"]}, ensure_ascii=False) for c in calls]
        return (cls.opener or "") + f"{cls.separator} ".join(objects) + (cls.closer or "")


class Llama3JsonParser(_JsonCallsParser):
    """vLLM's ``llama3_json``: ``{"name": ..., "parameters": {...}}; {...}``."""

    leader = "<|python_tag|>"
    markers = ("<|python_tag|>",)

    @classmethod
    def instructions(cls) -> str:
        return ('To call functions, answer only with one JSON object per call, '
                '{"name": <function name>, "parameters": <arguments object>}, separated by "; ".')


class ForcedArrayParser(_JsonCallsParser):
    """The output ``tool_choice: required`` forces: ``[{"name": ..., "parameters": {...}}, ...]``."""

    opener = "["
    separator = ","
    closer = "]"


# ---- hermes ---------------------------------------------------------------------------------

class HermesParser(_JsonObjectParser):
    """vLLM's ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    markers = (OPEN, CLOSE)
    args_keys = ("arguments", "parameters")
    initial_state = "outside"
    call_prefix = OPEN

    def _feed(self, text: str) -> None:
        buf, self._pending = self._pending + text, ""
        i = 0
        while i < len(buf):
            if self._state == "outside":
                i = self._outside_text(buf, i)
            elif self._state == "call":
                i = self._read_call(buf, i)
            else:
                i = self._after_call(buf, i)

    def _outside_text(self, buf: str, i: int) -> int:
        at = buf.find(self.OPEN, i)
        if at < 0:
            keep = _marker_prefix(buf[i:], self.OPEN)
            self._outside(buf[i:len(buf) - keep])
            self._pending = buf[len(buf) - keep:]
            return len(buf)
        self._outside(buf[i:at])
        self._state = "call"
        self._call, self._sent_open = _JsonCall(self.args_keys), False
        return at + len(self.OPEN)

    def _read_call(self, buf: str, i: int) -> int:
        call = self._call
        assert call is not None
        i = self._advance_call(call, buf, i)
        if call.done or call.error:
            self._call = None
            if not self._sent_open:
                self._state = "outside"
                self._outside(self.call_prefix + "".join(call.raw))
            else:
                if call.done and not call.has_args:
                    self._call_args("{}")
                self._state = "after" if call.done else "outside"
                if call.error:
                    self._close_call()
        return i

    def _after_call(self, buf: str, i: int) -> int:
        """After a call's object: whitespace, then its closing tag (or anything else: the tag
        was left out)."""
        while i < len(buf) and buf[i] in _WS:
            i += 1
        rest = buf[i:]
        if rest.startswith(self.CLOSE):
            self._close_call()
            self._state = "outside"
            return i + len(self.CLOSE)
        if rest and self.CLOSE.startswith(rest):
            self._pending = rest
            return len(buf)
        if rest:
            self._close_call()
            self._state = "outside"
        return i

    @classmethod
    def render_calls(cls, calls: Iterable[Mapping[str, Any]]) -> str:
        return "\n".join(f"{cls.OPEN}\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                      ensure_ascii=False) + f"\n{cls.CLOSE}" for c in calls)

    @classmethod
    def instructions(cls) -> str:
        return (f"To call a function, answer with one {cls.OPEN}...{cls.CLOSE} block per call, holding "
                '{"name": <function name>, "arguments": <arguments object>}.')


# ---- pythonic -------------------------------------------------------------------------------

class _PythonicError(ValueError):
    pass


_NAMED_CONSTANTS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A Python literal's value, JSON-shaped (tuples as lists); anything that is not a literal
    (a name, a call, an operator) is refused: nothing is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _PythonicError("** in a dict")
        keys = [_literal(k) for k in node.keys if k is not None]
        if not all(isinstance(k, str) for k in keys):
            raise _PythonicError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _PythonicError(f"{type(node).__name__} is not a literal")


def _keyword(segment: str) -> tuple[str, Any] | None:
    """``name=value`` read with ``ast`` (None for an empty segment: ``f()`` or a trailing comma)."""
    if not segment.strip(_WS):
        return None
    try:
        tree = ast.parse(f"_({segment})", mode="eval")
    except SyntaxError as exc:
        raise _PythonicError(str(exc)) from None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
        raise _PythonicError("not one keyword argument")
    return call.keywords[0].arg, _literal(call.keywords[0].value)


class _ArgumentScanner:
    """Finds the ``,`` or ``)`` that ends a call's next argument, outside Python strings and
    brackets, in text that arrives in pieces; it resumes where it stopped, so a long argument
    is scanned once, not once per piece."""

    def __init__(self) -> None:
        self.text = ""
        self._pos = 0
        self._nest = 0
        self._quote = ""    # the open string's quote ('' outside strings)

    def end(self) -> int | None:
        """Index in ``text`` of the argument's end; None until it has come."""
        t, i = self.text, self._pos
        while i < len(t):
            ch = t[i]
            if self._quote:
                if ch == "\\":
                    if i + 1 == len(t):
                        break
                    i += 2
                elif t.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = ""
                elif self._quote.startswith(t[i:]):   # maybe the start of a closing triple quote
                    break
                else:
                    i += 1
                continue
            if ch in "'\"":
                if t.startswith(ch * 3, i):
                    self._quote = ch * 3
                elif (ch * 3).startswith(t[i:]):   # one or two quotes so far: "" or """?
                    break
                else:
                    self._quote = ch
                i += len(self._quote)
                continue
            if ch in ")]}" and self._nest == 0:
                if ch != ")":
                    raise _PythonicError(f"unbalanced {ch!r}")
                self._pos = i
                return i
            if ch == "," and self._nest == 0:
                self._pos = i
                return i
            self._nest += 1 if ch in "([{" else -1 if ch in ")]}" else 0
            i += 1
        self._pos = i
        return None

    def cut(self, end: int) -> None:
        """Drop the argument before ``end`` and its terminator: scan the next one."""
        self.text = self.text[end + 1:]
        self._pos, self._nest, self._quote = 0, 0, ""

    def take(self) -> str:
        """What is left, and start afresh."""
        rest = self.text
        self.cut(len(rest))
        return rest


def _is_function_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


class PythonicParser(ToolCallParser):
    """vLLM's ``pythonic``: ``[get_weather(city="Paris"), f(x=1)]``; each keyword argument is
    sent as JSON once it is whole."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._state = "lead"
        self._held = ""     # raw text not yet known to be calls
        self._name = ""
        self._scanner = _ArgumentScanner()
        self._args = 0      # keyword arguments sent for the open call

    def _feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self._state == "plain":
                self._outside(text[i:])
                return
            i = {"lead": self._in_lead, "name": self._in_name, "args": self._in_args,
                 "between": self._in_between}[self._state](text, i)

    def _in_lead(self, buf: str, i: int) -> int:
        """Leading whitespace, then ``[`` (calls) or anything else (content)."""
        while i < len(buf) and buf[i] in _WS:
            self._held += buf[i]
            i += 1
        if i == len(buf):
            return i
        if buf[i] != "[":
            self._not_calls()
            return i
        self._held += "["
        self._state = "name"
        return i + 1

    def _in_name(self, buf: str, i: int) -> int:
        """A call's name up to its ``(``; anything else is no call: content."""
        while i < len(buf):
            ch = buf[i]
            if ch == "(" and _is_function_name(self._name):
                self._open_call(self._name)
                self._state, self._held, self._name, self._args = "args", "", "", 0
                return i + 1
            if not (ch.isalnum() or ch in "_." or (ch in _WS and not self._name)):
                self._not_calls()
                return i
            self._held += ch
            self._name += ch.strip(_WS)
            i += 1
        return i

    def _not_calls(self) -> None:
        self._state = "plain"
        self._outside(self._held)
        self._held = self._name = ""

    def _in_args(self, buf: str, i: int) -> int:
        """Keyword arguments, each sent once whole, up to the call's ``)``."""
        scan = self._scanner
        scan.text += buf[i:]
        while True:
            try:
                end = scan.end()
                if end is None:
                    return len(buf)
                kw = _keyword(scan.text[:end])
            except _PythonicError:   # the call ends with its whole arguments; the rest is content
                self._close_open_call()
                self._state = "plain"
                self._outside(scan.take())
                return len(buf)
            closing = scan.text[end] == ")"
            scan.cut(end)
            if kw is not None:
                sep = "{" if self._args == 0 else ", "
                self._call_args(sep + json.dumps(kw[0], ensure_ascii=False) + ": "
                                + json.dumps(kw[1], ensure_ascii=False))
                self._args += 1
            if closing:
                self._close_open_call()
                self._state = "between"
                return len(buf) - len(scan.take())

    def _close_open_call(self) -> None:
        self._call_args("}" if self._args else "{}")
        self._close_call()

    def _in_between(self, buf: str, i: int) -> int:
        """After a call: ``,`` and the next call, ``]`` and the end of the calls, or content."""
        while i < len(buf) and buf[i] in _WS:
            i += 1
        if i == len(buf):
            return i
        if buf[i] == ",":
            self._state, self._held = "name", ","
            return i + 1
        self._state = "plain"
        return i + 1 if buf[i] == "]" else i

    def _flush(self) -> None:
        if self._state == "args" and self._open:
            self._close_open_call()   # the output ended inside a call: keep its whole arguments
            self._scanner.take()
        elif self._state in ("lead", "name"):
            self._outside(self._held)
        self._held = ""

    @classmethod
    def render_calls(cls, calls: Iterable[Mapping[str, Any]]) -> str:
        def call(c: Mapping[str, Any]) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in dict(c["arguments"]).items())
            return f"{c['name']}({args})"

        return "[" + ", ".join(call(c) for c in calls) + "]"

    @classmethod
    def instructions(cls) -> str:
        return ("To call functions, answer only with a Python list of calls with keyword arguments, "
                "[func_name(arg_name=value, ...), ...].")


# ---- a named tool_choice: the output is the arguments --------------------------------------

class ForcedArgumentsParser(ToolCallParser):
    """The output a named ``tool_choice`` forces: the function's arguments object, the whole
    output (surrounding whitespace aside)."""

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self._name = name
        self._ws_args = ""
        self._started = False

    def _feed(self, text: str) -> None:
        if not self.calls:
            self._open_call(self._name)
        text = self._ws_args + text
        if not self._started:
            text = text.lstrip(_WS)
        body = text.rstrip(_WS)
        self._ws_args = text[len(body):]
        if body:
            self._started = True
            self._call_args(body)

    def _flush(self) -> None:
        if not self.calls:
            self._open_call(self._name)


#: vLLM's parser names → our parser for the format.
PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser] | type[PythonicParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}
