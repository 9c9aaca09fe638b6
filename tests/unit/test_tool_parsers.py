"""The tool-call parsers (``fastserve.server.tool_parsers``): each format's whole outputs give
exact content and calls, and the same output fed in any chunking streams deltas that add up,
as the ``openai`` client accumulates them, to exactly those calls and that content."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from fastserve.server.tool_parsers import (
    PARSERS,
    ForcedArgumentsParser,
    ForcedArrayParser,
    HermesParser,
    Llama3JsonParser,
    PythonicParser,
    ToolCallParser,
    parse,
)

Calls = list[tuple[str, str]]

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": [1, 2, {"q": "}\\"<"}]}}\n</tool_call>\n<tool_call>{"arguments": {}, "name": "now"}'
              '</tool_call>')

#: Python's string forms: empty, escaped quotes, triple quotes holding quotes, commas and parentheses.
PYTHON_STRINGS = "[f(a='', b=\"\", c='it\\'s', d=\"\"\"say \"hi\", ok\"\"\", e='''x''''', g=')(')]"

#: (parser class, output, content, [(name, arguments)]): the expected reading of whole outputs.
WHOLE: list[tuple[type[ToolCallParser], str, str, Calls]] = [
    (HermesParser, HERMES_TWO, "Let me check.",
     [("get_weather", '{"city": "Paris", "days": [1, 2, {"q": "}\\"<"}]}'), ("now", "{}")]),
    (HermesParser, "The <tool is < not a call", "The <tool is < not a call", []),
    (HermesParser, '<tool_call>{"name": "ping"}', "", [("ping", "{}")]),
    (HermesParser, '<tool_call>not json</tool_call> after', "<tool_call>not json</tool_call> after", []),
    (HermesParser, 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b', "a b",
     [("f", '{"x": 1}')]),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"x": "cut', "", [("f", '{"x": "cut')]),
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "x;y"}}', "",
     [("f", '{"a": 1}'), ("g", '{"b": "x;y"}')]),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"a": -1.5e3, "t": true, "n": null}}', "",
     [("f", '{"a": -1.5e3, "t": true, "n": null}')]),
    (Llama3JsonParser, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    (Llama3JsonParser, '{"foo": 1} is JSON', '{"foo": 1} is JSON', []),
    (Llama3JsonParser, '{"name": "f", "parameters": {}} and then text', "and then text", [("f", "{}")]),
    (PythonicParser, "[get_weather(city='Paris', days=3), now(), g(x=[1, (2, 3)], y={'k': None}, "
                     "s='''a,)b''', t=true, m=-2)]", "",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("now", "{}"),
      ("g", '{"x": [1, [2, 3]], "y": {"k": null}, "s": "a,)b", "t": true, "m": -2}')]),
    (PythonicParser, PYTHON_STRINGS, "",
     [("f", '{"a": "", "b": "", "c": "it\'s", "d": "say \\"hi\\", ok", "e": "x", "g": ")("}')]),
    (PythonicParser, "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (PythonicParser, "Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
    (PythonicParser, "[f(a=1, b=open('x'))]", "b=open('x'))]", [("f", '{"a": 1}')]),
    (PythonicParser, '[f(a="unterminated', "", [("f", "{}")]),
    (ForcedArrayParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
]


def accumulate(parser: ToolCallParser, pieces: list[str]) -> tuple[str, Calls, list[str]]:
    """Content and calls as the ``openai`` client accumulates the streamed deltas (a call's
    header once, then its argument fragments concatenated), and the ids its headers carried."""
    content = ""
    calls: dict[int, list[str]] = {}
    ids: list[str] = []
    for delta in [*(parser.push(p) for p in pieces), parser.finish()]:
        content += delta.content
        for d in delta.calls:
            wire = d.wire()
            if "id" in wire:
                assert d.index not in calls and d.index == len(calls), "one header per call, in order"
                assert wire["type"] == "function" and wire["id"].startswith("call_")
                calls[d.index] = [wire["function"]["name"], ""]
                ids.append(wire["id"])
            assert set(wire["function"]) <= {"name", "arguments"}
            calls[d.index][1] += wire["function"]["arguments"]
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], ids


def chunkings(text: str, seeds: int = 20) -> list[list[str]]:
    """Every character alone, every two-piece split, and random pieces of 1 to 7 characters."""
    out = [list(text)] + [[text[:k], text[k:]] for k in range(len(text) + 1)]
    for seed in range(seeds):
        rng = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


@pytest.mark.parametrize(("cls", "text", "content", "calls"), WHOLE)
def test_a_whole_output_gives_its_content_and_calls(cls: type[ToolCallParser], text: str, content: str,
                                                   calls: Calls) -> None:
    got_content, got_calls = parse(cls(), text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), WHOLE)
def test_streamed_deltas_add_up_to_the_whole_reading_in_any_chunking(cls: type[ToolCallParser], text: str,
                                                                     content: str, calls: Calls) -> None:
    for pieces in chunkings(text):
        parser = cls()
        got_content, got_calls, ids = accumulate(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        assert ids == [c.id for c in parser.calls]


def test_arguments_read_before_the_name_wait_for_it() -> None:
    parser = HermesParser()
    assert not parser.push('<tool_call>{"arguments": {"x": 1}, ').calls
    delta = parser.push('"name": "f"}')
    assert [c.wire()["function"] for c in delta.calls] == [{"name": "f", "arguments": '{"x": 1}'}]


def test_a_call_is_sent_once_its_name_is_whole_and_arguments_then_stream() -> None:
    parser = HermesParser()
    assert parser.push('<tool_call>{"name": "get_w').calls == []
    first = parser.push('eather", "arguments": {"ci')
    assert [c.wire() for c in first.calls] == [{"index": 0, "id": parser.calls[0].id, "type": "function",
                                                "function": {"name": "get_weather", "arguments": '{"ci'}}]
    later = parser.push('ty": "Paris"}}')
    assert [c.wire() for c in later.calls] == [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]


def test_content_is_streamed_but_a_possible_marker_is_held() -> None:
    parser = HermesParser()
    assert parser.push("Hello <tool").content == "Hello"
    assert parser.push("box> there ").content == " <toolbox> there"
    assert parser.finish().content == " "


def test_an_output_without_calls_is_its_text_exactly() -> None:
    text = "  Paris is the capital.\n\n  It is in France.\n"
    for cls in (HermesParser, Llama3JsonParser, PythonicParser):
        for pieces in chunkings(text, seeds=5):
            assert accumulate(cls(), pieces)[:2] == (text, [])


def test_max_calls_keeps_the_first_call_only() -> None:
    content, calls = parse(HermesParser(max_calls=1), HERMES_TWO)
    assert (content, [c.name for c in calls]) == ("Let me check.", ["get_weather"])
    assert [c.name for c in parse(PythonicParser(max_calls=1), "[f(a=1), g(b=2)]")[1]] == ["f"]


def test_pythonic_never_evaluates_what_it_reads(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    text = f"[f(x=__import__('pathlib').Path({str(marker)!r}).touch())]"
    content, calls = parse(PythonicParser(), text)
    assert not marker.exists()
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    assert content.startswith("x=__import__")


def test_a_named_choice_reads_the_whole_output_as_the_arguments() -> None:
    text = '  {"city": "Paris"} \n'
    for pieces in chunkings(text):
        parser = ForcedArgumentsParser("get_weather")
        assert accumulate(parser, pieces)[:2] == ("", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_reads_back_the_calls_it_writes(name: str) -> None:
    """What ``render_calls`` writes (earlier calls shown to a template without tools) is what
    the parser reads."""
    cls = PARSERS[name]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "metric": True}},
             {"name": "now", "arguments": {}}]
    content, parsed = parse(cls(), cls.render_calls(calls))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]


def test_the_parser_names_are_the_configs() -> None:
    from typing import get_args

    from fastserve.config_server import ToolCallParserName

    assert set(get_args(ToolCallParserName)) == {*PARSERS, "auto", "none"}
