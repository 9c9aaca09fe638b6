"""The tensor layout of one mixed iteration: every job's new tokens in one flat sequence, prefill
entries first, then decodes; ``sample_index[i]`` is where entry ``i``'s last token sits. On a GPU
``StepBuffers`` stages the index arrays and sends them in one non-blocking copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastserve.worker.messages import BatchEntry, blocks_for
from fastserve.worker.parallel import explicit_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens], 0-based (OPT's offset is the model's business)
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset
    num_prefill_tokens: int
    #: Cumulative prefill starts [num_prefill_seqs + 1], on the host: read in every layer.
    prefill_cu_seqlens: tuple[int, ...]
    decode_block_tables: torch.Tensor  # int32 [num_decode_seqs, max_blocks]
    decode_context_lens: torch.Tensor  # int32 [num_decode_seqs]
    sample_index: torch.Tensor  # int64 [num_entries], in entry order
    block_ids: frozenset[int]  # every device block this batch reads or writes
    #: Per prefill sequence, its first position (> 0: a chunk with a cached prefix).
    prefill_start_pos: tuple[int, ...] = ()
    #: int32 [num_prefill_seqs, max_blocks], 0-padded; None without prefill, as cu_q and cu_k.
    prefill_block_tables: torch.Tensor | None = None
    #: int32 [num_prefill_seqs + 1] cumulative new tokens and context lengths, on the device.
    prefill_cu_q: torch.Tensor | None = None
    prefill_cu_k: torch.Tensor | None = None
    prefill_max_q: int = 0
    prefill_max_k: int = 0
    #: int64: ``sample_index`` of the entries that sample (the rows the LM head projects).
    logit_index: torch.Tensor | None = None

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
        buffers: StepBuffers | None = None,
    ) -> ForwardBatch:
        """The batch of ``entries`` on ``device``, through ``buffers`` where given."""
        host = HostBatch.of(entries, block_size)
        return buffers.upload(host) if buffers is not None else cls.build_from(host, device)

    @classmethod
    def build_from(cls, host: HostBatch, device: torch.device | str) -> ForwardBatch:
        as_long = {"dtype": torch.int64, "device": device}
        as_int = {"dtype": torch.int32, "device": device}
        prefill_tables = cu_q = cu_k = None
        if host.prefill_tables.shape[0]:
            prefill_tables = torch.tensor(host.prefill_tables, **as_int)  # type: ignore[arg-type]
            cu_q = torch.tensor(host.cu_q, **as_int)  # type: ignore[arg-type]
            cu_k = torch.tensor(host.cu_k, **as_int)  # type: ignore[arg-type]
        return host.batch(
            input_ids=torch.tensor(host.ids, **as_long),  # type: ignore[arg-type]
            positions=torch.tensor(host.positions, **as_long),  # type: ignore[arg-type]
            slot_mapping=torch.tensor(host.slots, **as_long),  # type: ignore[arg-type]
            decode_block_tables=torch.tensor(host.decode_tables, **as_int),  # type: ignore[arg-type]
            decode_context_lens=torch.tensor(host.decode_lens, **as_int),  # type: ignore[arg-type]
            sample_index=torch.tensor(host.sample_index, **as_long),  # type: ignore[arg-type]
            logit_index=torch.tensor(host.logit_index, **as_long),  # type: ignore[arg-type]
            prefill_block_tables=prefill_tables, prefill_cu_q=cu_q, prefill_cu_k=cu_k)


@dataclass
class HostBatch:
    """A batch's index arrays on the host (numpy; dtypes and shapes as ``ForwardBatch``'s)."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    sample_index: np.ndarray
    logit_index: np.ndarray
    decode_tables: np.ndarray
    decode_lens: np.ndarray
    prefill_tables: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    cu_seqlens: tuple[int, ...]
    start_pos: tuple[int, ...]
    block_ids: frozenset[int]

    @classmethod
    def of(cls, entries: Sequence[BatchEntry], block_size: int) -> HostBatch:
        prefill = [(i, e) for i, e in enumerate(entries) if e.is_prefill]
        decode = [(i, e) for i, e in enumerate(entries) if not e.is_prefill]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        cu_k = [0]
        sample_index = [0] * len(entries)
        blocks: set[int] = set()
        for i, e in prefill + decode:
            _check_entry(e, block_size)
            span = range(e.start_pos, e.context_len)
            ids.extend(e.token_ids)
            positions.extend(span)
            table = e.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
            sample_index[i] = len(ids) - 1
            blocks.update(table[: blocks_for(e.context_len, block_size)])
            if e.is_prefill:
                cu.append(len(ids))
                cu_k.append(cu_k[-1] + e.context_len)
        tables, width = _padded_tables([e for _, e in decode], block_size)
        rows, prefill_width = _padded_tables([e for _, e in prefill], block_size)
        return cls(
            ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(positions, dtype=np.int64),
            slots=np.asarray(slots, dtype=np.int64), sample_index=np.asarray(sample_index, dtype=np.int64),
            logit_index=np.asarray([sample_index[i] for i, e in enumerate(entries) if e.samples], dtype=np.int64),
            decode_tables=np.asarray(tables, dtype=np.int32).reshape(len(decode), width),
            decode_lens=np.asarray([e.context_len for _, e in decode], dtype=np.int32),
            prefill_tables=np.asarray(rows, dtype=np.int32).reshape(len(prefill), prefill_width),
            cu_q=np.asarray(cu, dtype=np.int32), cu_k=np.asarray(cu_k, dtype=np.int32),
            cu_seqlens=tuple(cu), start_pos=tuple(e.start_pos for _, e in prefill), block_ids=frozenset(blocks))

    @property
    def max_q(self) -> int:
        return int(np.diff(self.cu_q).max()) if len(self.cu_q) > 1 else 0

    @property
    def max_k(self) -> int:
        return int(np.diff(self.cu_k).max()) if len(self.cu_k) > 1 else 0

    def batch(self, *, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              decode_block_tables: torch.Tensor, decode_context_lens: torch.Tensor, sample_index: torch.Tensor,
              logit_index: torch.Tensor, prefill_block_tables: torch.Tensor | None,
              prefill_cu_q: torch.Tensor | None, prefill_cu_k: torch.Tensor | None) -> ForwardBatch:
        return ForwardBatch(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            num_prefill_tokens=self.cu_seqlens[-1], prefill_cu_seqlens=self.cu_seqlens,
            decode_block_tables=decode_block_tables, decode_context_lens=decode_context_lens,
            sample_index=sample_index, block_ids=self.block_ids, prefill_start_pos=self.start_pos,
            prefill_block_tables=prefill_block_tables, prefill_cu_q=prefill_cu_q, prefill_cu_k=prefill_cu_k,
            prefill_max_q=self.max_q, prefill_max_k=self.max_k, logit_index=logit_index)


#: Alignment of each packed array (bytes), so every typed view is aligned.
PACK_ALIGN = 16
#: Host staging slots used in turn, so filling one never waits on the copy out of the other.
STAGING_SLOTS = 2


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


class Packing:
    def __init__(self, fields: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
        self.fields: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in fields:
            self.fields[name] = (offset, np.dtype(dtype), shape)
            offset += _aligned(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        self.nbytes = offset

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, (offset, dtype, shape) in self.fields.items():
            count = int(np.prod(shape, dtype=np.int64))
            torch_dtype = torch.int64 if dtype == np.int64 else torch.int32
            out[name] = flat[offset: offset + count * dtype.itemsize].view(torch_dtype).view(shape)
        return out


def _batch_packing(host: HostBatch) -> Packing:
    return Packing([
        ("ids", np.int64, host.ids.shape), ("positions", np.int64, host.positions.shape),
        ("slots", np.int64, host.slots.shape), ("sample_index", np.int64, host.sample_index.shape),
        ("logit_index", np.int64, host.logit_index.shape),
        ("decode_tables", np.int32, host.decode_tables.shape), ("decode_lens", np.int32, host.decode_lens.shape),
        ("prefill_tables", np.int32, host.prefill_tables.shape), ("cu_q", np.int32, host.cu_q.shape),
        ("cu_k", np.int32, host.cu_k.shape)])


class StepBuffers:
    """Persistent staging for a step's index tensors: pinned host slots used in turn and one device
    buffer, grown as needed. The host waits only for the copy out of the same slot two steps ago."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = explicit_device(device)
        self._host = [torch.empty(0, dtype=torch.uint8) for _ in range(STAGING_SLOTS)]
        self._copied: list[torch.cuda.Event | None] = [None] * STAGING_SLOTS
        self._turn = 0
        self._device_flat = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._on_cuda = self.device.type == "cuda"

    def reserve(self, nbytes: int) -> None:
        """Every host slot at least ``nbytes`` now (page-locking memory is slow: not mid-step)."""
        for slot in range(STAGING_SLOTS):
            if self._host[slot].numel() < nbytes:
                self._host[slot] = torch.empty(_grown(nbytes), dtype=torch.uint8, pin_memory=self._on_cuda)

    def stage(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A host slot of at least ``nbytes`` free to fill, and its index."""
        slot = self._turn
        self._turn = (self._turn + 1) % STAGING_SLOTS
        event = self._copied[slot]
        if event is not None:
            event.synchronize()
        if self._host[slot].numel() < nbytes:
            self._host[slot] = torch.empty(_grown(nbytes), dtype=torch.uint8, pin_memory=self._on_cuda)
        return self._host[slot], slot

    def send(self, host: torch.Tensor, slot: int, device_flat: torch.Tensor, nbytes: int) -> None:
        device_flat[:nbytes].copy_(host[:nbytes], non_blocking=True)
        if not self._on_cuda:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied[slot] = event

    def upload(self, batch: HostBatch) -> ForwardBatch:
        packing = _batch_packing(batch)
        host, slot = self.stage(packing.nbytes)
        fill(packing.views(host), batch)
        if self._device_flat.numel() < packing.nbytes:
            self._device_flat = torch.empty(_grown(packing.nbytes), dtype=torch.uint8, device=self.device)
        self.send(host, slot, self._device_flat, packing.nbytes)
        dev = packing.views(self._device_flat)
        has_prefill = batch.prefill_tables.shape[0] > 0
        return batch.batch(
            input_ids=dev["ids"], positions=dev["positions"], slot_mapping=dev["slots"],
            decode_block_tables=dev["decode_tables"], decode_context_lens=dev["decode_lens"],
            sample_index=dev["sample_index"], logit_index=dev["logit_index"],
            prefill_block_tables=dev["prefill_tables"] if has_prefill else None,
            prefill_cu_q=dev["cu_q"] if has_prefill else None, prefill_cu_k=dev["cu_k"] if has_prefill else None)


def _grown(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


def fill(views: dict[str, torch.Tensor], batch: HostBatch) -> None:
    for name in views:
        src = getattr(batch, name)
        dst = views[name].numpy()
        if src.ndim == 2 and dst.ndim == 2:
            dst[: src.shape[0], : src.shape[1]] = src
        else:
            dst.reshape(-1)[: src.size] = src.reshape(-1)


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
