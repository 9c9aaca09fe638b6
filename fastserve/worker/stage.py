"""One worker's step, the same for the in-process executor and the Ray stage workers: start the plan's
swaps, run this stage's layers (waiting only on swaps that touch their blocks), and on the last stage sample.

On CPU a step returns once its swaps are done, so a plan's output means its swaps are settled. On a GPU
each swap is tracked by its copy's event and a later step that touches its blocks waits on the device
(``KVStore.settles_lazily``), decode replays a CUDA graph, and the host reads the tokens once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastserve.worker.graphs import DecodeGraphs, GraphSettings, greedy_rows
from fastserve.worker.kv_store import KVStore, SwapHandle
from fastserve.worker.messages import BatchEntry, BatchPlan, TokenLogprobs
from fastserve.worker.model.batch import ForwardBatch, HostBatch, StepBuffers
from fastserve.worker.model.registry import Stage
from fastserve.worker.sampler import Sampler, prompt_token_logprobs

#: Bytes of float32 logits one prompt-logprobs pass projects at most: bounds a long prompt's memory.
PROMPT_LOGITS_PASS_BYTES = 128 * 1024 * 1024


@dataclass
class StageOutput:
    """What one worker's step produced: the sampled tokens (last stage), the hidden states for
    the next stage (None if the plan had no entries), seconds by phase, and the logprobs of the
    jobs that asked."""

    tokens: dict[str, int]
    hidden: torch.Tensor | None
    timings: dict[str, float]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    #: Each prompt-logprobs entry's rows (``BatchEntry.prompt_targets``), by job.
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    #: Jobs whose swap-in was still copying when the step returned (GPU only).
    swaps_in_flight: frozenset[str] = frozenset()


def plain_greedy(entry: BatchEntry) -> bool:
    """Whether an entry's token is the argmax of its raw logits (no steering, penalties, masks,
    grammar or logprobs): what the device computes without the sampler."""
    p = entry.sampling
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.allowed_token_ids is None
            and entry.context is None and entry.token_mask is None)


@dataclass
class PendingTokens:
    """Greedy tokens on their way to the host: ``[2, >= rows]`` int64 page-locked (ids, finite)
    filled by a non-blocking copy that ``event`` follows. ``resolve`` waits for it (the step's one
    host wait) and leaves out a row whose logits were not finite (its job alone fails)."""

    job_ids: Sequence[str]
    host: torch.Tensor
    event: torch.cuda.Event

    def resolve(self) -> dict[str, int]:
        self.event.synchronize()
        ids, finite = self.host[:, : len(self.job_ids)].tolist()
        return {job: int(t) for job, t, ok in zip(self.job_ids, ids, finite, strict=True) if ok}


class StageRunner:
    def __init__(self, model: Stage, kv: KVStore, sampler: Sampler | None = None,
                 graphs: GraphSettings | None = None) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler if sampler is not None else Sampler()
        self.device = kv.device
        on_cuda = self.device.type == "cuda"
        self.buffers = StepBuffers(self.device) if on_cuda else None
        settings = graphs if graphs is not None else GraphSettings()
        self.graphs: DecodeGraphs | None = None
        if on_cuda and settings.enabled:
            self.graphs = DecodeGraphs(model, kv.device_pool, kv.block_size, settings,
                                       _hidden_size(model), samples=bool(model.shard.is_last))
        self._token_host = torch.empty(0, dtype=torch.int64)

    def run(self, plan: BatchPlan, hidden: torch.Tensor | None, sample: bool) -> StageOutput:
        """The whole step of one worker: issue the plan's swaps, run this stage's layers over
        ``hidden`` (None on the first stage), sample when ``sample``, settle the swaps — even when
        the forward fails, so no copy lands in a block the control plane reuses."""
        start = time.perf_counter()
        self.make_current()
        timings: dict[str, float] = {}
        handles = self.begin_swaps(plan)
        tokens: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        prompt: dict[str, tuple[TokenLogprobs, ...]] = {}
        pending: PendingTokens | None = None
        out: torch.Tensor | None = None
        try:
            if plan.entries:
                host = self.host_batch(plan, timings)
                if self.graphs is not None and self.graphs.fits(host, hidden):
                    out, pending, tokens, logprobs = self._replay(plan, host, hidden, sample, timings)
                else:
                    batch = self.upload(host)
                    out = self.forward(batch, hidden, timings)
                    if sample:
                        pending, tokens, logprobs = self._sample(plan, batch, out, timings)
                if sample and any(e.prompt_targets for e in plan.entries):
                    prompt = self.prompt_logprobs(plan, host, out, timings)
        finally:
            self.finish_swaps(handles, timings)
        if pending is not None:
            wait = time.perf_counter()
            tokens = pending.resolve()
            timings["sample"] = timings.get("sample", 0.0) + time.perf_counter() - wait
        timings["total"] = time.perf_counter() - start
        in_flight = self.kv.swaps_in_flight() if self.kv.settles_lazily else frozenset()
        return StageOutput(tokens, out, timings, logprobs, prompt, in_flight)

    def make_current(self) -> None:
        """Make this runner's device the calling thread's current one. CUDA's current device is
        per thread, and a step may run on any (Ray runs compiled-graph steps on a thread of its
        own): what torch or a library makes there without naming a device then goes to ours."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def begin_swaps(self, plan: BatchPlan) -> list[SwapHandle]:
        return [self.kv.swap(cmd) for cmd in (*plan.swap_out, *plan.swap_in)]

    def host_batch(self, plan: BatchPlan, timings: dict[str, float] | None = None) -> HostBatch:
        start = time.perf_counter()
        host = HostBatch.of(plan.entries, self.kv.block_size)
        if timings is not None:
            timings["build"] = timings.get("build", 0.0) + time.perf_counter() - start
        return host

    def upload(self, host: HostBatch) -> ForwardBatch:
        """The batch's tensors on this worker's device: one non-blocking copy on a GPU."""
        if self.buffers is not None:
            return self.buffers.upload(host)
        return ForwardBatch.build_from(host, self.device)

    def build_batch(self, plan: BatchPlan, timings: dict[str, float] | None = None) -> ForwardBatch:
        return self.upload(self.host_batch(plan, timings))

    def _replay(self, plan: BatchPlan, host: HostBatch, hidden: torch.Tensor | None, sample: bool,
                timings: dict[str, float]
                ) -> tuple[torch.Tensor, PendingTokens | None, dict[str, int], dict[str, TokenLogprobs]]:
        """A decode step on this bucket's CUDA graph (see ``fastserve.worker.graphs``)."""
        assert self.graphs is not None
        timings["swap_wait"] = timings.get("swap_wait", 0.0) + self.kv.wait_for(host.block_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            result = self.graphs.run(host, hidden)
        # A later stage's input leaves the step: the next replay must not overwrite it.
        out = result.hidden if self.graphs.samples else result.hidden.clone()
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - start
        if not sample or result.logits is None or result.greedy_full is None:
            return out, None, {}, {}
        start = time.perf_counter()
        entries = plan.entries
        if all(plain_greedy(e) for e in entries):
            pending = self._fetch_greedy([e.job_id for e in entries], result.greedy_full)
            timings["sample"] = time.perf_counter() - start
            return out, pending, {}, {}
        tokens, logprobs = self._sampler_tokens(list(entries), result.logits)
        timings["sample"] = time.perf_counter() - start
        return out, None, tokens, logprobs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None,
                timings: dict[str, float]) -> torch.Tensor:
        timings["swap_wait"] = timings.get("swap_wait", 0.0) + self.kv.wait_for(batch.block_ids)
        start = time.perf_counter()
        out = self.model(batch, self.kv.device_pool, hidden)
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - start
        return out

    def sample(self, plan: BatchPlan, batch: ForwardBatch, hidden: torch.Tensor,
               timings: dict[str, float]) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Tokens (and logprobs) of the plan's sampling entries, read back to the host."""
        pending, tokens, logprobs = self._sample(plan, batch, hidden, timings)
        return (pending.resolve() if pending is not None else tokens), logprobs

    @torch.inference_mode()
    def _sample(self, plan: BatchPlan, batch: ForwardBatch, hidden: torch.Tensor, timings: dict[str, float]
                ) -> tuple[PendingTokens | None, dict[str, int], dict[str, TokenLogprobs]]:
        start = time.perf_counter()
        entries = [e for e in plan.entries if e.samples]
        if not entries:
            timings["sample"] = time.perf_counter() - start
            return None, {}, {}
        index = batch.logit_index if batch.logit_index is not None else batch.sample_index[
            [i for i, e in enumerate(plan.entries) if e.samples]]
        logits = self.model.logits(hidden[index])
        if not hidden.is_cuda:   # on a GPU the head is only launched here: its time shows in the sampler's wait
            timings["lm_head"] = time.perf_counter() - start
        if hidden.is_cuda and all(plain_greedy(e) for e in entries):
            pending = self._fetch_greedy([e.job_id for e in entries], greedy_rows(logits))
            timings["sample"] = time.perf_counter() - start
            return pending, {}, {}
        tokens, logprobs = self._sampler_tokens(entries, logits)
        timings["sample"] = time.perf_counter() - start
        return None, tokens, logprobs

    @torch.inference_mode()
    def prompt_logprobs(self, plan: BatchPlan, host: HostBatch, hidden: torch.Tensor,
                        timings: dict[str, float]) -> dict[str, tuple[TokenLogprobs, ...]]:
        """Each asking entry's prompt logprobs: its rows (it starts ``len(token_ids) - 1`` rows
        before its ``sample_index``) through the LM head, in passes of at most
        ``PROMPT_LOGITS_PASS_BYTES`` of logits."""
        start = time.perf_counter()
        out: dict[str, tuple[TokenLogprobs, ...]] = {}
        per_pass = max(1, PROMPT_LOGITS_PASS_BYTES // (4 * int(self.model.config.vocab_size)))
        for i, e in enumerate(plan.entries):
            if not e.prompt_targets:
                continue
            first = int(host.sample_index[i]) - len(e.token_ids) + 1
            rows: list[TokenLogprobs] = []
            for a in range(0, len(e.prompt_targets), per_pass):
                targets = e.prompt_targets[a: a + per_pass]
                logits = self.model.logits(hidden[first + a: first + a + len(targets)])
                rows.extend(prompt_token_logprobs(logits, targets, e.sampling.prompt_logprobs or 0))
            out[e.job_id] = tuple(rows)
        timings["prompt_logprobs"] = time.perf_counter() - start
        return out

    def _sampler_tokens(self, entries: list[BatchEntry], logits: torch.Tensor
                        ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        contexts = [e.context for e in entries]
        masks = [e.token_mask for e in entries]
        tokens, by_row = self.sampler.sample_with_logprobs(
            logits, [e.sampling for e in entries], [e.step_index for e in entries],
            contexts if any(c is not None for c in contexts) else None,
            masks if any(m is not None for m in masks) else None)
        # A row that could not be sampled is left out: the scheduler fails that job alone.
        return ({e.job_id: t for e, t in zip(entries, tokens, strict=True) if t is not None},
                {entries[row].job_id: lp for row, lp in by_row.items()})

    def _fetch_greedy(self, job_ids: list[str], greedy: torch.Tensor) -> PendingTokens:
        """Start the copy of ``greedy`` ([2, >= len(job_ids)] int64 on the device) into page-locked
        memory; the host reads it when it resolves the result."""
        width = greedy.shape[1]
        if self._token_host.numel() < 2 * width:
            self._token_host = torch.empty(2 * max(width, 2 * self._token_host.numel() // 2), dtype=torch.int64,
                                           pin_memory=True)
        host = self._token_host[: 2 * width].view(2, width)
        host.copy_(greedy, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return PendingTokens(job_ids, host, event)
    def finish_swaps(self, handles: list[SwapHandle], timings: dict[str, float]) -> None:
        start = time.perf_counter()
        if not self.kv.settles_lazily:
            for h in handles:
                h.wait()
            self.kv.wait_all()
        timings["swap_tail"] = timings.get("swap_tail", 0.0) + time.perf_counter() - start
        # A GPU's swap wait stalled the compute stream: readable only now; a later step counts the rest.
        stalled = self.kv.device_wait_s()
        if stalled:
            timings["swap_wait"] = timings.get("swap_wait", 0.0) + stalled


def _hidden_size(model: Stage) -> int:
    """Width of the hidden states that flow between this model's stages."""
    return int(model.config.hidden_size)
