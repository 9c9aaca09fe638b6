"""The tensor layout of one mixed iteration, built from a plan's entries.

A batch packs every job's new tokens into one flat sequence: first-iteration (prefill) jobs
first, with their whole token run, then decode jobs, one token each. Attention runs varlen causal
attention over the prefill part and paged attention over the decode part; every token's K/V is
written to its cache slot first. ``sample_index[i]`` is where entry ``i``'s last token sits, so
outputs come back in the plan's entry order.

A prefill entry may be a chunk of a first iteration (chunked prefill) starting at
``start_pos > 0``: its tokens then also attend to the prefix its earlier chunks cached, which
``prefill_start_pos`` and ``prefill_block_tables`` locate (see ``fastserve.worker.model.attention``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastserve.worker.messages import BatchEntry, blocks_for


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens], 0-based (OPT's offset is the model's business)
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset
    num_prefill_tokens: int
    #: Cumulative starts [num_prefill_seqs + 1] of the prefill sequences, kept on the host:
    #: attention slices by them in every layer, and reading them from a device tensor would
    #: stall the host on the GPU once per layer.
    prefill_cu_seqlens: tuple[int, ...]
    decode_block_tables: torch.Tensor  # int32 [num_decode_seqs, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decode_seqs]
    sample_index: torch.Tensor  # int64 [num_entries], in entry order
    block_ids: frozenset[int]  # every device block this batch reads or writes
    #: Per prefill sequence, the position its tokens start at (> 0: a chunk with a cached prefix).
    prefill_start_pos: tuple[int, ...] = ()
    #: int32 [num_prefill_seqs, max_blocks]: where each prefill's blocks live (its cached prefix
    #: and its new tokens, padded with 0); None when the batch has no prefill.
    prefill_block_tables: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_decode(self) -> int:
        return int(self.decode_context_lens.numel())

    @classmethod
    def build(
        cls,
        entries: Sequence[BatchEntry],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        prefill = [(i, e) for i, e in enumerate(entries) if e.is_prefill]
        decode = [(i, e) for i, e in enumerate(entries) if not e.is_prefill]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        sample_index = [0] * len(entries)
        blocks: set[int] = set()
        for i, e in prefill + decode:
            _check_entry(e, block_size)
            span = range(e.start_pos, e.context_len)
            ids.extend(e.token_ids)
            positions.extend(span)
            slots.extend(e.block_table[p // block_size] * block_size + p % block_size for p in span)
            sample_index[i] = len(ids) - 1
            blocks.update(e.block_table[: blocks_for(e.context_len, block_size)])
            if e.is_prefill:
                cu.append(len(ids))
        tables, max_blocks = _padded_tables([e for _, e in decode], block_size)
        as_long = {"dtype": torch.int64, "device": device}
        as_int = {"dtype": torch.int32, "device": device}
        starts = tuple(e.start_pos for _, e in prefill)
        prefill_tables = None
        if prefill:
            rows, width = _padded_tables([e for _, e in prefill], block_size)
            prefill_tables = torch.tensor(rows, **as_int).reshape(len(rows), width)  # type: ignore[arg-type]
        return cls(
            input_ids=torch.tensor(ids, **as_long),  # type: ignore[arg-type]
            positions=torch.tensor(positions, **as_long),  # type: ignore[arg-type]
            slot_mapping=torch.tensor(slots, **as_long),  # type: ignore[arg-type]
            num_prefill_tokens=cu[-1],
            prefill_cu_seqlens=tuple(cu),
            decode_block_tables=torch.tensor(tables, **as_int).reshape(len(decode), max_blocks),  # type: ignore[arg-type]
            decode_context_lens=torch.tensor([e.context_len for _, e in decode], **as_int),  # type: ignore[arg-type]
            sample_index=torch.tensor(sample_index, **as_long),  # type: ignore[arg-type]
            block_ids=frozenset(blocks),
            prefill_start_pos=starts,
            prefill_block_tables=prefill_tables,
        )


def _padded_tables(entries: Sequence[BatchEntry], block_size: int) -> tuple[list[list[int]], int]:
    """Each entry's blocks up to its context, padded with 0 to the longest; and that width."""
    width = max((blocks_for(e.context_len, block_size) for e in entries), default=0)
    tables = [list(e.block_table[:width]) for e in entries]
    return [t + [0] * (width - len(t)) for t in tables], width


def _check_entry(e: BatchEntry, block_size: int) -> None:
    if not e.token_ids:
        raise ValueError(f"job {e.job_id}: entry has no tokens")
    if e.start_pos < 0:
        raise ValueError(f"job {e.job_id}: start_pos must be >= 0, got {e.start_pos}")
    if not e.is_prefill and len(e.token_ids) != 1:
        raise ValueError(f"job {e.job_id}: a decode step feeds one token, got {len(e.token_ids)}")
    if len(e.block_table) < blocks_for(e.context_len, block_size):
        raise ValueError(
            f"job {e.job_id}: {len(e.block_table)} blocks cannot hold {e.context_len} tokens "
            f"at block_size {block_size}"
        )
