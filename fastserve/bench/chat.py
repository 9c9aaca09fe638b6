"""Real-EOS chat workloads: prompts sent as chat requests that end where the model ends them.
Owns the ``max_tokens`` cap rule, the chat request body (no ``ignore_eos``; usage streamed, so the
received length is the server's ``completion_tokens``) and the summary of the lengths received."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from fastserve.bench import workloads as W

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
#: The default cap keeps the reference length (scale 1) so the model has room to finish.
DEFAULT_EOS_OUTPUT_SCALE = 1.0
DEFAULT_MIN_TOKENS = 16
DEFAULT_MAX_TOKENS: int | None = None
#: The smaller context of the two servers: our demo's max_model_len (SmolLM2 trains on 8,192).
DEFAULT_CONTEXT_LEN = 2048
#: What the chat template adds around the prompt, and the gap between OPT's counts and the model's.
DEFAULT_TEMPLATE_MARGIN = 64
_P50, _P90, _P99 = 50.0, 90.0, 99.0
_PERCENTILE_METHOD: Final = "linear"


@dataclass(frozen=True)
class EosCap:
    """How a chat request's ``max_tokens`` follows from the dataset's reference output length."""

    output_scale: float = DEFAULT_EOS_OUTPUT_SCALE
    min_tokens: int = DEFAULT_MIN_TOKENS
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    context_len: int = DEFAULT_CONTEXT_LEN
    template_margin: int = DEFAULT_TEMPLATE_MARGIN

    def __post_init__(self) -> None:
        if self.output_scale <= 0:
            raise ValueError(f"output_scale must be positive, got {self.output_scale}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {self.min_tokens}")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens {self.max_tokens} is below min_tokens {self.min_tokens}")

    def cap(self, reference_output_len: int, prompt_len: int) -> int:
        """``ceil(reference × scale)`` clipped, then to the room the context leaves (at least 1)."""
        tokens = max(math.ceil(reference_output_len * self.output_scale), self.min_tokens)
        if self.max_tokens is not None:
            tokens = min(tokens, self.max_tokens)
        room = self.context_len - prompt_len - self.template_margin
        return max(1, min(tokens, room))


def cap_requests(requests: Sequence[W.Request], cap: EosCap) -> list[W.Request]:
    """The requests with ``output_len`` replaced by the cap (their reference lengths unscaled)."""
    return [W.Request(r.request_id, r.arrival_s, r.prompt_len, cap.cap(r.output_len, r.prompt_len),
                      r.prompt_text) for r in requests]


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": prompt})
    return messages


def chat_body(prompt: str, model: str, max_tokens: int, temperature: float,
              system_prompt: str | None = None, seed: int | None = None) -> dict[str, Any]:
    """A streaming chat request that stops at the model's EOS (no ``ignore_eos``)."""
    body: dict[str, Any] = {"model": model, "messages": chat_messages(prompt, system_prompt),
                            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if seed is not None and temperature > 0:
        body["seed"] = seed
    return body


def chat_chunk_tokens(chunk: Mapping[str, Any]) -> int:
    """Choices of a chat chunk that carry content; token ids count one each where sent."""
    count = 0
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            count += len(ids)
        elif (choice.get("delta") or {}).get("content"):
            count += 1
    return count


@dataclass(frozen=True)
class OutputLengths:
    """The output lengths a run received (completed requests only) and how they finished."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    stop_share: float
    length_share: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def output_lengths(records: Sequence[Mapping[str, Any]], completed: str = "ok") -> OutputLengths:
    done = [r for r in records if r.get("status") == completed]
    if not done:
        return OutputLengths(0, math.nan, math.nan, math.nan, math.nan, 0, math.nan, math.nan)
    data = np.asarray([int(r["output_tokens"]) for r in done], dtype=float)
    p50, p90, p99 = np.percentile(data, [_P50, _P90, _P99], method=_PERCENTILE_METHOD)
    reasons = [r.get("finish_reason") for r in done]
    return OutputLengths(count=len(done), mean=float(data.mean()), p50=float(p50), p90=float(p90),
                         p99=float(p99), max=int(data.max()),
                         stop_share=reasons.count(FINISH_STOP) / len(done),
                         length_share=reasons.count(FINISH_LENGTH) / len(done))


def format_output_lengths(lengths: OutputLengths) -> str:
    """One readable line: ``output tokens: n 20, mean 88.2, P50 …, stop 85 % / length 15 %``."""
    if lengths.count == 0:
        return "output tokens: no completed request"
    return (f"output tokens: n {lengths.count}, mean {lengths.mean:.1f}, P50 {lengths.p50:.0f}, "
            f"P90 {lengths.p90:.0f}, P99 {lengths.p99:.0f}, max {lengths.max}; finished by stop "
            f"{100 * lengths.stop_share:.0f} %, by length {100 * lengths.length_share:.0f} %")


def add_mode_args(parser: argparse.ArgumentParser) -> None:
    """The request-mode flags shared by ``fastserve.bench.client`` and ``fastserve.bench.race``."""
    parser.add_argument("--mode", choices=("completions", "chat"), default="completions",
                        help="completions: ignore_eos, exact lengths (dummy model, the paper); "
                             "chat: real EOS, prompt text as one user message (a real model)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--system-prompt", default=None, help="chat mode: a system message first")
    parser.add_argument("--eos-output-scale", type=float, default=DEFAULT_EOS_OUTPUT_SCALE,
                        help="chat mode: max_tokens = reference output length × this, clipped")
    parser.add_argument("--eos-min-tokens", type=int, default=DEFAULT_MIN_TOKENS,
                        help="chat mode: floor of max_tokens")
    parser.add_argument("--eos-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="chat mode: ceiling of max_tokens (default: none)")
    parser.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN,
                        help="chat mode: max_tokens ≤ this − prompt tokens − --template-margin")
    parser.add_argument("--template-margin", type=int, default=DEFAULT_TEMPLATE_MARGIN)


def eos_cap_from_args(args: argparse.Namespace) -> EosCap:
    return EosCap(output_scale=args.eos_output_scale, min_tokens=args.eos_min_tokens,
                  max_tokens=args.eos_max_tokens, context_len=args.context_len,
                  template_margin=args.template_margin)
