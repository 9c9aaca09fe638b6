"""The data plane's contract: what the control plane sends to the workers and what comes back.

Stdlib only (no torch): policy modules in ``fastserve/`` import these types without pulling torch in.
Everything here is a plain, picklable dataclass; no tensors cross this boundary.

Block ids are *logical*: every pipeline stage and tensor-parallel rank holds the same block ids
for its own layers and heads, so one plan addresses the whole pipeline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: Why a job stopped. ``stop`` = EOS or a stop token/string, ``length`` = ``max_tokens`` reached,
#: ``abort`` = the client went away or the job was cancelled, ``error`` = the engine failed it.
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

    ``json_schema``: ``spec`` is the schema as canonical JSON text (``OutputConstraint.json_schema``
    writes it with sorted keys, so equal schemas are equal constraints); ``json_object``: any JSON
    object, ``spec`` empty; ``regex``: the whole output matches the pattern ``spec``; ``choice``:
    the output is exactly one of ``choices``; ``grammar``: ``spec`` is a context-free grammar in
    Lark syntax (llguidance's, which may embed a JSON schema as ``%json{...}``) or GBNF (``::=``
    rules, llama.cpp's / vLLM's EBNF). ``any_whitespace`` (JSON kinds): whether the JSON may hold
    whitespace beyond single separators (vLLM's ``disable_any_whitespace`` turns it off).

    A value, hashable: the engine compiles each distinct constraint once and caches it by value.
    The payload is not checked here; the grammar engine (``fastserve.structured``) compiles it,
    and a constraint it cannot compile fails its request with the engine's message.
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
    """Per-request decoding settings (OpenAI / vLLM semantics).

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible: the same seed and prompt give the same tokens, whatever
    else shares the batch (each step draws from a generator seeded by ``(seed, step index)``).
    ``min_p`` (0 disables it) drops tokens less likely than ``min_p`` times the most likely one.

    ``min_tokens``: neither EOS nor a ``stop_token_ids`` token can end the job before it has
    generated that many tokens (the sampler masks them, ``BatchEntry.context.suppress_ids``).
    Penalties follow vLLM: ``presence_penalty`` / ``frequency_penalty`` (OpenAI, over generated
    tokens) subtract ``presence * [count > 0] + frequency * count``; ``repetition_penalty`` (HF,
    over prompt and generated tokens) divides positive logits by it and multiplies negative ones.
    ``logprobs`` (None = not asked) returns the sampled token's log-probability and that many
    most likely alternatives, of the model's raw distribution (before penalties and temperature).
    ``prompt_logprobs`` (vLLM's; None = not asked) returns, for every prompt token but the first,
    its log-probability given the tokens before it, its rank, and that many most likely
    alternatives (raw distribution too): what evaluation harnesses score a continuation by.
    ``logit_bias`` (OpenAI's, as (token id, bias) pairs by id) is added to those tokens' logits
    before penalties, masks and temperature, so it steers greedy decoding too;
    ``allowed_token_ids`` (vLLM's; None = all) keeps only those tokens sampleable;
    ``bad_words_ids`` (vLLM's ``bad_words``, tokenized at the ingress) bans a word's last token
    whenever the tokens generated last are the rest of it (a one-token word: always).
    ``constraint`` (structured outputs; None = free text) holds the output to a JSON schema,
    regex, choice or grammar: the engine keeps each job's grammar state and sends a per-row
    token mask with each step's plan.
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
        """Whether generation stops after emitting ``token_id`` as the ``num_generated``-th token;
        every id of the model's ``eos_token_ids`` stops it (unless ``ignore_eos``).

        Before ``min_tokens`` tokens nothing but ``max_tokens`` ends the job (as vLLM's stop check;
        the sampler masks EOS and stop ids until then, so they are not sampled)."""
        stop_token = (not self.ignore_eos and token_id in eos_token_ids) or token_id in self.stop_token_ids
        if stop_token and num_generated >= self.min_tokens:
            return "stop"
        if num_generated >= self.max_tokens:
            return "length"
        return None


@dataclass(frozen=True)
class SamplingContext:
    """What one row's sampling needs beyond its ``SamplingParams``; sent only for a row that uses it.

    The data plane keeps no per-job state, so a job whose sampling uses penalties sends its
    history each step: ``output_ids`` (generated so far: presence, frequency and repetition
    penalties) and ``prompt_ids`` (repetition penalty only). ``suppress_ids`` are tokens masked
    this step: EOS and ``stop_token_ids`` while the job has fewer than ``min_tokens`` tokens.
    """

    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    suppress_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the ``top`` most likely ``(token id, logprob)`` pairs, most
    likely first (of the raw model distribution; see ``SamplingParams.logprobs``): the sampled
    token's, or a prompt token's (``SamplingParams.prompt_logprobs``), which also has its
    ``rank`` in that distribution (1 = the most likely; None where not computed)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class BatchEntry:
    """One job's part of one iteration.

    ``token_ids`` are the tokens fed this step, at positions ``start_pos ..``. A first iteration
    (``is_prefill``) feeds the whole prompt with ``start_pos == 0``; a recompute after the job's KV
    was dropped feeds prompt + generated tokens the same way. A decode step feeds one token.
    With chunked prefill a first iteration is split: each chunk is a prefill entry whose
    ``start_pos`` is where the previous chunk ended (its KV for ``0 .. start_pos`` is cached), and
    only the last chunk has ``samples`` set; the others return no token.
    ``block_table`` lists the device blocks holding positions ``0 .. start_pos + len(token_ids)``.
    ``step_index`` is how many tokens the job has generated before this step (seeds sampling).
    """

    job_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    is_prefill: bool
    sampling: SamplingParams
    step_index: int = 0
    #: Whether this entry's last position is sampled: False only for a prefill chunk that is not
    #: its first iteration's last (its logits are discarded; ``StepOutput.tokens`` omits it).
    samples: bool = True
    #: Penalty history and masked tokens, only for an entry whose sampling needs them.
    context: SamplingContext | None = None
    #: Structured outputs: the tokens the job's grammar allows next, one bit per token id
    #: (little-endian 32-bit words, bit ``t % 32`` of word ``t // 32``); every other token is
    #: masked before sampling and logprobs. Set by the engine (``fastserve.structured``) on a
    #: sampling entry of a constrained job; None = no grammar.
    token_mask: bytes | None = None
    #: Prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt tokens this entry's first
    #: rows predict, row ``r``'s logits scoring ``prompt_targets[r]`` (the prompt token at
    #: position ``start_pos + r + 1``). Empty for an entry that asks none: it pays nothing.
    prompt_targets: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SwapCommand:
    """Copy one job's blocks between tiers: ``out`` = device -> host, ``in`` = host -> device.

    ``src_blocks[k]`` is copied to ``dst_blocks[k]``; ids are device ids on the device side and
    host ids on the host side.
    """

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
    """One iteration for the whole pipeline: swaps to start, entries to run.

    Every stage applies ``swap_out`` then ``swap_in`` to its own KV (asynchronously, overlapped with
    compute), then runs ``entries``. A swap may target blocks no entry of this plan uses: that is
    the proactive case, finished in the background. The data plane keeps no per-job state, so
    nothing tells it a job is gone.
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
    """What the last stage returns for one plan: one sampled token per sampling entry, and timings.

    A plan's output comes back only once its swaps have completed on every worker: swaps run
    beside the plan's forward (overlapped with it, paper Fig. 9b) and are awaited at the end.
    So when the control plane sees plan k's output, every block that plan swapped is settled:
    a swapped-in job is resident and a swapped-out job's device blocks may be reused.

    ``timings`` holds seconds by phase: ``swap_wait`` (forward blocked on a swap touching its
    blocks), ``forward``, ``sample``, ``swap_tail`` (waiting for swaps after the forward), ``total``.
    ``logprobs`` holds the sampled tokens' log-probabilities for the jobs that asked;
    ``prompt_logprobs`` each prompt-logprob entry's rows (``BatchEntry.prompt_targets``), in order.
    """

    step_id: int
    tokens: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    #: Only for the jobs whose sampling asked for logprobs (``SamplingParams.logprobs``).
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    #: Only for the entries with ``prompt_targets``: one per target, in order.
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)

