"""What the OpenAI-compatible server sends back: completion and chat bodies and their chunks,
``usage``, and ``StopStringMatcher``. The request side is ``fastserve.server.protocol``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class StopStringMatcher:
    """Finds OpenAI stop strings in streamed text and trims them off. ``push`` holds back the last
    ``len(longest stop) - 1`` characters, which could begin one; the earliest match wins."""

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self._include = include
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text accepted so far (trimmed at a matched stop string)."""
        return self._text

    def push(self, delta: str, check: bool = True) -> str:
        """``check=False``: accept the text without looking for stop strings (before
        ``min_tokens``); a later check still sees the held-back tail."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self._text) - self._hold)
        self._text += delta
        if self._stop and check:
            hits = [(i, k) for k, i in enumerate(self._text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                at, k = min(hits)
                self._text = self._text[: at + (len(self._stop[k]) if self._include else 0)]
                self.stopped = True
                return self._release(len(self._text))
        return self._release(max(self._sent, len(self._text) - self._hold))

    def flush(self) -> str:
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        out = self._text[self._sent:upto]
        self._sent = max(self._sent, upto)
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens`` details only when the prefix cache served some."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


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
