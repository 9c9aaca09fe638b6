"""Tool calling end to end: ``config/demo.yaml`` (SmolLM2-135M-Instruct, its own template, which
reads no tools: they reach the model in the system message) through the official ``openai``
client, whole and streamed.

``auto`` leaves the choice to the model: its answer is text or parsed calls, and the stream
adds up to the same answer (greedy). ``required`` and a named function are forced by the grammar
(the schema of ``fastserve.server.tools.ToolPlan.forced_schema``): the calls are valid whatever a
135M model would have written. One server for the module (``tests.harness.serve``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.harness.serve import API_KEY, REQUEST_TIMEOUT_S, ROOT, Server, serve_app
from tests.harness.tokenizers import require_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_smollm2()
    config: dict[str, Any] = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    with serve_app(tmp_path_factory.mktemp("tools"), config, model=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S)


def ask(client: Any, **fields: Any) -> tuple[Any, Any]:
    """The same request whole and streamed, the stream folded by the client's own accumulator
    (its snapshot: ``.stream().get_final_completion()`` refuses an answer cut by length)."""
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState

    request = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0,
               **fields}
    whole = client.chat.completions.create(**request)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**request, stream=True):
        list(state.handle_chunk(chunk))
    return whole.choices[0], state.current_completion_snapshot.choices[0]


def calls_of(choice: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def assert_valid_call(name: str, arguments: Any) -> None:
    """Arguments that follow the tool's schema: exactly its required keys, strings, enums kept."""
    if name == "get_weather":
        assert set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
        assert arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and set(arguments) == {"zone"} and isinstance(arguments["zone"], str)


def test_auto_answers_text_or_parsed_calls_and_streams_the_same(client: Any) -> None:
    whole, streamed = ask(client)
    if whole.message.tool_calls:
        assert whole.finish_reason in ("tool_calls", "length")
        assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
        assert {c.function.name for c in whole.message.tool_calls} <= {"get_weather", "get_time"}
    else:
        assert whole.finish_reason in ("stop", "length") and whole.message.content
    assert (streamed.message.content or None, calls_of(streamed), streamed.finish_reason) == \
        (whole.message.content or None, calls_of(whole), whole.finish_reason)


def test_required_gives_valid_calls_whole_and_streamed(client: Any) -> None:
    """One call (``parallel_tool_calls: false`` bounds the forced array to one item, so the
    grammar closes it): valid, and the stream adds up to it."""
    whole, streamed = ask(client, tool_choice="required", parallel_tool_calls=False)
    assert whole.finish_reason == "tool_calls"
    calls = calls_of(whole)
    assert len(calls) == 1
    assert_valid_call(*calls[0])
    assert (calls_of(streamed), streamed.finish_reason) == (calls, "tool_calls")


def test_required_with_parallel_calls_gives_valid_calls_until_the_length_cut(client: Any) -> None:
    """Without the bound SmolLM2-135M keeps adding calls to the array (measured: it repeats
    get_weather until max_tokens); every call it finished is valid, the one cut is the last."""
    whole, streamed = ask(client, tool_choice="required")
    calls = whole.message.tool_calls
    assert calls and whole.finish_reason in ("tool_calls", "length")
    finished = calls if whole.finish_reason == "tool_calls" else calls[:-1]
    for call in finished:
        assert_valid_call(call.function.name, json.loads(call.function.arguments))
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_a_named_function_is_called_with_valid_arguments(client: Any) -> None:
    whole, streamed = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert whole.finish_reason == "tool_calls"
    ((name, arguments),) = calls_of(whole)
    assert name == "get_time"
    assert_valid_call(name, arguments)
    assert calls_of(streamed) == [(name, arguments)]


def test_a_tool_result_goes_back_to_the_model(client: Any) -> None:
    """The conversation after a call: the assistant's call and the tool's answer render, and the
    model answers in text."""
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
