"""Structured outputs' grammar engine, over llguidance: ``grammar_of`` and the ingress's tokenizer-free
``check_constraint``; ``GrammarCompiler`` (the token index and each distinct constraint compiled once);
``JobGrammars``, each constrained job's matcher, advanced by the tokens the scheduler gives it, and the
per-row masks of a plan. The state is the job's, not its KV's, so preemption, swaps and recompute
leave it alone. How and why: docs/configs.md, "Structured outputs". Imports no torch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import BatchEntry, BatchPlan, OutputConstraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

#: llguidance's log level for matchers: 0 = silent (errors are read with ``get_error``).
_SILENT = 0
#: llguidance's default limits, but a job's matcher error names the problem without the parser
#: state and the whole grammar (they would put a client's schema into the server log).
_QUIET_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


def grammar_of(constraint: OutputConstraint) -> str:
    """``constraint`` as llguidance's grammar; raises ``GrammarError`` for a payload that is not
    even well formed (a schema that is not JSON, a GBNF grammar that does not convert)."""
    options: JsonCompileOptions = {"whitespace_flexible": constraint.any_whitespace}
    kind = constraint.kind
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.spec, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
        return llguidance.grammar_from("grammar", constraint.spec)   # Lark, or GBNF converted to it
    except ValueError as exc:
        raise GrammarError(f"the {kind} cannot be compiled: {exc}") from None


def check_constraint(constraint: OutputConstraint) -> None:
    """Raise ``GrammarError`` with the engine's message when ``constraint`` does not compile
    (checked without the model's tokenizer: the ingress has no token index)."""
    message = llguidance.LLMatcher.validate_grammar(grammar_of(constraint))
    if message:
        raise GrammarError(f"the {constraint.kind} cannot be compiled: {message}")


@dataclass(frozen=True)
class TokenSpace:
    """The vocabulary a mask covers: the model's rows of logits (at least the tokenizer's ids)
    and its EOS ids (any of them ends a complete output)."""

    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: frozenset[int]

    @property
    def mask_vocab(self) -> int:
        """Tokens a mask has a bit for: the model's rows, or the tokenizer's ids if more."""
        return max(self.vocab_size, len(self.tokenizer))

    @property
    def mask_bytes(self) -> int:
        """Bytes of one packed mask: a bit per token, in whole little-endian 32-bit words."""
        return 4 * ((self.mask_vocab + 31) // 32)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer, once each (a bounded LRU by value).
    Thread-safe: the engine compiles on a worker thread while its loop copies cached ones."""

    def __init__(self, space: TokenSpace, cache_size: int) -> None:
        self.space = space
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._index: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[OutputConstraint, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0

    def index(self) -> llguidance.LLTokenizer:
        """The model's token index (built on first use: about a second for a 49K vocabulary)."""
        with self._lock:
            if self._index is None:
                space = self.space
                self._index = llguidance.LLTokenizer(space.tokenizer.backend.to_str(), n_vocab=space.mask_vocab,
                                                     eos_token=sorted(space.eos_token_ids) or None)
            return self._index

    def cached(self, constraint: OutputConstraint) -> bool:
        with self._lock:
            return constraint in self._compiled

    def compile(self, constraint: OutputConstraint) -> None:
        """Compile ``constraint`` into the cache (nothing if it is there); ``GrammarError`` if it
        cannot be compiled. Runs off the event loop (llguidance drops the GIL meanwhile)."""
        if self.cached(constraint):
            return
        grammar = grammar_of(constraint)
        matcher = llguidance.LLMatcher(self.index(), grammar, log_level=_SILENT, limits=_QUIET_LIMITS)
        if matcher.is_error():
            raise GrammarError(f"the {constraint.kind} cannot be compiled: {matcher.get_error()}")
        with self._lock:
            self.compiles += 1
            self._compiled[constraint] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A fresh matcher for one job (compiled first when not cached)."""
        with self._lock:
            pristine = self._compiled.get(constraint)
            if pristine is not None:
                self._compiled.move_to_end(constraint)
        if pristine is None:
            self.compile(constraint)
            return self.matcher(constraint)
        return pristine.deep_copy()


@dataclass
class JobGrammar:
    """One job's grammar state: its matcher, the tokens it consumed, and the mask computed for
    that many tokens (a job scheduled again before its next token reuses it)."""

    constraint: OutputConstraint
    matcher: llguidance.LLMatcher
    consumed: int = 0
    mask: bytes | None = None
    mask_at: int = -1
    failed: str = ""


class JobGrammars:
    """The grammar state of every constrained job (one owner: the engine core drives it). A plan's masks
    go into one buffer, on the engine's thread or on llguidance's pool (``mask_threads``)."""

    def __init__(self, compiler: GrammarCompiler, mask_threads: int = 0) -> None:
        self.compiler = compiler
        self.mask_threads = mask_threads
        self._pool: llguidance.LLExecutor | None = None
        self._jobs: dict[str, JobGrammar] = {}

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job_id: str, constraint: OutputConstraint) -> None:
        """A new job's grammar state, at its start (``GrammarError`` if it does not compile)."""
        self._jobs[job_id] = JobGrammar(constraint, self.compiler.matcher(constraint))

    def drop(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def clear(self) -> None:
        self._jobs.clear()

    def state(self, job_id: str) -> JobGrammar:
        return self._jobs[job_id]

    def advance(self, job_id: str, tokens: Iterable[int]) -> None:
        """The tokens the job was given, in order. A token the grammar rejects (the mask was
        not applied) leaves the matcher failed: its next mask is empty and the job fails."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        for token in tokens:
            job.consumed += 1
            if job.failed or job.matcher.is_stopped():
                continue   # the EOS that ends a complete output, or nothing more to check
            if not job.matcher.consume_token(token):
                job.failed = job.matcher.get_error() or f"token {token} is not allowed by the grammar"
                log.warning("job %s: its %s rejected token %d: %s", job_id, job.constraint.describe(),
                            token, job.failed)

    def mask(self, job_id: str) -> bytes:
        """The job's packed next-token mask (empty once its matcher failed)."""
        self._fill([job_id])
        mask = self._jobs[job_id].mask
        assert mask is not None
        return mask

    def with_masks(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` with a mask on each sampling entry of a constrained job (the same plan when
        it has none)."""
        rows = [e.job_id for e in plan.entries if e.samples and e.job_id in self._jobs]
        if not rows:
            return plan
        self._fill(rows)
        return replace(plan, entries=tuple(self._masked(e) for e in plan.entries))

    def _fill(self, job_ids: list[str]) -> None:
        """Compute the masks these jobs lack for the tokens they have (together, on the pool)."""
        stale = [self._jobs[j] for j in job_ids if self._jobs[j].mask_at != self._jobs[j].consumed]
        live = [job for job in stale if not job.failed]
        width = self.compiler.space.mask_bytes
        out = np.empty((len(live), width // 4), dtype=np.int32)
        if self.mask_threads and len(live) > 1:
            self._executor().unsafe_compute_mask_ptr([(job.matcher, i) for i, job in enumerate(live)],
                                                     out.ctypes.data, width, len(live))
        else:
            for job, row in zip(live, out, strict=True):
                job.matcher.unsafe_compute_mask_ptr(row.ctypes.data, width)
        for job, row in zip(live, out, strict=True):
            job.mask = row.tobytes()
        for job in stale:
            if not job.failed and job.matcher.is_error():
                job.failed = job.matcher.get_error()
                log.warning("its %s failed: %s", job.constraint.describe(), job.failed)
            if job.failed:
                job.mask = bytes(width)
            job.mask_at = job.consumed

    def _executor(self) -> llguidance.LLExecutor:
        if self._pool is None:
            self._pool = llguidance.LLExecutor(self.mask_threads)
        return self._pool

    def _masked(self, entry: BatchEntry) -> BatchEntry:
        if not entry.samples or entry.job_id not in self._jobs:
            return entry
        return replace(entry, token_mask=self.mask(entry.job_id))
