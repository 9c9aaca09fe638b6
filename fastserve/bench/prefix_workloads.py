"""Workloads whose prompts share prefixes, from the ShareGPT prompts we ship (``bench/data``).

* Multi-turn chat: each conversation sends its turns in order, each after the previous answer,
  with the whole history, so turn k+1 repeats turns 1..k; conversations start at Poisson times.
  The data holds first turns only, so later user turns are other conversations' first turns.
* Shared system prompt: one long system prompt (ShareGPT texts joined) before every request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from fastserve.bench import chat as C
from fastserve.bench import workloads as W
from fastserve.bench.client import (
    STATUS_HTTP_ERROR,
    ClientConfig,
    _Observed,
    _stream_one,
    check_base_url,
    resolve_model,
)
from fastserve.bench.prompts import PromptSample

#: Words of the default shared system prompt (about 1.3 OPT tokens a word: ~650 tokens).
DEFAULT_SYSTEM_WORDS = 500


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    start_s: float
    user_turns: tuple[str, ...]
    max_tokens: int          # per answer


def conversations(samples: Sequence[PromptSample], num: int, turns: int, rate: float, seed: int,
                  max_tokens: int) -> list[Conversation]:
    if num < 1 or turns < 1 or max_tokens < 1:
        raise ValueError(f"num, turns and max_tokens must be >= 1, got {num}, {turns}, {max_tokens}")
    if num * turns > len(samples):
        raise ValueError(f"{num} conversations x {turns} turns need {num * turns} prompts, "
                         f"the dataset has {len(samples)}")
    picked = random.Random(seed).sample(range(len(samples)), num * turns)
    starts = W.poisson_arrivals(num, rate, seed)
    return [Conversation(f"conv{i}", float(starts[i]),
                         tuple(samples[j].text for j in picked[i * turns:(i + 1) * turns]),
                         max_tokens) for i in range(num)]


def shared_system_prompt(samples: Sequence[PromptSample], words: int = DEFAULT_SYSTEM_WORDS,
                         seed: int = 0) -> str:
    """One long system prompt: ShareGPT prompt texts in a seeded order, joined, cut at ``words``."""
    order = random.Random(seed).sample(range(len(samples)), len(samples))
    out: list[str] = []
    for i in order:
        out.extend(samples[i].text.split())
        if len(out) >= words:
            break
    return "You are a helpful assistant. Background notes follow.\n" + " ".join(out[:words])


async def run_conversations(convs: Sequence[Conversation], config: ClientConfig,
                            transport: httpx.AsyncBaseTransport | None = None) -> list[dict[str, Any]]:
    """One record per turn, in (conversation, turn) order."""
    base = check_base_url(config.base_url, config.allow_remote)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: dict[tuple[int, int], dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, limits=limits,
                                 transport=transport) as client:
        model = config.model or await resolve_model(client)
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        async def play(index: int, conv: Conversation) -> None:
            await asyncio.sleep(max(conv.start_s - clock(), 0.0))
            history = C.chat_messages("", config.system_prompt)[:-1]   # the system message, if any
            for turn, text in enumerate(conv.user_turns):
                history.append({"role": "user", "content": text})
                req = W.Request(f"{conv.conversation_id}-t{turn}", clock(), 0, conv.max_tokens, text)
                body = C.chat_body(text, model, conv.max_tokens, config.temperature, None,
                                   config.seed + index)
                body["messages"] = list(history)
                body.update(config.extra_body)
                obs = _Observed(req)
                try:
                    await _stream_one(client, obs, body, clock, "chat")
                except (httpx.HTTPError, ValueError) as exc:
                    obs.status, obs.error, obs.end = STATUS_HTTP_ERROR, repr(exc), clock()
                records[(index, turn)] = {**obs.to_dict(), "conversation": conv.conversation_id,
                                          "turn": turn}
                if obs.error is not None or obs.status == STATUS_HTTP_ERROR:
                    return   # the conversation cannot go on without its answer
                history.append({"role": "assistant", "content": "".join(obs.text)})

        tasks = [asyncio.create_task(play(i, c)) for i, c in enumerate(convs)]
        _, pending = await asyncio.wait(tasks, timeout=config.max_total_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [records[k] for k in sorted(records)]


def hit_rate(records: Sequence[dict[str, Any]]) -> float | None:
    """Cached over reported prompt tokens (no details reported: none cached)."""
    prompts = sum(r.get("prompt_tokens") or 0 for r in records)
    if not prompts:
        return None
    return sum(r.get("cached_tokens") or 0 for r in records) / prompts
