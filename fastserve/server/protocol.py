"""The OpenAI-compatible wire format, request side: the request models of ``/v1/completions`` and
``/v1/chat/completions``, their conversion to ``SamplingParams``, ``parse_request`` (a bad body is a 400
naming the field) and ``APIError``, OpenAI's error body for every non-2xx answer.

Fields beyond OpenAI's are vLLM's (docs/configs.md lists them); undeclared ones are judged by
``fastserve.server.request_fields``. Response bodies are ``fastserve.server.protocol_output``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fastserve.chat_template import ChatOptions
from fastserve.generation_config import SamplingDefaults
from fastserve.server.request_fields import refused_field
from fastserve.server.structured_request import (
    ACCEPTED_BACKENDS,
    ConstraintError,
    ResponseFormat,
    StructuredOutputs,
    request_constraint,
)
from fastserve.server.tools import (
    NamedToolChoice,
    ToolCallMessage,
    ToolDefinition,
    ToolPlan,
    ToolRequestError,
    template_message,
    tool_plan,
)
from fastserve.worker.messages import OutputConstraint, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's legacy completions default
#: Temperatures below this are greedy (as vLLM): dividing logits by ~0 would overflow softmax.
GREEDY_BELOW_TEMPERATURE = 1e-5
INVALID_REQUEST = "invalid_request_error"
#: A model folder without sampling defaults: OpenAI's apply.
NO_MODEL_DEFAULTS = SamplingDefaults()
#: OpenAI's limit on ``top_logprobs`` (chat) and what vLLM allows by default (``max_logprobs``).
MAX_LOGPROBS = 20
#: OpenAI's range for ``presence_penalty`` and ``frequency_penalty``.
MAX_ABS_PENALTY = 2.0
#: OpenAI's range for a ``logit_bias`` value; larger ones are clamped to it, as vLLM does.
MAX_ABS_LOGIT_BIAS = 100.0


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = INVALID_REQUEST, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# ---- requests -------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share. Undeclared fields are kept (``extra="allow"``) only to be
    judged by ``fastserve.server.request_fields``: harmless ones pass, every other one is refused."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    #: Token id (a string, as JSON keys are) → bias added to its logit.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    #: Structured outputs (``fastserve.server.structured_request``): OpenAI's, vLLM's, vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def logprob_count(self) -> int | None:
        """How many top alternatives per token the client asked for (None: no logprobs)."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """How many top alternatives per prompt token the client asked for (None: no prompt
        logprobs); range and stream checked as vLLM checks them."""
        k = self.prompt_logprobs
        if k is None:
            return None
        if not 0 <= k <= MAX_LOGPROBS:
            whole = " (-1, the whole vocabulary, is not supported)" if k == -1 else ""
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]{whole}, got {k}", "prompt_logprobs")
        if self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        return k

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_limits(self, max_stop_strings: int, max_stop_chars: int, max_choices: int | None = None) -> None:
        """The server's limits on what a client may send (``server.max_stop_*``, ``server.max_choices``)."""
        stops = self.stop_strings()
        if len(stops) > max_stop_strings:
            raise bad_request(f"stop has {len(stops)} strings; at most {max_stop_strings} are allowed "
                              "(server.max_stop_strings)", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > max_stop_chars:
            raise bad_request(f"a stop string of {longest} characters is longer than the "
                              f"{max_stop_chars} allowed (server.max_stop_string_chars)", "stop")
        if max_choices is not None and self.num_choices > max_choices:
            raise bad_request(f"n must be at most {max_choices} (server.max_choices), got {self.n}", "n")

    def bad_word_texts(self) -> list[str]:
        words = self.bad_words or []
        if any(not w.strip() for w in words):
            raise bad_request("bad_words must be non-empty strings", "bad_words")
        return words

    def truncated(self, ids: list[int], context_len: int) -> list[int]:
        """``ids`` left-truncated to ``truncate_prompt_tokens`` (vLLM's: the last k tokens)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = context_len
        if k < 1:
            raise bad_request(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}",
                              "truncate_prompt_tokens")
        return ids[-k:]

    def output_constraint(self) -> OutputConstraint | None:
        """The one structured-output constraint the request sets (None: free text); a 400 names
        a malformed or second one."""
        backend = self.guided_decoding_backend
        if backend is not None and backend not in ACCEPTED_BACKENDS:
            raise bad_request(f"guided_decoding_backend {backend!r} is not available: this server's grammar "
                              f"engine is llguidance (send one of {list(ACCEPTED_BACKENDS)} or leave it out)",
                              "guided_decoding_backend")
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        try:
            constraint = request_constraint(self.response_format, self.structured_outputs, guided)
        except ConstraintError as exc:
            raise bad_request(str(exc), exc.param) from None
        if constraint is not None and self.min_tokens:
            # EOS would be masked while the grammar allows nothing else: the job could only fail.
            raise bad_request("min_tokens cannot be honoured with structured outputs: the grammar decides where "
                              "the output ends", "min_tokens")
        return constraint

    def check_unsupported(self) -> None:
        refused = refused_field(self.model_extra or {})
        if refused is not None:
            raise bad_request(refused[1], refused[0])
        if self.num_choices < 1:
            raise bad_request(f"n must be >= 1, got {self.n}", "n")
        if self.best_of is not None and self.best_of not in (1, self.num_choices):
            raise bad_request(f"best_of must be 1 or equal to n ({self.num_choices}), got {self.best_of}: "
                              "choosing the best of several samples is not supported", "best_of")
        if not self.spaces_between_special_tokens:
            raise bad_request("spaces_between_special_tokens=false is not supported (special tokens "
                              "are decoded as the fast tokenizer does)", "spaces_between_special_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for s in self.stop_strings():
            if not s:
                raise bad_request("stop strings must be non-empty", "stop")

    def to_sampling(self, default_max_tokens: int, model: SamplingDefaults = NO_MODEL_DEFAULTS) -> SamplingParams:
        """``SamplingParams`` with every value range-checked; errors name the field. A value the
        request omits is the model's (``generation_config.json``), else OpenAI's default."""
        self.check_unsupported()
        if model.max_tokens is not None:
            default_max_tokens = min(default_max_tokens, model.max_tokens)
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        temperature = _first(self.temperature, model.temperature, 1.0)
        top_p = _first(self.top_p, model.top_p, 1.0)
        top_k = int(_first(self.top_k, model.top_k, 0))
        top_k = 0 if top_k == -1 else top_k
        min_p = _first(self.min_p, model.min_p, 0.0)
        presence = 0.0 if self.presence_penalty is None else self.presence_penalty
        frequency = 0.0 if self.frequency_penalty is None else self.frequency_penalty
        repetition = _first(self.repetition_penalty, model.repetition_penalty, 1.0)
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1{self.zero_tokens_note()}, got {max_tokens}", "max_tokens")
        if not temperature >= 0.0:
            raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
        if not 0.0 < top_p <= 1.0:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if top_k < 0:
            raise bad_request(f"top_k must be >= 0 (0 or -1 disables it), got {top_k}", "top_k")
        if not 0.0 <= min_p <= 1.0:
            raise bad_request(f"min_p must be in [0, 1], got {min_p}", "min_p")
        if self.seed is not None and self.seed < 0:
            raise bad_request(f"seed must be >= 0, got {self.seed}", "seed")
        if not 0 <= self.min_tokens <= max_tokens:
            raise bad_request(f"min_tokens must be in [0, max_tokens={max_tokens}], got {self.min_tokens}",
                              "min_tokens")
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise bad_request(f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}", name)
        if not repetition > 0.0:
            raise bad_request(f"repetition_penalty must be > 0, got {repetition}", "repetition_penalty")
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, min_p=min_p,
                              presence_penalty=presence, frequency_penalty=frequency,
                              repetition_penalty=repetition, logprobs=self.logprob_count(),
                              logit_bias=self.logit_bias_pairs(), allowed_token_ids=self.allowed_ids(),
                              constraint=self.output_constraint(),
                              prompt_logprobs=self.prompt_logprob_count())

    def zero_tokens_note(self) -> str:
        """What a refused ``max_tokens: 0`` is told beside the range (completions: echo)."""
        return ""

    def allowed_ids(self) -> tuple[int, ...] | None:
        if self.allowed_token_ids is None:
            return None
        if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
            raise bad_request("allowed_token_ids must be a non-empty list of token ids >= 0", "allowed_token_ids")
        return tuple(sorted(set(self.allowed_token_ids)))

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs by id, each bias clamped to ±100 (OpenAI's
        range, as vLLM clamps); the vocabulary bound is the ingress's, which knows the model."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise bad_request(f"logit_bias key {key!r} is not a token id (a non-negative integer)", "logit_bias")
            pairs[int(key)] = min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, bias))
        return tuple(sorted(pairs.items()))


class CompletionRequest(_GenerationRequest):
    """``/v1/completions``. One prompt per request: a string, a list of token ids, or a list of
    one of either (as evaluation harnesses send a batch of one); several are refused."""

    prompt: str | list[int]
    #: vLLM's: a text prompt gets the tokenizer's specials (BOS); token ids are used as sent.
    add_special_tokens: bool = True
    #: Legacy completions: how many top alternatives per token (0 = only the sampled token's).
    logprobs: int | None = None
    echo: bool = False

    def logprob_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        """``prompt_logprobs``, else (vLLM's rule) ``logprobs`` when echoing: the prompt's own
        logprobs come first in the echoed ``logprobs``."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprob_count()
        return super().prompt_logprob_count()

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) alone."""
        return self.echo and self.max_tokens == 0

    def zero_tokens_note(self) -> str:
        return " (0 only with echo)"

    def to_sampling(self, default_max_tokens: int, model: SamplingDefaults = NO_MODEL_DEFAULTS) -> SamplingParams:
        if self.echo_only:   # one token runs the prompt; the response leaves it out (as vLLM)
            return self.model_copy(update={"max_tokens": 1}).to_sampling(default_max_tokens, model)
        return super().to_sampling(default_max_tokens, model)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) == 1:
                return value[0]
            raise ValueError(f"a list of {len(value)} prompts (batched request) is not supported; "
                             "send one prompt per request")
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            if len(value) == 1:
                return value[0]
            raise ValueError(f"a list of {len(value)} token-id prompts (batched request) is not supported; "
                             "send one prompt per request")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. ``name`` and the tool fields reach the chat template (as vLLM passes them);
    any other field is refused with a 400 naming it, never dropped."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant message's calls (its content may then be null).
    tool_calls: list[ToolCallMessage] | None = None
    #: A tool message: the call it answers.
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_fit_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not {self.role}")
        for call in self.tool_calls or ():
            call.arguments()   # a ValueError naming the call when they are not JSON
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, Any]:
        # "developer" is the newer OpenAI name for the system role.
        role = "system" if self.role == "developer" else self.role
        return template_message(role, self.text(), self.name, self.tool_calls, self.tool_call_id)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    #: OpenAI's schema allows null (as false).
    logprobs: bool | None = False
    top_logprobs: int | None = None
    #: vLLM's chat options (``fastserve.chat_template.ChatOptions``).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the tokenizer's specials on top of what the template writes.
    add_special_tokens: bool = False
    #: Functions the model may call (``fastserve.server.tools``).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self, parser_name: str | None) -> ToolPlan:
        """What the tools mean for the prompt and the output; a 400 naming the field when
        they cannot be honoured (``parser_name``: the server's tool-call format, if any)."""
        try:
            return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser_name)
        except ToolRequestError as exc:
            raise bad_request(str(exc), exc.param) from None

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           self.add_special_tokens)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                  "top_logprobs")
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def to_sampling(self, default_max_tokens: int, model: SamplingDefaults = NO_MODEL_DEFAULTS) -> SamplingParams:
        if self.max_completion_tokens is not None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens,
                                           "max_completion_tokens": None}).to_sampling(default_max_tokens, model)
        return super().to_sampling(default_max_tokens, model)


def _first(request: float | None, model: float | None, openai: float) -> float:
    """The request's value, else the model's default, else OpenAI's."""
    return request if request is not None else model if model is not None else openai


def parse_request(model: type[BaseModel], raw: bytes) -> Any:
    """Parse a JSON body; malformed JSON or a schema violation becomes a 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        # A field we do not support is named as such, whichever union branch pydantic tried first.
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        if err["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {err['msg']}", None, "invalid_json") from None
        loc = _trim_union_branch(err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        leaf = loc.rsplit(".", 1)[-1]
        if leaf in _UNION_MESSAGES and err["type"] != "value_error":
            msg = _UNION_MESSAGES[leaf]
        if not loc:
            raise bad_request(f"request body must be a JSON object: {msg}") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field '{loc}'", loc) from None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field '{loc}': this server does not support it", loc) from None
        raise bad_request(f"invalid value for '{loc}': {msg}", loc) from None


#: Fields that accept several shapes: pydantic reports only one failing branch, so say them all.
_UNION_MESSAGES = {
    "prompt": "must be a string or a list of integer token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


#: How pydantic names the branches of those unions in an error's location.
_UNION_BRANCHES = frozenset({"str", "list[int]", "list[str]", "list[TextPart]", "int", "is-instance[str]",
                             "NamedToolChoice"})


def _trim_union_branch(loc: Sequence[Any]) -> str:
    """Pydantic names the union branch that failed (``prompt.str``); callers want ``prompt``."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _UNION_BRANCHES or str(p).startswith("literal["):
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)
