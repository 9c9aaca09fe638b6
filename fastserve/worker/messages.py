"""The data plane's contract: what the control plane sends to the workers and what comes back.

Stdlib-only, picklable dataclasses (no torch, no tensors), so policy modules can import them. Block ids
are logical: every stage and rank holds the same ids for its own layers and heads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: Why a job stopped: EOS or a stop token/string, ``max_tokens``, cancelled or gone, the engine failed it.
FinishReason = Literal["stop", "length", "abort", "error"]

SwapDirection = Literal["out", "in"]

#: Tokens per KV block unless configured otherwise (``kv_cache.block_size``).
DEFAULT_BLOCK_SIZE = 16


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that hold ``num_tokens`` positions (ceiling division)."""
    return -(-num_tokens // block_size)


#: What an ``OutputConstraint`` holds the output to (vLLM's ``structured_outputs`` kinds).
ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class OutputConstraint:
    """What the generated text must match (structured outputs): one kind and its payload.

    ``spec`` is a schema as canonical JSON (sorted keys, so equal schemas are equal constraints), a regex
    the whole output matches, or a Lark/GBNF grammar; ``choices`` for ``choice``. A hashable value: the
    engine compiles each distinct one once (``fastserve.structured``), and that compile judges the payload.
    """

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool, any_whitespace: bool = True) -> OutputConstraint:
        """A JSON-schema constraint from the parsed schema (a dict, or ``true``/``false``)."""
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")),
                   any_whitespace=any_whitespace)

    @classmethod
    def json_object(cls, any_whitespace: bool = True) -> OutputConstraint:
        return cls("json_object", any_whitespace=any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> OutputConstraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> OutputConstraint:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> OutputConstraint:
        return cls("grammar", text)

    def validate(self) -> None:
        """Raise ``ValueError`` naming what is malformed before any compile."""
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs a non-empty {self.kind}")
        if self.kind == "choice" and (not self.choices or any(not c for c in self.choices)):
            raise ValueError(f"a choice constraint needs a non-empty list of non-empty strings, "
                             f"got {list(self.choices)}")

    def describe(self) -> str:
        """A short name for logs and errors (the payload's first characters)."""
        body = repr(list(self.choices)) if self.kind == "choice" else self.spec
        return f"{self.kind} {body[:80]!r}" if body else self.kind


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, with OpenAI's and vLLM's meaning for each field.

    ``temperature == 0`` is greedy; ``top_k <= 0``, ``top_p == 1``, ``min_p == 0`` disable those filters.
    A ``seed`` seeds each step's generator with ``(seed, step index)``, so batching cannot change the
    tokens. ``logprobs`` and ``prompt_logprobs`` (None = not asked) read the raw distribution, before
    bias, penalties and temperature. ``bad_words_ids`` bans a word's last token once the rest of it
    was just generated.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    constraint: OutputConstraint | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending value."""
        if self.constraint is not None:
            self.constraint.validate()
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got "
                             f"{list(self.allowed_token_ids)}")
        if any(not word or min(word) < 0 for word in self.bad_words_ids):
            raise ValueError(f"bad_words_ids must hold non-empty token id sequences, got {self.bad_words_ids}")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias):
                raise ValueError(f"logit_bias entry {token}: {bias} needs a token id >= 0 and a finite bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the job's token history (``SamplingContext``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def context(self, prompt_ids: tuple[int, ...], generated: Sequence[int],
                eos_token_ids: frozenset[int]) -> SamplingContext | None:
        """What the next step's sampling needs beyond these params (None: nothing, the common
        case): the history penalties read, and EOS and stop ids while short of ``min_tokens``."""
        suppress: tuple[int, ...] = ()
        if len(generated) < self.min_tokens:
            suppress = self.stop_token_ids + (() if self.ignore_eos else tuple(sorted(eos_token_ids)))
        suppress += self.banned_words(generated)
        if not suppress and not self.uses_penalties:
            return None
        return SamplingContext(tuple(generated) if self.uses_penalties else (),
                               prompt_ids if self.repetition_penalty != 1.0 else (), suppress)

    def banned_words(self, generated: Sequence[int]) -> tuple[int, ...]:
        """The last tokens of the bad words the generated tail would complete next (vLLM's rule)."""
        banned = []
        for word in self.bad_words_ids:
            head = len(word) - 1
            if head == 0 or (len(generated) >= head and tuple(generated[len(generated) - head:]) == word[:-1]):
                banned.append(word[-1])
        return tuple(banned)

    def finish_reason(self, token_id: int, num_generated: int,
                      eos_token_ids: frozenset[int]) -> FinishReason | None:
        """Whether generation stops after ``token_id``, the ``num_generated``-th token (before
        ``min_tokens`` only ``max_tokens`` ends it, as in vLLM)."""
        stop_token = (not self.ignore_eos and token_id in eos_token_ids) or token_id in self.stop_token_ids
        if stop_token and num_generated >= self.min_tokens:
            return "stop"
        if num_generated >= self.max_tokens:
            return "length"
        return None


@dataclass(frozen=True)
class SamplingContext:
    """What one row's sampling needs beyond its ``SamplingParams``; sent only for a row that uses it.

    The data plane keeps no per-job state, so the penalties' history travels with each step;
    ``suppress_ids`` are masked this step (EOS and stop ids before ``min_tokens``, banned words).
    """

    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    suppress_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability, the ``top`` most likely ``(token id, logprob)`` pairs, most likely
    first, and (prompt tokens) its ``rank``, 1 = the most likely."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class BatchEntry:
    """One job's part of one iteration: ``token_ids`` fed at positions ``start_pos ..``.

    A prefill (or a recompute, or one chunk of either) feeds many tokens, a decode one.
    ``block_table`` holds positions ``0 .. context_len``; ``step_index`` (tokens generated so far)
    seeds sampling.
    """

    job_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    is_prefill: bool
    sampling: SamplingParams
    step_index: int = 0
    #: False for a prefill chunk before the last: no token comes back for it.
    samples: bool = True
    #: Penalty history and masked tokens, only for an entry whose sampling needs them.
    context: SamplingContext | None = None
    #: The tokens the grammar allows next, bit ``t % 32`` of little-endian 32-bit word ``t // 32``.
    token_mask: bytes | None = None
    #: Row ``r`` scores ``prompt_targets[r]``, the prompt token at ``start_pos + r + 1``.
    prompt_targets: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SwapCommand:
    """Copy one job's blocks between tiers (``out``: device to host): ``src_blocks[k]`` to ``dst_blocks[k]``."""

    direction: SwapDirection
    job_id: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.src_blocks) != len(self.dst_blocks):
            raise ValueError(
                f"swap {self.direction} for {self.job_id}: {len(self.src_blocks)} source blocks "
                f"but {len(self.dst_blocks)} destination blocks"
            )


@dataclass(frozen=True)
class BatchPlan:
    """One iteration for the whole pipeline: swaps to start (out, then in, beside the forward), entries to run.

    A swap may move blocks no entry uses (a proactive swap).
    """

    step_id: int
    entries: tuple[BatchEntry, ...]
    swap_out: tuple[SwapCommand, ...] = ()
    swap_in: tuple[SwapCommand, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)


@dataclass
class StepOutput:
    """What the last stage returns for one plan: one token per sampling entry, and seconds by phase.

    It comes back once the plan's swaps are done on every worker, so every block it swapped is settled.
    """

    step_id: int
    tokens: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)

