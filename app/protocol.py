"""The OpenAI-compatible wire format: request and response models, errors, and stop strings.

Owns what crosses the HTTP boundary and its exact error messages:

* ``CompletionRequest`` / ``ChatCompletionRequest`` (``/v1/completions``, ``/v1/chat/completions``)
  and their conversion to the data plane's ``SamplingParams`` (``to_sampling``);
* ``APIError`` and ``error_body``: the OpenAI error body ``{"error": {message, type, param, code}}``
  used for every non-2xx answer;
* the response and stream-chunk builders (``text_completion``, ``chat.completion``, their
  ``.chunk`` forms, ``usage``);
* ``StopStringMatcher``: OpenAI ``stop`` strings matched on the detokenized text, trimmed from the
  output, with just enough text held back while streaming that a stop string split across tokens
  is never sent.

Beyond OpenAI, as vLLM accepts them: ``top_k`` (0 or -1 disables it), ``ignore_eos`` (benchmark
clients fix output lengths with it), ``return_token_ids`` (the generated ids beside the text), and
``priority`` (an integer, lower = more urgent: the MLFQ policies shift the job's entry level by it,
clamped to the existing levels; single-level policies ignore it). Responses carry ``job_stats``: the scheduler's
per-job accounting (queueing, execution and swap-blocked seconds, demotions, promotions, swaps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from actors.messages import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's legacy completions default
#: Temperatures below this are greedy (as vLLM): dividing logits by ~0 would overflow softmax.
GREEDY_BELOW_TEMPERATURE = 1e-5
INVALID_REQUEST = "invalid_request_error"


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
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send extras
    (``user``, ...); fields we recognise but cannot honour are rejected in ``check_unsupported``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    return_token_ids: bool = False
    # Recognised so that asking for them fails loudly instead of being silently ignored.
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_limits(self, max_stop_strings: int, max_stop_chars: int) -> None:
        """The server's limits on what a client may send (``server.max_stop_*``)."""
        stops = self.stop_strings()
        if len(stops) > max_stop_strings:
            raise bad_request(f"stop has {len(stops)} strings; at most {max_stop_strings} are allowed "
                              "(server.max_stop_strings)", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > max_stop_chars:
            raise bad_request(f"a stop string of {longest} characters is longer than the "
                              f"{max_stop_chars} allowed (server.max_stop_string_chars)", "stop")

    def check_unsupported(self) -> None:
        if self.n is not None and self.n != 1:
            raise bad_request(f"n must be 1, got {self.n}: only one choice per request is supported", "n")
        if self.best_of is not None and self.best_of != 1:
            raise bad_request(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.logprobs not in (None, False):
            raise bad_request("logprobs are not supported", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise bad_request(f"{name} is not supported (must be 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for s in self.stop_strings():
            if not s:
                raise bad_request("stop strings must be non-empty", "stop")

    def to_sampling(self, default_max_tokens: int) -> SamplingParams:
        """``SamplingParams`` with every value range-checked; errors name the field."""
        self.check_unsupported()
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = 0 if self.top_k is None or self.top_k == -1 else self.top_k
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if not temperature >= 0.0:
            raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
        if not 0.0 < top_p <= 1.0:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        if top_k < 0:
            raise bad_request(f"top_k must be >= 0 (0 or -1 disables it), got {top_k}", "top_k")
        if self.seed is not None and self.seed < 0:
            raise bad_request(f"seed must be >= 0, got {self.seed}", "seed")
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=self.seed, ignore_eos=self.ignore_eos)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) == 1:
                return value[0]
            raise ValueError("a list of prompts (batched request) is not supported; send one prompt per request")
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            raise ValueError("a list of token-id prompts (batched request) is not supported")
        return value

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        # "developer" is the newer OpenAI name for the system role.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def to_sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens,
                                           "max_completion_tokens": None}).to_sampling(default_max_tokens)
        return super().to_sampling(default_max_tokens)


def parse_request(model: type[_GenerationRequest], raw: bytes) -> Any:
    """Parse a JSON body; malformed JSON or a schema violation becomes a 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
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
        raise bad_request(f"invalid value for '{loc}': {msg}", loc) from None


#: Fields that accept several shapes: pydantic reports only one failing branch, so say them all.
_UNION_MESSAGES = {
    "prompt": "must be a string or a list of integer token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def _trim_union_branch(loc: Sequence[Any]) -> str:
    """Pydantic names the union branch that failed (``prompt.str``); callers want ``prompt``."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in ("str", "list[int]", "list[str]", "list[TextPart]", "int", "is-instance[str]"):
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


# ---- stop strings ---------------------------------------------------------------------------

class StopStringMatcher:
    """Finds OpenAI stop strings in streamed text and trims them (and what follows) off.

    ``push(delta)`` returns the text that is safe to send: everything except the last
    ``len(longest stop) - 1`` characters, which could still begin a stop string. ``flush()``
    releases the rest at the end. Once a stop string matches, ``stopped`` is True and nothing
    after its start is ever released.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text accepted so far (trimmed at a matched stop string)."""
        return self._text

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        start = max(0, len(self._text) - self._hold)
        self._text += delta
        if self._stop:
            hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
                return self._release(len(self._text))
        return self._release(max(self._sent, len(self._text) - self._hold))

    def flush(self) -> str:
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        out = self._text[self._sent:upto]
        self._sent = max(self._sent, upto)
        return out


# ---- responses ------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now_s() -> int:
    return int(time.time())


def completion_response(req_id: str, model: str, text: str, finish_reason: str | None,
                        usage_: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    choice.update(extra.pop("choice", {}))
    return {"id": req_id, "object": "text_completion", "created": now_s(), "model": model,
            "choices": [choice], "usage": usage_, **extra}


def chat_response(req_id: str, model: str, text: str, finish_reason: str | None,
                  usage_: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                              "logprobs": None, "finish_reason": finish_reason}
    choice.update(extra.pop("choice", {}))
    return {"id": req_id, "object": "chat.completion", "created": now_s(), "model": model,
            "choices": [choice], "usage": usage_, **extra}


def completion_chunk(req_id: str, model: str, created: int, text: str | None,
                     finish_reason: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stream chunk; ``text=None`` gives the usage-only chunk with no choices."""
    extra = dict(extra or {})
    choices: list[dict[str, Any]] = []
    if text is not None:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        choice.update(extra.pop("choice", {}))
        choices.append(choice)
    return {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, **extra}


def chat_chunk(req_id: str, model: str, created: int, delta: dict[str, str] | None,
               finish_reason: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    extra = dict(extra or {})
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        choice.update(extra.pop("choice", {}))
        choices.append(choice)
    return {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "fastserve"}]}
