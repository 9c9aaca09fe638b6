"""One worker's step: start the plan's swaps, run this stage's layers, (last stage) sample.

Shared by the in-process executor and the Ray stage workers, so both execute a plan the same way:
swaps are issued first and overlap the forward; the forward waits only on swaps that touch its
own blocks (the reactive case); the step returns after every swap it issued has completed, which
is what lets the control plane treat a plan's output as "its swaps are settled".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fastserve.worker.kv_store import KVStore, SwapHandle
from fastserve.worker.messages import BatchPlan, TokenLogprobs
from fastserve.worker.model.batch import ForwardBatch
from fastserve.worker.model.registry import Stage
from fastserve.worker.sampler import Sampler


@dataclass
class StageOutput:
    """What one worker's step produced: the sampled tokens (last stage), the hidden states for
    the next stage (None if the plan had no entries), seconds by phase, and the logprobs of the
    jobs that asked."""

    tokens: dict[str, int]
    hidden: torch.Tensor | None
    timings: dict[str, float]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class StageRunner:
    def __init__(self, model: Stage, kv: KVStore, sampler: Sampler | None = None) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler if sampler is not None else Sampler()
        self.device = kv.device

    def run(self, plan: BatchPlan, hidden: torch.Tensor | None, sample: bool) -> StageOutput:
        """The whole step of one worker: issue the plan's swaps, run this stage's layers over
        ``hidden`` (None on the first stage), sample when ``sample``, settle the swaps — even when
        the forward fails, so no copy lands in a block the control plane reuses."""
        start = time.perf_counter()
        timings: dict[str, float] = {}
        handles = self.begin_swaps(plan)
        tokens: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        out: torch.Tensor | None = None
        try:
            if plan.entries:
                batch = self.build_batch(plan, timings)
                out = self.forward(batch, hidden, timings)
                if sample:
                    tokens, logprobs = self.sample(plan, batch, out, timings)
        finally:
            self.finish_swaps(handles, timings)
        timings["total"] = time.perf_counter() - start
        return StageOutput(tokens, out, timings, logprobs)

    def begin_swaps(self, plan: BatchPlan) -> list[SwapHandle]:
        return [self.kv.swap(cmd) for cmd in (*plan.swap_out, *plan.swap_in)]

    def build_batch(self, plan: BatchPlan, timings: dict[str, float] | None = None) -> ForwardBatch:
        start = time.perf_counter()
        batch = ForwardBatch.build(plan.entries, self.kv.block_size, self.device)
        if timings is not None:
            timings["build"] = timings.get("build", 0.0) + time.perf_counter() - start
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None,
                timings: dict[str, float]) -> torch.Tensor:
        timings["swap_wait"] = timings.get("swap_wait", 0.0) + self.kv.wait_for(batch.block_ids)
        start = time.perf_counter()
        out = self.model(batch, self.kv.device_pool, hidden)
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - start
        return out

    @torch.inference_mode()
    def sample(self, plan: BatchPlan, batch: ForwardBatch, hidden: torch.Tensor,
               timings: dict[str, float]) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        start = time.perf_counter()
        # A prefill chunk short of its first iteration's last samples nothing (its logits would
        # be discarded), so its row is not even projected to the vocabulary.
        rows = [i for i, e in enumerate(plan.entries) if e.samples]
        if not rows:
            timings["sample"] = time.perf_counter() - start
            return {}, {}
        entries = [plan.entries[i] for i in rows]
        index = batch.sample_index if len(rows) == len(plan.entries) else batch.sample_index[rows]
        logits = self.model.logits(hidden[index])
        contexts = [e.context for e in entries]
        tokens, by_row = self.sampler.sample_with_logprobs(
            logits, [e.sampling for e in entries], [e.step_index for e in entries],
            contexts if any(c is not None for c in contexts) else None)
        timings["sample"] = time.perf_counter() - start
        # A row that could not be sampled is left out: the scheduler fails that job alone.
        return ({e.job_id: t for e, t in zip(entries, tokens, strict=True) if t is not None},
                {entries[row].job_id: lp for row, lp in by_row.items()})

    def finish_swaps(self, handles: list[SwapHandle], timings: dict[str, float]) -> None:
        start = time.perf_counter()
        for h in handles:
            h.wait()
        self.kv.wait_all()
        timings["swap_tail"] = timings.get("swap_tail", 0.0) + time.perf_counter() - start
        # On a GPU the forward's swap wait was a stall of the compute stream: read now, after the
        # step (its sampling already synced the host with that stream on the last stage; a stall
        # the device has not got past yet counts in a later step).
        stalled = self.kv.device_wait_s()
        if stalled:
            timings["swap_wait"] = timings.get("swap_wait", 0.0) + stalled
