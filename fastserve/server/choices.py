"""What a request with several choices or logprobs needs at the ingress: the ``n`` fan-out (one job
per choice, seeded ``seed + index`` as vLLM does), one merged event stream, and OpenAI's and vLLM's
logprob shapes (chat, legacy completions with ``echo``, ``prompt_logprobs``); -inf is sent as
``LOGPROB_FLOOR``, since JSON has no infinity.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import SamplingParams, TokenLogprobs

#: The logprob sent for an impossible token (vLLM's floor).
LOGPROB_FLOOR = -9999.0

T = TypeVar("T")


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: the request's, its seed (if any) shifted by the index."""
    if sampling.seed is None or index == 0:
        return sampling
    return replace(sampling, seed=sampling.seed + index)


def choice_job_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of every stream as they come, tagged with the stream's index; an error in one
    stream is raised here (the caller's ``finally`` closes the others)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None, False))
        except BaseException as exc:   # re-raised by the reader
            await queue.put((index, None, exc, True))
            return
        await queue.put((index, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                live -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class LogprobFormatter:
    """One choice's logprobs in the endpoint's shape, one delta at a time (the completions
    ``text_offset`` runs on across deltas, over the output text). ``as_ids``: each token is
    named ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``: a token that is not
    valid UTF-8 on its own stays identifiable)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_ids: bool = False) -> None:
        self._tok = tokenizer
        self._chat = chat
        self._as_ids = as_ids
        self._offset = 0

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self.token_text(token_id)

    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        if self._chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]}
        tokens, values, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            name = self.token_name(token_id)
            tokens.append(name)
            values.append(_logprob(lp.logprob))
            top = {self.token_name(t): _logprob(v) for t, v in lp.top}
            top.setdefault(name, _logprob(lp.logprob))   # OpenAI: the sampled token is always there
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(self.token_text(token_id))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def format_prompt(self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The echoed prompt in the completions shape: its first token with ``null`` logprobs
        (nothing came before it), then one entry per ``logprobs`` (the prompt's own, one per
        token after the first); the text offsets run on into the completion's."""
        first = self.token_name(prompt_ids[0])
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self._offset]}
        self._offset += len(self.token_text(prompt_ids[0]))
        rest = self.format(prompt_ids[1:], logprobs)
        return merge_logprobs([head, rest], chat=False)

    def prompt_logprobs(self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: ``None`` for the first token, then per token a dict by
        token id (a JSON key: a string) of ``{logprob, rank, decoded_token}``, the prompt token
        first (with its rank), then its top alternatives (ranks 1, 2, ...)."""
        out: list[Any] = [None]
        for token_id, lp in zip(prompt_ids[1:], logprobs, strict=True):
            entry = {str(token_id): self._ranked(token_id, lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), self._ranked(t, v, rank))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _logprob(value), "rank": rank, "decoded_token": self.token_name(token_id)}

    def _chat_entry(self, token_id: int, lp: TokenLogprobs) -> dict[str, Any]:
        entry = self._alternative(token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(t, v) for t, v in lp.top]
        return entry

    def _alternative(self, token_id: int, value: float) -> dict[str, Any]:
        return {"token": self.token_name(token_id), "logprob": _logprob(value),
                "bytes": list(self._tok.token_bytes(token_id))}


def merge_logprobs(parts: Sequence[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """Several deltas' formatted logprobs as one (a non-streaming response)."""
    if chat:
        return {"content": [e for p in parts for e in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}
