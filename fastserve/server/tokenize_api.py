"""vLLM's ``/tokenize`` and ``/detokenize``, and OpenAI's ``/v1/models`` and ``/v1/models/{id}``:
the routes that answer from the served model's identity and tokenizer alone, in vLLM's shapes,
refusing by name every field we do not honour (docs/operations.md). ``tokenize_response`` and
``detokenize_response`` are shared with the Ray Serve LLM adapter.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fastserve.chat_template import ChatOptions, ChatTemplateError
from fastserve.server.protocol import APIError, ChatMessage, bad_request, parse_request
from fastserve.server.request_limits import read_body
from fastserve.server.tools import ToolDefinition, ToolRequestError, chat_prompt_ids, tool_plan

if TYPE_CHECKING:
    from fastserve.server.ingress import OpenAIServer
    from fastserve.server.ingress_requests import ServerContext


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list[ToolDefinition] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """The body as ``model``; an unknown field is refused by name (never ignored)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None   # parse_request says why
    if isinstance(body, dict):
        unknown = sorted(set(body) - set(model.model_fields))
        if unknown:
            raise bad_request(f"the field '{unknown[0]}' is not supported here; supported: "
                              f"{', '.join(model.model_fields)}", unknown[0], "unsupported_field")
    return parse_request(model, raw)


def check_model(ctx: ServerContext, model: str | None) -> None:
    """No model (the only one), or the one this server serves."""
    if model is not None and model != ctx.model_name:
        raise bad_request(f"the model '{model}' does not exist; this server serves '{ctx.model_name}'",
                          "model", "model_not_found")


def tokenize_response(ctx: ServerContext, raw: bytes) -> dict[str, Any]:
    """``/tokenize``: a ``prompt`` or chat ``messages`` as token ids (vLLM's answer)."""
    chat = _has_messages(raw)
    req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, raw)
    check_model(ctx, req.model)
    tok = ctx.tokenizer
    if isinstance(req, TokenizeChatRequest):
        options = ChatOptions(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs or {},
                              req.add_special_tokens)
        try:   # the chat endpoint's own encoding, so /tokenize gives the ids it would prefill
            plan = tool_plan(req.tools, "none", None, ctx.tool_call_parser)
            ids = chat_prompt_ids(tok, [m.as_template_message() for m in req.messages], options, plan)
        except (ChatTemplateError, ToolRequestError) as exc:
            raise bad_request(str(exc), exc.param) from None
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.context_len, "tokens": ids, "token_strs": strs}


def detokenize_response(ctx: ServerContext, raw: bytes) -> dict[str, Any]:
    """``/detokenize``: token ids as text, special tokens kept (vLLM's answer)."""
    req: DetokenizeRequest = _parse(DetokenizeRequest, raw)
    check_model(ctx, req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _has_messages(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(body, dict) and "messages" in body


def model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "fastserve"}


def models_list(ctx: ServerContext) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(ctx)]}


def model_or_404(ctx: ServerContext, model_id: str) -> dict[str, Any]:
    if model_id != ctx.model_name:
        raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{ctx.model_name}'",
                       "model", "model_not_found")
    return model_card(ctx)


def add_routes(api: FastAPI, server: OpenAIServer) -> None:
    """These routes on ``api``, API key checked; tokenization runs off the event loop."""
    ctx = server.ctx

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.preparer.check_auth(request.headers.get("authorization"))
        return JSONResponse(models_list(ctx))

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        server.preparer.check_auth(request.headers.get("authorization"))
        return JSONResponse(model_or_404(ctx, model_id))

    @api.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        server.preparer.check_auth(request.headers.get("authorization"))
        raw = await read_body(request, ctx.limits.max_request_bytes)
        return JSONResponse(await asyncio.to_thread(tokenize_response, ctx, raw))

    @api.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        server.preparer.check_auth(request.headers.get("authorization"))
        raw = await read_body(request, ctx.limits.max_request_bytes)
        return JSONResponse(await asyncio.to_thread(detokenize_response, ctx, raw))
