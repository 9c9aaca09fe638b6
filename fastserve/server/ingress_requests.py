"""The ingress's request side: ``ServerContext`` (what it knows of the served model), ``Prepared`` (a
parsed request and a ``JobRequest`` per choice) and ``RequestPreparer`` (auth, parsing, templating,
tokenization, the one validation, how a refusal reads). No ray, no FastAPI.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import uuid
from dataclasses import dataclass, field, replace

from fastserve.chat_template import ChatTemplateError
from fastserve.config import AppArgs
from fastserve.errors import ErrorCode, RequestError, validate_request
from fastserve.generation_config import SamplingDefaults
from fastserve.scheduler.job import JobRequest
from fastserve.server.choices import choice_job_id, choice_sampling
from fastserve.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_request,
)
from fastserve.server.protocol_output import now_s
from fastserve.server.request_limits import RequestLimits
from fastserve.server.structured_request import ConstraintError, constrained
from fastserve.server.tool_parsers import PARSERS
from fastserve.server.tools import ToolPlan, chat_prompt_ids, resolve_tool_call_parser
from fastserve.structured import GrammarError, check_constraint
from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import OutputConstraint, SamplingParams

log = logging.getLogger(__name__)

#: How a refusal's message reads to the client, by its code (default: the message as is).
REFUSAL_MESSAGES = {ErrorCode.ADMISSION_QUEUE_FULL: "server busy: {}; retry later",
                    ErrorCode.ENGINE_UNAVAILABLE: "the model is unavailable: {}; retry later"}


@dataclass(frozen=True)
class ServerContext:
    """What the HTTP layer knows about the served model."""

    model_name: str
    tokenizer: Tokenizer
    vocab_size: int
    context_len: int
    api_key: str | None = None
    retry_after_s: int = 1
    limits: RequestLimits = field(default_factory=lambda: RequestLimits())
    allow_reset_prefix_cache: bool = False
    #: The model's own sampling values for fields a request omits (``generation_config.json``).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    #: The format ``tool_choice: auto`` outputs are read in (a ``PARSERS`` key; None: refused).
    tool_call_parser: str | None = "hermes"
    created: int = field(default_factory=now_s)

    @classmethod
    def from_args(cls, args: AppArgs) -> ServerContext:
        tokenizer = args.model.tokenizer()
        srv = args.server
        limits = RequestLimits(srv.max_request_bytes, srv.max_stop_strings, srv.max_stop_string_chars,
                               srv.request_timeout_s, srv.admission_timeout_s, srv.allow_priority,
                               srv.health_timeout_s, srv.max_choices)
        return cls(args.model.name, tokenizer, args.model.hf_config().vocab_size,
                   args.model.context_len(), srv.resolved_api_key(), srv.retry_after_s, limits,
                   allow_reset_prefix_cache=srv.allow_reset_prefix_cache,
                   sampling_defaults=_logged(args.model.sampling_defaults()),
                   tool_call_parser=resolve_tool_call_parser(srv.tool_call_parser, tokenizer.chat_template.source))


def _logged(defaults: SamplingDefaults) -> SamplingDefaults:
    """Say at start which of the model's sampling values replace OpenAI's defaults (as vLLM does)."""
    given = {k: v for k, v in dataclasses.asdict(defaults).items() if v is not None}
    if given:
        log.info("requests that omit them sample with the model's generation_config.json values: %s", given)
    return defaults


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences: each word as written (left-stripped), and with a
    leading space too when that is another token sequence of the same length (a word starting
    mid-text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(out)


@dataclass
class Prepared:
    """A parsed HTTP request (what the response needs) and the ``JobRequest`` it asks for: one
    per choice (``n``), ``job`` being the first."""

    req: CompletionRequest | ChatCompletionRequest
    job: JobRequest
    chat: bool
    jobs: tuple[JobRequest, ...] = ()
    rid: str = ""
    #: A chat request's tools (None: no tool calls are read from the output).
    tools: ToolPlan | None = None
    #: The prompt as echoed (completions' ``echo``): as sent, or its tokens decoded.
    prompt_text: str = ""

    @property
    def request_id(self) -> str:
        return self.rid or self.job.job_id

    @property
    def choices(self) -> tuple[JobRequest, ...]:
        return self.jobs or (self.job,)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.job.prompt_ids


class RequestPreparer:
    """A request body made into its jobs, or refused with an ``APIError`` naming the problem."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def check_auth(self, authorization: str | None) -> None:
        if self.ctx.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.ctx.api_key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           None, "invalid_api_key")

    def prepare_completion(self, raw: bytes) -> Prepared:
        req: CompletionRequest = parse_request(CompletionRequest, raw)
        self._check_request(req)
        ids = (self.ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
               if isinstance(req.prompt, str) else list(req.prompt))
        sent = len(ids)
        ids = req.truncated(ids, self.ctx.context_len)
        sampling = req.to_sampling(DEFAULT_COMPLETION_MAX_TOKENS, self.ctx.sampling_defaults)
        prep = self._prepared(req, f"cmpl-{uuid.uuid4().hex}", ids, sampling, False)
        if req.echo:
            # As sent, unless it was token ids or truncated: then its tokens decoded, specials too.
            prep.prompt_text = (req.prompt if isinstance(req.prompt, str) and len(ids) == sent
                                else self.ctx.tokenizer.decode(ids, skip_special_tokens=False))
        return prep

    def prepare_chat(self, raw: bytes) -> Prepared:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
        self._check_request(req)
        plan = req.tool_plan(self.ctx.tool_call_parser)
        ids = self._chat_prompt(req, plan)
        ids = req.truncated(ids, self.ctx.context_len)
        room = self.ctx.context_len - len(ids)
        if room < 1:
            raise bad_request(
                f"messages of {len(ids)} tokens leave no room to generate within the model's "
                f"context of {self.ctx.context_len} tokens", "messages", "context_length_exceeded")
        sampling = self._forced(req, plan, req.to_sampling(room, self.ctx.sampling_defaults))
        if plan.parses and self._markers_are_special(plan):
            # As vLLM's Hermes parser: the markers reach the parser even where they are special.
            req = req.model_copy(update={"skip_special_tokens": False})
        return self._prepared(req, f"chatcmpl-{uuid.uuid4().hex}", ids, sampling, True,
                              plan if plan.parses else None)

    @staticmethod
    def _forced(req: ChatCompletionRequest, plan: ToolPlan, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` held to the schema ``tool_choice`` required / named force (the grammar
        writes the call); checked with the grammar engine here, a 400 naming the field."""
        schema = plan.forced_schema()
        if schema is None:
            return sampling
        if req.min_tokens:
            raise bad_request("min_tokens cannot be honoured with a forced tool_choice: the grammar decides "
                              "where the call ends", "min_tokens")
        constraint = OutputConstraint.json_schema(schema)
        try:
            check_constraint(constraint)
            return constrained(sampling, constraint, "tool_choice")
        except GrammarError as exc:
            raise bad_request(f"the tools' parameters cannot be forced: {exc}", "tools") from None
        except ConstraintError as exc:
            raise bad_request(str(exc), exc.param) from None

    def _chat_prompt(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """The prompt's ids: the model's own template (its specials written by it) or the OPT
        fallback, given the tools (``fastserve.server.tools.chat_prompt_ids``)."""
        try:
            return chat_prompt_ids(self.ctx.tokenizer, [m.as_template_message() for m in req.messages],
                                   req.chat_options(), plan)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), exc.param) from None

    def _markers_are_special(self, plan: ToolPlan) -> bool:
        """Whether a marker of the plan's format is one special token of this tokenizer (it
        would vanish from text decoded with ``skip_special_tokens``)."""
        if plan.mode != "auto":
            return False
        tok = self.ctx.tokenizer
        for marker in PARSERS[plan.parser_name].markers:
            ids = tok.encode(marker, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in tok.special_token_ids:
                return True
        return False

    def _check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        limits = self.ctx.limits
        req.check_limits(limits.max_stop_strings, limits.max_stop_string_chars, limits.max_choices)
        if req.cache_salt is not None and not req.cache_salt:
            raise bad_request("cache_salt must be a non-empty string if provided", "cache_salt")
        if req.priority and not limits.allow_priority:
            # Refused, not dropped, as vLLM without its priority policy: any caller could jump the queue.
            raise bad_request(f"priority {req.priority} is not honoured: request priorities are off on this "
                              "server (server.allow_priority); send 0 or leave it out", "priority")

    def _check_model(self, model: str) -> None:
        if model != self.ctx.model_name:
            raise bad_request(f"the model '{model}' does not exist; this server serves "
                              f"'{self.ctx.model_name}'", "model", "model_not_found")

    def _prepared(self, req: CompletionRequest | ChatCompletionRequest, request_id: str, ids: list[int],
                  sampling: SamplingParams, chat: bool, tools: ToolPlan | None = None) -> Prepared:
        """The request's one validation (``validate_request``), then its ``JobRequest``."""
        sampling = replace(sampling, bad_words_ids=bad_words_ids(self.ctx.tokenizer, req.bad_word_texts()))
        try:
            validate_request(ids, sampling, self.ctx.vocab_size, self.ctx.context_len)
        except RequestError as exc:
            raise self.refusal(exc.code, str(exc), "messages" if chat else "prompt") from None
        named = (("stop_token_ids", "stop token id", sampling.stop_token_ids),
                 ("logit_bias", "logit_bias token id", [t for t, _ in sampling.logit_bias]),
                 ("allowed_token_ids", "allowed token id", sampling.allowed_token_ids or ()),
                 ("bad_words", "bad_words token id", [t for w in sampling.bad_words_ids for t in w]))
        for param, what, tokens in named:
            bad = [t for t in tokens if not 0 <= t < self.ctx.vocab_size]
            if bad:
                raise bad_request(f"{what} {bad[0]} is outside the vocabulary [0, {self.ctx.vocab_size})", param)
        n = req.num_choices
        jobs = tuple(JobRequest(choice_job_id(request_id, i, n), tuple(ids), choice_sampling(sampling, i),
                                priority=req.priority, cache_salt=req.cache_salt) for i in range(n))
        return Prepared(req, jobs[0], chat, jobs, request_id, tools)

    def refusal(self, code: ErrorCode, message: str, param: str | None) -> APIError:
        """The HTTP answer to a refused request: status, type and code come from ``code``."""
        template = REFUSAL_MESSAGES.get(code, "{}")
        headers = {"Retry-After": str(self.ctx.retry_after_s)} if code.retry else None
        return APIError(code.status, template.format(message), param if code.status == 400 else None,
                        code.wire_code, code.error_type, headers)
