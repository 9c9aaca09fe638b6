"""Load-test workloads: which requests arrive when, with how many prompt and output tokens.

Length sources (ShareGPT, Alpaca as FastServe's artifact filters them; fixed; Figure 14's ratios),
arrivals (Poisson, gamma, the Azure 2023 trace) and prompts of an exact token count; deterministic
given a seed. As FastServe counts: ``prompt_len`` includes OPT's BOS, ``output_len`` is the
reference output's count plus one (HF's OPT tokenizer prepends BOS to it too).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ALPACA_CSV",
    "AZURE_CODE_CSV",
    "AZURE_CONV_CSV",
    "BOS_TOKEN_ID",
    "DATA_DIR",
    "FIG14_RATIOS",
    "LengthPair",
    "Request",
    "SHAREGPT_CSV",
    "TraceRow",
    "arrivals_from_trace",
    "build_requests",
    "fastserve_keep",
    "filter_pairs",
    "fixed_length_pairs",
    "gamma_arrivals",
    "load_alpaca_lengths",
    "load_azure_trace",
    "load_sharegpt_lengths",
    "mean_rate",
    "poisson_arrivals",
    "ratio_sweep_pairs",
    "rescale_to_rate",
    "sample_pairs",
    "scale_lengths",
    "split_by_ratio",
    "synthesize_prompt_ids",
    "synthesize_prompt_text",
    "trace_requests",
    "with_prompt_text",
    "workload",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
SHAREGPT_CSV = DATA_DIR / "sharegpt_v3_first_pair_lengths_opt.csv"
ALPACA_CSV = DATA_DIR / "alpaca_5000_lengths_opt.csv"
AZURE_CONV_CSV = DATA_DIR / "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE_CSV = DATA_DIR / "AzureLLMInferenceTrace_code.csv"

# OPT: HF's tokenizer prepends </s> (id 2) to every string it encodes.
BOS_TOKEN_ID = 2
BOS_TOKENS = 1

# FastServe's artifact prunes prompt < 4 and output < 4, prompt > 1024, or a total > 2048.
FASTSERVE_MIN_LEN = 4
FASTSERVE_MAX_PROMPT_LEN = 1024
FASTSERVE_MAX_TOTAL_LEN = 2048

# Figure 14's input/output ratios, 0.25 .. 256.
FIG14_MIN_EXP = -2
FIG14_MAX_EXP = 8
FIG14_RATIOS: tuple[float, ...] = tuple(2.0**k for k in range(FIG14_MIN_EXP, FIG14_MAX_EXP + 1))

# Synthetic ids avoid OPT's specials and the ids past its real vocabulary: they embed like text.
SAFE_TOKEN_ID_MIN = 4
SAFE_TOKEN_ID_MAX = 50260  # exclusive

# One OPT token each, at the start and after a space: k of them are exactly k tokens.
# fmt: off
_FILLER_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "with",
    "as", "on", "was", "at", "by", "this", "from", "or", "an", "but",
)
# fmt: on

_REQUEST_ID_PREFIX = "req"
_AZURE_TIMESTAMP_UNIT = "datetime64[ns]"
_NS_PER_S = 1e9

# Independent random streams per concern, so changing the arrival rate does not resample lengths.
_STREAM_LENGTHS = 0
_STREAM_ARRIVALS = 1
_NUM_STREAMS = 2
_STREAM_PROMPTS = 2  # salt for with_prompt_text, which seeds one stream per request


@dataclass(frozen=True)
class Request:
    """One request of a workload. `arrival_s` is seconds from the start of the run."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "prompt_text": self.prompt_text,
        }


@dataclass(frozen=True)
class LengthPair:
    """A (prompt, output) length pair in tokens, BOS included as FastServe counts it."""

    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class TraceRow:
    """One Azure trace row: seconds since the trace's first row, and its token counts."""

    arrival_s: float
    context_tokens: int
    generated_tokens: int



def fastserve_keep(prompt_len: int, output_len: int) -> bool:
    too_short = prompt_len < FASTSERVE_MIN_LEN and output_len < FASTSERVE_MIN_LEN
    too_long = (
        prompt_len > FASTSERVE_MAX_PROMPT_LEN or prompt_len + output_len > FASTSERVE_MAX_TOTAL_LEN
    )
    return not (too_short or too_long)


def filter_pairs(pairs: Iterable[LengthPair]) -> list[LengthPair]:
    return [p for p in pairs if fastserve_keep(p.prompt_len, p.output_len)]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _with_bos(prompt_tokens: str, output_tokens: str) -> LengthPair:
    # The shipped counts exclude BOS; HF OPT (and so FastServe) counts it on both strings.
    return LengthPair(int(prompt_tokens) + BOS_TOKENS, int(output_tokens) + BOS_TOKENS)


def load_sharegpt_lengths(
    path: Path = SHAREGPT_CSV,
    human_gpt_only: bool = False,
    apply_filter: bool = True,
) -> list[LengthPair]:
    """ShareGPT-V3 turns 0 and 1 whatever their roles (FastServe's); `human_gpt_only`: as vLLM's paper."""
    pairs = [
        _with_bos(row["prompt_tokens"], row["output_tokens"])
        for row in _read_csv(path)
        if not human_gpt_only or (row["first_role"], row["second_role"]) == ("human", "gpt")
    ]
    return filter_pairs(pairs) if apply_filter else pairs


def load_alpaca_lengths(path: Path = ALPACA_CSV, apply_filter: bool = True) -> list[LengthPair]:
    pairs = [_with_bos(row["prompt_tokens"], row["output_tokens"]) for row in _read_csv(path)]
    return filter_pairs(pairs) if apply_filter else pairs


def fixed_length_pairs(n: int, prompt_len: int, output_len: int) -> list[LengthPair]:
    """The paper's "Fix-Len" workload: every job has the same lengths."""
    _require_positive(prompt_len=prompt_len, output_len=output_len)
    return [LengthPair(prompt_len, output_len)] * n


def split_by_ratio(ratio: float, total_tokens: int) -> LengthPair:
    """Split a token budget so that prompt/output ≈ `ratio`, both at least one token."""
    if ratio <= 0:
        raise ValueError(f"ratio must be positive, got {ratio}")
    min_total = 2
    if total_tokens < min_total:
        raise ValueError(f"total_tokens must be >= {min_total}, got {total_tokens}")
    prompt = round(total_tokens * ratio / (1.0 + ratio))
    prompt = min(max(prompt, 1), total_tokens - 1)
    return LengthPair(prompt, total_tokens - prompt)


def ratio_sweep_pairs(
    ratio: float, totals: Sequence[int] | int, n: int | None = None
) -> list[LengthPair]:
    """Figure 14: jobs of input/output `ratio`; `totals` one budget (with `n`) or one per job (real sizes)."""
    if isinstance(totals, int):
        if n is None:
            raise ValueError("n is required when totals is a single budget")
        return [split_by_ratio(ratio, totals)] * n
    return [split_by_ratio(ratio, t) for t in totals]


def sample_pairs(pairs: Sequence[LengthPair], n: int, seed: int) -> list[LengthPair]:
    """`n` pairs drawn uniformly, without replacement when the source is large enough."""
    if not pairs:
        raise ValueError("cannot sample from an empty length source")
    rng = np.random.default_rng(seed)
    replace_draws = n > len(pairs)
    index = rng.choice(len(pairs), size=n, replace=replace_draws)
    return [pairs[int(i)] for i in index]



def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> np.ndarray:
    """FastServe's: gaps ~ gamma(shape=1/cv², scale=cv²/rate), the first at 0; rate inf: all at 0."""
    if n <= 0:
        return np.zeros(0)
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be positive, got rate={rate}, cv={cv}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=1.0 / cv**2, scale=cv**2 / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    return gamma_arrivals(n, rate, cv=1.0, seed=seed)


def mean_rate(arrivals: Sequence[float] | np.ndarray) -> float:
    """Observed arrival rate: gaps between first and last arrival over the time they span."""
    times = np.asarray(arrivals, dtype=float)
    span = float(times[-1] - times[0]) if times.size else 0.0
    return (times.size - 1) / span if span > 0 else math.inf


def load_azure_trace(
    path: Path = AZURE_CONV_CSV,
    limit: int | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> list[TraceRow]:
    """Azure LLM inference trace 2023 rows; arrival seconds count from the first row kept."""
    rows = _read_csv(path)
    if not rows:
        return []
    stamps = np.array([r["TIMESTAMP"] for r in rows], dtype=_AZURE_TIMESTAMP_UNIT)
    seconds = (stamps - stamps[0]).astype(np.int64) / _NS_PER_S
    end_s = math.inf if duration_s is None else start_s + duration_s
    kept = [
        TraceRow(float(t), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
        for t, r in zip(seconds, rows, strict=True)
        if start_s <= t < end_s
    ][:limit]
    if not kept:
        return []
    origin = kept[0].arrival_s
    return [replace(row, arrival_s=row.arrival_s - origin) for row in kept]


def arrivals_from_trace(rows: Sequence[TraceRow], time_scale: float = 1.0) -> np.ndarray:
    """Trace timestamps, multiplied by `time_scale` (0.5 replays twice as fast)."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    return np.array([r.arrival_s * time_scale for r in rows], dtype=float)


def trace_requests(
    rows: Sequence[TraceRow],
    time_scale: float = 1.0,
    max_prompt_len: int = FASTSERVE_MAX_PROMPT_LEN,
    max_total_len: int = FASTSERVE_MAX_TOTAL_LEN,
) -> list[Request]:
    """Replay a trace, contexts clipped to OPT's window (Azure's counts come from another tokenizer)."""
    if max_prompt_len < 1 or max_total_len <= max_prompt_len:
        raise ValueError("need 1 <= max_prompt_len < max_total_len")
    arrivals = arrivals_from_trace(rows, time_scale)
    pairs = []
    for row in rows:
        prompt = min(max(row.context_tokens, 1), max_prompt_len)
        output = min(max(row.generated_tokens, 1), max_total_len - prompt)
        pairs.append(LengthPair(prompt, output))
    return build_requests(pairs, arrivals)


def rescale_to_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """Stretch or squeeze arrival times so the observed mean rate becomes `rate`."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    current = mean_rate([r.arrival_s for r in requests])
    if math.isinf(current):
        return list(requests)
    start = requests[0].arrival_s
    factor = current / rate
    return [replace(r, arrival_s=start + (r.arrival_s - start) * factor) for r in requests]



def build_requests(
    pairs: Sequence[LengthPair],
    arrivals: Sequence[float] | np.ndarray,
    id_prefix: str = _REQUEST_ID_PREFIX,
) -> list[Request]:
    """Zip lengths with arrival times, sorted by arrival (stable), ids numbered in arrival order."""
    if len(pairs) != len(arrivals):
        raise ValueError(f"{len(pairs)} length pairs but {len(arrivals)} arrival times")
    order = np.argsort(np.asarray(arrivals, dtype=float), kind="stable")
    return [
        Request(
            request_id=f"{id_prefix}-{k}",
            arrival_s=float(arrivals[int(i)]),
            prompt_len=pairs[int(i)].prompt_len,
            output_len=pairs[int(i)].output_len,
        )
        for k, i in enumerate(order)
    ]


def _child_seeds(seed: int) -> list[int]:
    children = np.random.SeedSequence(seed).spawn(_NUM_STREAMS)
    return [int(c.generate_state(1)[0]) for c in children]


def workload(
    pairs: Sequence[LengthPair],
    num_requests: int,
    rate: float,
    seed: int,
    cv: float = 1.0,
) -> list[Request]:
    """Sampled pairs with gamma arrivals; separate streams, so a rate sweep replays the same jobs."""
    seeds = _child_seeds(seed)
    sampled = sample_pairs(pairs, num_requests, seeds[_STREAM_LENGTHS])
    arrivals = gamma_arrivals(num_requests, rate, cv, seeds[_STREAM_ARRIVALS])
    return build_requests(sampled, arrivals)


def scale_lengths(requests: Sequence[Request], factor: float) -> list[Request]:
    """Every length times `factor` (at least 1), for slow CPUs; synthesized prompt text is dropped."""
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    return [
        replace(
            r,
            prompt_len=max(1, round(r.prompt_len * factor)),
            output_len=max(1, round(r.output_len * factor)),
            prompt_text=None,
        )
        for r in requests
    ]



def synthesize_prompt_ids(prompt_len: int, seed: int, add_bos: bool = True) -> list[int]:
    """Seeded ordinary-token ids; send them as ids (random ids need not re-tokenize to the count)."""
    _require_positive(prompt_len=prompt_len)
    body = prompt_len - BOS_TOKENS if add_bos else prompt_len
    rng = np.random.default_rng(seed)
    ids = rng.integers(SAFE_TOKEN_ID_MIN, SAFE_TOKEN_ID_MAX, size=body).tolist()
    return [BOS_TOKEN_ID, *ids] if add_bos else ids


def synthesize_prompt_text(prompt_len: int, seed: int) -> str:
    """Meaningless text OPT's tokenizer encodes to exactly `prompt_len` ids, BOS included."""
    _require_positive(prompt_len=prompt_len)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(_FILLER_WORDS), size=prompt_len - BOS_TOKENS)
    return " ".join(_FILLER_WORDS[int(i)] for i in picks)


def with_prompt_text(requests: Sequence[Request], seed: int) -> list[Request]:
    """Attach synthesized prompt text of the exact length to every request (seeded per request)."""
    seeds = np.random.SeedSequence([seed, _STREAM_PROMPTS]).spawn(len(requests))
    return [
        replace(r, prompt_text=synthesize_prompt_text(r.prompt_len, int(s.generate_state(1)[0])))
        for r, s in zip(requests, seeds, strict=True)
    ]


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
