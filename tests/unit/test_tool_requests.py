"""Tool calling at the HTTP layer without Ray: the request's tools and messages checked (each
refusal a 400 naming the field), the prompt they make with the folder's template, the schema
``tool_choice`` required/named force, and the answers, whole and streamed, as the official
``openai`` client reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from fastserve.chat_template import ChatTemplate
from fastserve.scheduler.job import Finish, JobRequest, TokenDelta
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.server.protocol import APIError
from fastserve.server.tools import NamedToolChoice, ToolDefinition, resolve_tool_call_parser, tool_plan
from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import OutputConstraint
from tests.harness.http_backends import MODEL, STATS, TOK, ScriptedBackend, post, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_HISTORY = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 64, **fields}


def refusal(request: dict[str, Any], parser: str | None = "hermes") -> tuple[int, str | None, str]:
    server = OpenAIServer(ServerContext(MODEL, TOK, TOK.vocab_size, 2048, tool_call_parser=parser),
                          backend=None)  # type: ignore[arg-type]
    with pytest.raises(APIError) as refused:
        server.preparer.prepare_chat(json.dumps(request).encode())
    return refused.value.status, refused.value.param, refused.value.message


@pytest.mark.parametrize(("request_", "param", "message"), [
    (body(tools=[WEATHER], tool_choice="sometimes"), "tool_choice",
     "invalid value for 'tool_choice': must be \"none\", \"auto\", \"required\" or "
     "{\"type\": \"function\", \"function\": {\"name\": ...}}"),
    (body(tool_choice="required"), "tool_choice", 'tool_choice "required" needs tools'),
    (body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "now"}}), "tool_choice",
     "tool_choice names the function 'now', which tools do not define"),
    (body(tools=[WEATHER, WEATHER]), "tools", "tools name a function twice"),
    (body(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name",
     "invalid value for 'tools[0].function.name': String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"),
    (body(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]), "tools[0].function.strict",
     'tools[0].function.strict: true is only kept under tool_choice "required" or a named function '
     '(a grammar forces the arguments); "auto" cannot promise it'),
    (body(tools=[{"type": "retrieval"}]), "tools[0].type",
     "invalid value for 'tools[0].type': Input should be 'function'"),
    (body(functions=[WEATHER["function"]]), "functions",
     "functions is not supported by this server (only null is accepted)"),
    (body(messages=[*USER, {"role": "tool", "content": "22 C"}]), "messages[1]",
     "invalid value for 'messages[1]': a tool message needs tool_call_id (the id of the call it answers)"),
    (body(messages=[{"role": "user", "content": "hi", "tool_call_id": "c"}]), "messages[0]",
     "invalid value for 'messages[0]': tool_call_id is only allowed on tool messages, not user"),
    (body(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages[0]",
     "invalid value for 'messages[0]': tool_calls is only allowed on assistant messages, not user"),
    (body(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), "messages[1]",
     "invalid value for 'messages[1]': tool call 'c': arguments are not JSON: '{oops'"),
    (body(messages=[{"role": "user", "content": "hi", "refusal": "no"}]), "messages[0].refusal",
     "unknown field 'messages[0].refusal': this server does not support it"),
    (body(messages=[{"role": "function", "content": "hi"}]), "messages[0].role",
     "invalid value for 'messages[0].role': Input should be 'system', 'user', 'assistant', 'developer' or 'tool'"),
])
def test_tools_and_messages_we_cannot_honour_are_400s_naming_the_field(request_: dict[str, Any], param: str,
                                                                     message: str) -> None:
    assert refusal(request_) == (400, param, message)


def test_auto_needs_a_parser_on_the_server() -> None:
    assert refusal(body(tools=[WEATHER]), parser=None) == (
        400, "tool_choice", 'tool_choice "auto" needs a tool-call parser: this server has none '
                            "(server.tool_call_parser)")


def test_tool_choice_defaults_as_openai_and_parallel_calls_as_vllm() -> None:
    tools = [ToolDefinition.model_validate(WEATHER)]
    assert tool_plan(None, None, None, "hermes").mode == "none"
    auto = tool_plan(tools, None, None, "hermes")
    assert (auto.mode, auto.parallel, auto.forced_schema()) == ("auto", True, None)
    assert tool_plan(tools, "none", None, "hermes").parser() is None


def test_required_forces_vllms_array_and_a_named_function_its_parameters() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    shaped = ToolDefinition.model_validate({"type": "function", "function": {
        "name": "draw", "parameters": {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}},
                                       "$defs": {"point": point}}}})
    tools = [ToolDefinition.model_validate(WEATHER), ToolDefinition.model_validate(NOW), shaped]
    required = tool_plan(tools, "required", False, "hermes").forced_schema()
    assert required == {"type": "array", "minItems": 1, "maxItems": 1, "$defs": {"point": point}, "items": {
        "type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["draw"]},
                            "parameters": {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}}},
             "required": ["name", "parameters"]}]}}
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    named = tool_plan(tools, choice, None, "hermes")
    assert (named.mode, named.forced_schema()) == ("named", WEATHER["function"]["parameters"])


def test_the_forced_schema_rides_on_the_jobs_sampling() -> None:
    backend = ScriptedBackend(script('{"city": "Paris"}'))
    r = post(backend, "/v1/chat/completions",
             body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert r.status_code == 200, r.text
    assert backend.requests[0].sampling.constraint == OutputConstraint.json_schema(WEATHER["function"]["parameters"])
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_the_parser_follows_the_template_unless_configured() -> None:
    assert resolve_tool_call_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert resolve_tool_call_parser("auto", "<|python_tag|>{{ x }}") == "llama3_json"
    assert resolve_tool_call_parser("auto", "like [func_name1(params_name1=...)]") == "pythonic"
    assert resolve_tool_call_parser("auto", "{{ messages }}") == "hermes"
    assert resolve_tool_call_parser("pythonic", "<tool_call>") == "pythonic"
    assert resolve_tool_call_parser("none", "<tool_call>") is None


# ---- the prompt ------------------------------------------------------------------------------

def test_smollm2_and_gemma3_templates_do_not_read_tools(smollm2_folder: Path) -> None:
    assert not Tokenizer.from_dir(smollm2_folder).chat_template.reads_tools
    gemma = Path(__file__).resolve().parents[2] / "config" / "chat_templates" / "gemma3.jinja"
    assert not ChatTemplate(gemma.read_text(), {}).reads_tools


def prepared_prompt(tok: Tokenizer, request: dict[str, Any]) -> str:
    server = OpenAIServer(ServerContext(MODEL, tok, tok.vocab_size, 8192), backend=None)  # type: ignore[arg-type]
    prep = server.preparer.prepare_chat(json.dumps({**request, "model": MODEL}).encode())
    return tok.decode(prep.prompt_ids, skip_special_tokens=False)


def test_a_template_without_tools_gets_them_in_the_system_message(smollm2_folder: Path) -> None:
    """SmolLM2's template ignores ``tools``: they are written into the system message with the
    format's instructions, and earlier calls into their assistant message's text."""
    tok = Tokenizer.from_dir(smollm2_folder)
    listing = json.dumps(WEATHER)
    prompt = prepared_prompt(tok, {"messages": [{"role": "system", "content": "Be brief."}, *CALL_HISTORY],
                                   "tools": [WEATHER]})
    assert prompt == (
        "<|im_start|>system\nBe brief.\n\nYou can call these functions (JSON schemas):\n<tools>\n"
        f"{listing}\n</tools>\nTo call a function, answer with one <tool_call>...</tool_call> block per "
        'call, holding {"name": <function name>, "arguments": <arguments object>}.<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma3_gets_tool_results_as_a_user_turn() -> None:
    """Gemma 3's template refuses any role but alternating user/model: the results of two
    parallel calls become one user turn."""
    gemma = ChatTemplate((Path(__file__).resolve().parents[2] / "config" / "chat_templates" / "gemma3.jinja")
                         .read_text(), {"bos_token": "<bos>"})
    two_calls = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "22 C"},
        {"role": "tool", "tool_call_id": "b", "content": "9:00"}]
    plan = tool_plan([ToolDefinition.model_validate(NOW)], None, None, "hermes")
    assert gemma.render(plan.fallback_messages(two_calls)) == (
        "<bos><start_of_turn>user\nYou can call these functions (JSON schemas):\n<tools>\n" + json.dumps(NOW)
        + "\n</tools>\nTo call a function, answer with one <tool_call>...</tool_call> block per call, holding "
        '{"name": <function name>, "arguments": <arguments object>}.\n\nWeather in Paris?<end_of_turn>\n'
        '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><end_of_turn>\n'
        "<start_of_turn>user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\n9:00\n</tool_response>"
        "<end_of_turn>\n<start_of_turn>model\n")


#: A template that reads tools and tool calls, written for this test in the Hermes convention.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
    "{%- if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_reads_tools_renders_as_transformers(smollm2_folder: Path, tmp_path: Path) -> None:
    """Tools, tool calls (arguments as dicts) and tool messages reach the template exactly as
    ``transformers.apply_chat_template(messages, tools=...)`` passes them."""
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_folder / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template.reads_tools
    hf_messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        CALL_HISTORY[2]]
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        hf_messages, tools=[WEATHER, NOW], add_generation_prompt=True, tokenize=False)
    assert prepared_prompt(tok, {"messages": CALL_HISTORY, "tools": [WEATHER, NOW]}) == expected
    assert '"arguments": {"city": "Paris"}' in expected and "(for call_1)" in expected


# ---- the answers -----------------------------------------------------------------------------

def script(text: str, reason: str = "stop") -> Any:
    """Each job writes ``text`` one token per event, then (``stop``) an end-of-text token."""
    ids = TOK.encode(text, add_special_tokens=False)
    assert TOK.decode(ids) == text

    def run(req: JobRequest) -> list[TokenDelta]:
        toks = ids + ([TOK.eos_token_id] if reason == "stop" else [])  # type: ignore[list-item]
        return [TokenDelta(req.job_id, (t,), Finish(reason, STATS) if k == len(toks) - 1 else None)
                for k, t in enumerate(toks)]
    return run


HERMES_OUTPUT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def streamed(request: dict[str, Any], text: str, reason: str = "stop") -> Any:
    """The stream's chunks folded by the ``openai`` client's own accumulator."""
    r = post(ScriptedBackend(script(text, reason)), "/v1/chat/completions", {**request, "stream": True})
    assert r.status_code == 200, r.text
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for event in sse_events(r.text):
        if event != "[DONE]":
            list(state.handle_chunk(ChatCompletionChunk.model_validate(event)))
    return state.get_final_completion()


def test_auto_answers_the_calls_whole_and_streamed_alike() -> None:
    request = body(tools=[WEATHER, NOW])
    whole = post(ScriptedBackend(script(HERMES_OUTPUT)), "/v1/chat/completions", request).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Checking."
    calls = whole["message"]["tool_calls"]
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        ("function", {"name": "now", "arguments": "{}"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    final = streamed(request, HERMES_OUTPUT).choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Checking."
    assert [(c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_auto_without_calls_is_plain_content() -> None:
    text = "It is sunny in Paris."
    whole = post(ScriptedBackend(script(text)), "/v1/chat/completions", body(tools=[WEATHER])).json()["choices"][0]
    assert whole == {**whole, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    final = streamed(body(tools=[WEATHER]), text).choices[0]
    assert (final.message.content, final.message.tool_calls, final.finish_reason) == (text, None, "stop")


def test_a_call_cut_by_length_keeps_that_reason() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    whole = post(ScriptedBackend(script(text, "length")), "/v1/chat/completions",
                 body(tools=[WEATHER])).json()["choices"][0]
    assert whole["finish_reason"] == "length"
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}


def test_required_reads_the_forced_array_streamed() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    final = streamed(body(tools=[WEATHER, NOW], tool_choice="required"), text).choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("now", "{}")]


def test_parallel_tool_calls_false_returns_the_first_call() -> None:
    whole = post(ScriptedBackend(script(HERMES_OUTPUT)), "/v1/chat/completions",
                 body(tools=[WEATHER, NOW], parallel_tool_calls=False)).json()["choices"][0]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]


def test_tool_choice_none_reads_no_calls() -> None:
    whole = post(ScriptedBackend(script(HERMES_OUTPUT)), "/v1/chat/completions",
                 body(tools=[WEATHER], tool_choice="none")).json()["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": HERMES_OUTPUT}


def test_tokenize_renders_tools_as_the_chat_route(smollm2_folder: Path) -> None:
    from fastserve.server.tokenize_api import tokenize_response

    tok = Tokenizer.from_dir(smollm2_folder)
    ctx = ServerContext(MODEL, tok, tok.vocab_size, 8192)
    server = OpenAIServer(ctx, backend=None)  # type: ignore[arg-type]
    request = {"model": MODEL, "messages": CALL_HISTORY, "tools": [WEATHER]}
    chat_ids = server.preparer.prepare_chat(json.dumps(request).encode()).prompt_ids
    assert tokenize_response(ctx, json.dumps(request).encode())["tokens"] == list(chat_ids)


def test_a_format_tag_that_is_a_special_token_is_kept_in_the_text(smollm2_folder: Path, tmp_path: Path) -> None:
    """Where the tokenizer makes ``<tool_call>`` special, ``auto`` decodes with special tokens
    kept (as vLLM's Hermes parser asks), else the parser would never see the tag."""
    config = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<tool_call>", "</tool_call>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((smollm2_folder / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_bytes((smollm2_folder / "chat_template.jinja").read_bytes())
    tagged = Tokenizer.from_dir(tmp_path)
    assert len(tagged.encode("<tool_call>", add_special_tokens=False)) == 1
    for tok, kept in ((tagged, False), (Tokenizer.from_dir(smollm2_folder), True)):
        server = OpenAIServer(ServerContext(MODEL, tok, tok.vocab_size, 8192), backend=None)  # type: ignore[arg-type]
        prep = server.preparer.prepare_chat(json.dumps({**body(tools=[WEATHER]), "model": MODEL}).encode())
        assert prep.req.skip_special_tokens is kept


def test_a_message_name_the_template_never_reads_is_refused(smollm2_folder: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(smollm2_folder)
    server = OpenAIServer(ServerContext(MODEL, tok, tok.vocab_size, 8192), backend=None)  # type: ignore[arg-type]
    request = {"model": MODEL, "messages": [*USER, {"role": "user", "content": "hi", "name": "ann"}]}
    with pytest.raises(APIError) as refused:
        server.preparer.prepare_chat(json.dumps(request).encode())
    assert (refused.value.param, refused.value.message) == (
        "messages[1].name", "messages[1].name: this model's chat template never reads a message's name; leave it out")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.name }}: {{ m.content }}\n{% endfor %}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_folder / name).read_bytes())
    assert prepared_prompt(Tokenizer.from_dir(tmp_path), request) == ": Weather in Paris?\nann: hi\n"


def test_a_forced_choice_refuses_what_the_grammar_cannot_honour() -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}
    assert refusal(body(tools=[broken], tool_choice="required")) == (
        400, "tools", "the tools' parameters cannot be forced: the json_schema cannot be compiled: "
                      "Invalid type: frobnicate")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert refusal(body(tools=[WEATHER], tool_choice=named, min_tokens=2)) == (
        400, "min_tokens", "min_tokens cannot be honoured with a forced tool_choice: the grammar decides where "
                           "the call ends")
    assert refusal(body(tools=[WEATHER], tool_choice=named, response_format={"type": "json_object"})) == (
        400, "tool_choice", "tool_choice constrains the output, and so does another field (json_object); "
                            "send one of them")
