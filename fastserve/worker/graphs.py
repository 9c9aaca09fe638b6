"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use, over one
fixed input buffer and a shared pool. A step that is all decodes within the largest bucket replays
(padding rows write no KV); any other runs eagerly, with the same kernels.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastserve.worker.messages import blocks_for
from fastserve.worker.model.batch import ForwardBatch, HostBatch, Packing, StepBuffers
from fastserve.worker.model.registry import Stage

#: The first buckets below the multiples of 8 (vLLM's capture sizes).
SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8
#: Padding rows: a slot the KV write skips, a one-token context over block 0.
PAD_SLOT = -1
PAD_CONTEXT = 1
PAD_BLOCK = 0
#: Eager runs before a capture: kernels compiled, cuBLAS handles and workspaces made.
WARMUP_RUNS = 2


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to ``max_batch``: 1, 2, 4, 8, 16, 24, ..."""
    if max_batch < 1:
        raise ValueError(f"cuda_graph_max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in SMALL_BUCKETS if b <= max_batch] + list(range(BUCKET_STEP, max_batch + 1, BUCKET_STEP))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


@dataclass(frozen=True)
class GraphSettings:
    """Whether decode steps replay CUDA graphs (GPU only), and the bounds a graph serves."""

    enabled: bool = True
    max_batch: int = 256
    max_context: int = 8192


@dataclass
class GraphOutputs:
    """What one replay left in the graph's static tensors, cut to the batch's rows."""

    hidden: torch.Tensor
    logits: torch.Tensor | None
    #: int64 [2, bucket]: argmax ids, finiteness (1/0); one contiguous copy to the host.
    greedy_full: torch.Tensor | None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    logits: torch.Tensor | None
    greedy: torch.Tensor | None


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[2, rows]`` int64: argmax, and 1 where the row is finite (a float64 sum of float32 cannot
    overflow, so it is finite exactly when every logit is)."""
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float64))
    return torch.stack((logits.argmax(dim=-1), finite.to(torch.int64)))


class DecodeGraphs:
    def __init__(self, model: Stage, cache: torch.Tensor, block_size: int, settings: GraphSettings,
                 hidden_size: int, samples: bool) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.settings = settings
        self.samples = samples
        self.buckets = capture_sizes(settings.max_batch)
        self.width = blocks_for(settings.max_context, block_size)
        top = self.buckets[-1]
        # Tables last: a step copies the small arrays and only the first `bucket` table rows.
        self.packing = Packing([("ids", np.int64, (top,)), ("positions", np.int64, (top,)),
                                ("slots", np.int64, (top,)), ("lens", np.int32, (top,)),
                                ("tables", np.int32, (top, self.width))])
        self.device = cache.device
        self._flat = torch.zeros(self.packing.nbytes, dtype=torch.uint8, device=self.device)
        self._inputs = self.packing.views(self._flat)
        self._staging = StepBuffers(self.device)
        self._staging.reserve(self.packing.nbytes)
        self._first = bool(model.shard.is_first)
        dtype = cache.dtype
        self._hidden_in = None if self._first else torch.zeros(top, hidden_size, dtype=dtype, device=self.device)
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None

    def fits(self, host: HostBatch, hidden: torch.Tensor | None) -> bool:
        """Whether this step can replay a graph (later stages: hidden states of the captured shape)."""
        n = len(host.decode_lens)
        if n == 0 or len(host.cu_seqlens) > 1 or n > self.buckets[-1]:
            return False
        if host.decode_tables.shape[1] > self.width:
            return False
        if self._first:
            return True
        return (hidden is not None and self._hidden_in is not None and hidden.shape[0] == n
                and hidden.shape[1:] == self._hidden_in.shape[1:])

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def run(self, host: HostBatch, hidden: torch.Tensor | None) -> GraphOutputs:
        """Copy the batch in, replay (capturing first if new), return outputs cut to its rows."""
        n = len(host.decode_lens)
        b = self.bucket(n)
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        self._stage(host, b)
        if self._hidden_in is not None and hidden is not None:
            self._hidden_in[:n].copy_(hidden)
        captured = self._graphs[b]
        captured.graph.replay()
        return GraphOutputs(captured.hidden[:n], None if captured.logits is None else captured.logits[:n],
                            captured.greedy)

    def _stage(self, host: HostBatch, b: int) -> None:
        n = len(host.decode_lens)
        end = self.packing.fields["tables"][0] + b * self.width * 4
        staging, slot = self._staging.stage(self.packing.nbytes)
        views = {name: v.numpy() for name, v in self.packing.views(staging).items()}
        views["ids"][:n], views["ids"][n:b] = host.ids, 0
        views["positions"][:n], views["positions"][n:b] = host.positions, 0
        views["slots"][:n], views["slots"][n:b] = host.slots, PAD_SLOT
        views["lens"][:n], views["lens"][n:b] = host.decode_lens, PAD_CONTEXT
        width = host.decode_tables.shape[1]
        views["tables"][:n, :width] = host.decode_tables
        views["tables"][n:b, 0] = PAD_BLOCK
        self._staging.send(staging, slot, self._flat, end)

    def _batch(self, b: int) -> ForwardBatch:
        """The forward batch over the graph's inputs for bucket ``b`` (views: fixed addresses)."""
        v = self._inputs
        return ForwardBatch(input_ids=v["ids"][:b], positions=v["positions"][:b], slot_mapping=v["slots"][:b],
                            num_prefill_tokens=0, prefill_cu_seqlens=(0,), decode_block_tables=v["tables"][:b],
                            decode_context_lens=v["lens"][:b], sample_index=v["ids"][:0], block_ids=frozenset())

    def _body(self, b: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        batch = self._batch(b)
        hidden_in = None if self._hidden_in is None else self._hidden_in[:b]

        def body() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            hidden = self.model(batch, self.cache, hidden_in)
            if not self.samples:
                return hidden, None, None
            logits = self.model.logits(hidden)
            return hidden, logits, greedy_rows(logits)
        return body

    def _capture(self, b: int) -> _Captured:
        """Warm up eagerly, then capture bucket ``b``; waits for the device, once per bucket."""
        self._pad_inputs()
        body = self._body(b)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # torch's default capture stream lives on whichever device was current when first made.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=side,
                                                      capture_error_mode="thread_local"):
            hidden, logits, greedy = body()
        self._pool = graph.pool()
        return _Captured(graph, hidden, logits, greedy)

    def _pad_inputs(self) -> None:
        v = self._inputs
        v["ids"].zero_()
        v["positions"].zero_()
        v["slots"].fill_(PAD_SLOT)
        v["lens"].fill_(PAD_CONTEXT)
        v["tables"].fill_(PAD_BLOCK)
