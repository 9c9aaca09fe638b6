"""The CPU-testable parts of the GPU step: one packed upload of a batch's index tensors, the
graphs' padded fixed-layout inputs and buckets, fused linears, and the transfer counter.

On a GPU the same code runs with page-locked staging, events and CUDA graphs (tests/gpu); here
the packing and padding logic is checked against ``ForwardBatch.build``'s tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fastserve.worker.graphs import DecodeGraphs, GraphSettings, capture_sizes, greedy_rows
from fastserve.worker.messages import BatchEntry, SamplingParams
from fastserve.worker.model.batch import ForwardBatch, HostBatch, StepBuffers
from fastserve.worker.model.linear import MergedLinear, ServingLinear
from fastserve.worker.model.shard import StageShard
from fastserve.worker.stage import plain_greedy
from tests.harness.host_reads import HostReads

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)
MIXED = (
    BatchEntry("a", (3, 4, 5, 6, 7), 6, (9, 2, 5), True, GREEDY, samples=False),   # a chunk with a prefix
    BatchEntry("b", (8,), 9, (1, 4, 7), False, GREEDY, 3),
    BatchEntry("c", (9, 10), 0, (0,), True, GREEDY),
    BatchEntry("d", (11,), 2, (6,), False, GREEDY, 1),
)
FIELDS = ("input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_context_lens",
          "sample_index", "logit_index", "prefill_block_tables", "prefill_cu_q", "prefill_cu_k")


def test_one_packed_upload_equals_a_tensor_per_field() -> None:
    want = ForwardBatch.build(MIXED, BLOCK_SIZE)
    buffers = StepBuffers("cpu")
    for _ in range(3):   # the staging slots in turn, reused
        got = buffers.upload(HostBatch.of(MIXED, BLOCK_SIZE))
        for name in FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert got.prefill_cu_seqlens == want.prefill_cu_seqlens == (0, 5, 7)
        assert (got.prefill_max_q, got.prefill_max_k) == (5, 11)
        assert got.prefill_start_pos == (6, 0) and got.block_ids == want.block_ids
    assert want.prefill_cu_k is not None and want.prefill_cu_k.tolist() == [0, 11, 13]
    assert want.logit_index is not None and want.logit_index.tolist() == [7, 6, 8]   # b, c, d: entry order


def test_capture_sizes_are_vllms() -> None:
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        capture_sizes(0)


class _Stub(nn.Module):
    def __init__(self, shard: StageShard) -> None:
        super().__init__()
        self.shard = shard


def _graphs(first: bool = True) -> DecodeGraphs:
    cache = torch.zeros(16, 1, 2, BLOCK_SIZE, 1, 8)
    shard = StageShard(0 if first else 1, 2, 2)
    return DecodeGraphs(_Stub(shard), cache, BLOCK_SIZE, GraphSettings(max_batch=16, max_context=32),  # type: ignore[arg-type]
                        hidden_size=8, samples=True)


def test_graph_inputs_are_padded_to_the_bucket_in_their_fixed_layout() -> None:
    graphs = _graphs()
    decode = tuple(e for e in MIXED if not e.is_prefill)
    host = HostBatch.of(decode, BLOCK_SIZE)
    assert graphs.fits(host, None) and graphs.bucket(2) == 2 and graphs.bucket(3) == 4
    graphs._stage(host, 4)
    v = graphs._inputs
    assert v["ids"][:4].tolist() == [8, 11, 0, 0]
    assert v["positions"][:4].tolist() == [9, 2, 0, 0]
    assert v["slots"][:4].tolist() == [7 * 4 + 1, 6 * 4 + 2, -1, -1]   # padding rows write nothing
    assert v["lens"][:4].tolist() == [10, 3, 1, 1]
    assert v["tables"].shape == (16, 8)
    assert v["tables"][:2, :3].tolist() == [[1, 4, 7], [6, 0, 0]] and v["tables"][2:4, 0].tolist() == [0, 0]


def test_graphs_serve_only_what_they_were_captured_for() -> None:
    graphs = _graphs()
    assert not graphs.fits(HostBatch.of(MIXED, BLOCK_SIZE), None)   # a prefill in the batch
    long_ctx = (BatchEntry("x", (1,), 40, tuple(range(11)), False, GREEDY),)   # past max_context 32
    assert not graphs.fits(HostBatch.of(long_ctx, BLOCK_SIZE), None)
    many = tuple(BatchEntry(str(i), (1,), 0, (i,), False, GREEDY) for i in range(17))
    assert not graphs.fits(HostBatch.of(many, BLOCK_SIZE), None)
    later = _graphs(first=False)
    one = HostBatch.of(many[:1], BLOCK_SIZE)
    assert not later.fits(one, None) and later.fits(one, torch.zeros(1, 8))
    assert not later.fits(one, torch.zeros(1, 9))


def test_greedy_rows_are_argmax_and_finiteness() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, float("nan"), 0.0], [2.0, -float("inf"), 1.0]])
    rows = greedy_rows(logits)
    assert rows[0, 0] == 1 and rows[0, 2] == 0      # a non-finite row's id is never read
    assert rows[1].tolist() == [1, 0, 0]


def test_plain_greedy_is_the_raw_argmax_only() -> None:
    entry = MIXED[1]
    assert plain_greedy(entry)
    for params in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.0, logprobs=1),
                   SamplingParams(temperature=0.0, logit_bias=((1, 2.0),)),
                   SamplingParams(temperature=0.0, allowed_token_ids=(1,))):
        assert not plain_greedy(BatchEntry("x", (1,), 0, (0,), False, params))


def test_fused_linears_are_views_of_one_weight_and_multiply_alike() -> None:
    torch.manual_seed(0)
    members = [ServingLinear(16, w, bias=True) for w in (8, 4, 4)]
    x = torch.randn(3, 16)
    want = [m(x) for m in members]
    merged = MergedLinear(*members)
    assert merged.fuse(with_bias=True)
    assert merged._fused is not None
    for m in members:
        assert m.weight.untyped_storage().data_ptr() == merged._fused.untyped_storage().data_ptr()
    for a, b in zip(merged(x), want, strict=True):
        torch.testing.assert_close(a, b)


def test_host_reads_count_writes_to_a_device_too() -> None:
    with HostReads() as transfers:
        torch.tensor([1, 2], device="meta")
        torch.ones(3).to("meta")
        torch.empty(3, device="meta").copy_(torch.ones(3))
        torch.ones(3).to("cpu")                       # stays on the host: nothing
        np.asarray(torch.ones(2).tolist())
    assert (transfers.reads, transfers.writes) == (1, 3), transfers.names
    with HostReads(device_only=True) as transfers:
        torch.ones(2).tolist()                        # a host tensor's values: no transfer
    assert transfers.count == 0
