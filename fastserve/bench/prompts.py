"""Real prompt texts for races against other servers: ShareGPT first turns and Alpaca
``instruction + input`` (as FastServe builds it) with their reference output lengths, scalable
for a slow CPU, Poisson arrivals; one seed gives every server the same prompts and times."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fastserve.bench import workloads as W

SHAREGPT_PROMPTS = W.DATA_DIR / "sharegpt_v3_prompts_sample3000.jsonl"
ALPACA_RECORDS = W.DATA_DIR / "alpaca_5000.json"
Dataset = Literal["sharegpt", "alpaca"]
DATASETS: tuple[Dataset, ...] = ("sharegpt", "alpaca")


@dataclass(frozen=True)
class PromptSample:
    """One prompt text and its lengths in OPT tokens (BOS included, as the server counts)."""

    text: str
    prompt_len: int
    output_len: int


def load_sharegpt_prompts(path: Path = SHAREGPT_PROMPTS) -> list[PromptSample]:
    out = []
    # One JSON object per "\n"-ended line (texts may hold other Unicode line breaks).
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(PromptSample(row["prompt"], int(row["prompt_tokens"]) + W.BOS_TOKENS,
                                int(row["output_tokens"]) + W.BOS_TOKENS))
    return out


def load_alpaca_prompts(path: Path = ALPACA_RECORDS, lengths: Path = W.ALPACA_CSV) -> list[PromptSample]:
    """Alpaca records joined with the lengths CSV (row i ↔ record i), FastServe's filter applied."""
    records = json.loads(path.read_text(encoding="utf-8"))
    pairs = W.load_alpaca_lengths(lengths, apply_filter=False)
    if len(pairs) != len(records):
        raise ValueError(f"{path.name} has {len(records)} records but {lengths.name} {len(pairs)} rows")
    return [PromptSample(r["instruction"] + r["input"], p.prompt_len, p.output_len)
            for r, p in zip(records, pairs, strict=True) if W.fastserve_keep(p.prompt_len, p.output_len)]


def load_prompts(dataset: Dataset) -> list[PromptSample]:
    if dataset == "sharegpt":
        return load_sharegpt_prompts()
    if dataset == "alpaca":
        return load_alpaca_prompts()
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def text_requests(samples: list[PromptSample], num_prompts: int, rate: float, seed: int,
                  output_scale: float = 1.0, part: int = 0) -> list[W.Request]:
    """Seeded samples with Poisson arrivals; ``part`` k takes the k-th run of one shuffle, so no two
    rates share a prompt (a prefix cache would find them)."""
    if num_prompts < 1 or (part + 1) * num_prompts > len(samples):
        raise ValueError(f"num_prompts × (part + 1) must be in [1, {len(samples)}], "
                         f"got {num_prompts} × {part + 1}")
    if output_scale <= 0:
        raise ValueError(f"output_scale must be positive, got {output_scale}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(samples))[part * num_prompts:(part + 1) * num_prompts]
    picked = [samples[int(i)] for i in order]
    arrivals = W.poisson_arrivals(num_prompts, rate, seed)
    return [W.Request(f"req-{k}", float(t), s.prompt_len, max(1, round(s.output_len * output_scale)), s.text)
            for k, (s, t) in enumerate(zip(picked, arrivals, strict=True))]
