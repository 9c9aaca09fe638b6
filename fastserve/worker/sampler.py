"""Token sampling for one batch, in vLLM's order: grammar mask, raw logprobs, allowed ids and bias,
penalties and the ``min_tokens`` mask, then greedy argmax or temperature, min-p, top-k, top-p and a draw.

A feature no row uses costs nothing; a seeded row draws from ``(seed, step_index)``, so its tokens do not
depend on the batch. A row whose sampling fails gets ``None`` and fails only its job. Stopping is the
control plane's (``SamplingParams.finish_reason``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from fastserve.kernels import cpu_draw, cpu_greedy, cpu_token_mask
from fastserve.worker.messages import SamplingContext, SamplingParams, TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads (seed, step) over 63 bits
_SEED_BITS = (1 << 63) - 1

#: Most likely tokens top-p sorts first, and the factor it widens them by until they hold the
#: nucleus (speed only: the kept tokens are the same for any window).
NUCLEUS_WINDOW = 256
NUCLEUS_GROWTH = 8

log = logging.getLogger(__name__)


def step_seed(seed: int, step_index: int) -> int:
    return (seed * _SEED_MIX + step_index) & _SEED_BITS


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               step_indices: Sequence[int],
               contexts: Sequence[SamplingContext | None] | None = None,
               token_masks: Sequence[bytes | None] | None = None) -> list[int | None]:
        """One token per row of ``logits`` ([batch, vocab], float32); ``None`` for a row that
        could not be sampled (its job alone fails)."""
        return self.sample_with_logprobs(logits, params, step_indices, contexts, token_masks)[0]

    def sample_with_logprobs(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], step_indices: Sequence[int],
        contexts: Sequence[SamplingContext | None] | None = None,
        token_masks: Sequence[bytes | None] | None = None,
    ) -> tuple[list[int | None], dict[int, TokenLogprobs]]:
        """``sample``, plus the logprobs of the rows whose params ask for them, by row index.
        ``token_masks`` (None: no row has one) holds each row's packed grammar mask or None."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        if contexts is not None and len(contexts) != len(params):
            raise ValueError(f"{len(contexts)} sampling contexts for {len(params)} requests")
        if token_masks is not None and len(token_masks) != len(params):
            raise ValueError(f"{len(token_masks)} token masks for {len(params)} requests")
        raw = logits
        greedy: list[int] | None = None
        if cpu_greedy.fits(logits):   # argmax and the finiteness check in one C pass a row
            greedy, finite = cpu_greedy.greedy_rows(logits)
        else:
            # Non-finite float64 sum exactly when a float32 row holds a NaN or an infinity.
            finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float64)).tolist()
        if token_masks is not None:
            moved = apply_token_masks(logits, token_masks, finite)
            if greedy is not None:   # the masked rows' maxima moved
                for row, token in moved.items():
                    greedy[row] = token
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None and finite[i]]
        raw_logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None
        logits = steer_logits(logits, params, finite)
        if contexts is not None:
            logits = self._adjusted(logits, params, contexts, finite)
        if any(p.greedy for p in params) and (greedy is None or logits is not raw):
            greedy = (cpu_greedy.greedy_rows(logits)[0] if cpu_greedy.fits(logits)
                      else logits.argmax(dim=-1).tolist())
        rows = [i for i, p in enumerate(params) if finite[i] and not p.greedy]
        drawn: dict[int, int | None] = {}
        if rows:
            try:
                drawn = self._sample_rows(logits, rows, params, step_indices)
            except (RuntimeError, ValueError) as exc:   # torch reports bad distributions this way
                log.warning("batched sampling failed (%s); sampling its rows one by one", exc)
                drawn = {i: self._sample_row_or_none(logits[i], params[i], step_indices[i]) for i in rows}
        out: list[int | None] = []
        for row, p in enumerate(params):
            if not finite[row]:
                out.append(None)
            elif p.greedy:
                assert greedy is not None
                out.append(int(greedy[row]))
            else:
                out.append(drawn[row])
        if raw_logprobs is None:
            return out, {}
        return out, gather_logprobs(raw_logprobs, lp_rows, [params[i] for i in lp_rows],
                                    [out[i] for i in lp_rows])

    def _adjusted(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                  contexts: Sequence[SamplingContext | None], finite: list[bool]) -> torch.Tensor:
        """``logits`` with the contexts' penalties and masks (a copy, where any row has one); a row
        naming a token outside the vocabulary is marked not ``finite``."""
        vocab = logits.shape[-1]
        rows = []
        for i, c in enumerate(contexts):
            if c is None or not finite[i]:
                continue
            ids = c.output_ids + c.prompt_ids + c.suppress_ids
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                log.warning("sampling context names a token outside the vocabulary of %d", vocab)
                finite[i] = False
                continue
            rows.append(i)
        if not rows:
            return logits
        logits = logits.clone()
        pen = [i for i in rows if params[i].uses_penalties]
        if pen:
            logits[pen] = apply_penalties(logits[pen], [params[i] for i in pen],
                                          [contexts[i] for i in pen])  # type: ignore[misc]
        for i in rows:
            suppress = contexts[i].suppress_ids   # type: ignore[union-attr]
            if suppress:
                logits[i, list(suppress)] = float("-inf")
        return logits

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                     step_indices: Sequence[int]) -> dict[int, int | None]:
        """The sampled rows, at once where the logits are (one host read); ``None`` for a row without
        finite positive mass. The variates come as ``sample_row`` draws them, so both agree."""
        picked = [params[i] for i in rows]
        probs = batched_filtered_probs((logits if len(rows) == logits.shape[0] else logits[rows]).float(), picked)
        uniforms = torch.cat([torch.rand(1, generator=self._generator(params[i], step_indices[i]),
                                         dtype=torch.float64) for i in rows])
        tokens, ok = draw_rows(probs, uniforms.to(probs.device))
        out: dict[int, int | None] = {}
        for i, token, good in zip(rows, tokens.tolist(), ok.tolist(), strict=True):
            if not good:
                log.warning("sampling failed for one request (%s): no finite positive probability", params[i])
            out[i] = int(token) if good else None
        return out

    def _sample_row_or_none(self, row: torch.Tensor, p: SamplingParams, step: int) -> int | None:
        try:
            return self.sample_row(row, p, step)
        except (RuntimeError, ValueError) as exc:
            log.warning("sampling failed for one request (%s): %s", p, exc)
            return None

    def _generator(self, p: SamplingParams, step: int) -> torch.Generator:
        return self._shared if p.seed is None else torch.Generator().manual_seed(step_seed(p.seed, step))

    def sample_row(self, row: torch.Tensor, p: SamplingParams, step: int) -> int:
        """One row on its own, on the CPU: the per-row definition the batched path is held to
        (tests). Raises ``ValueError`` where the batched path gives ``None``."""
        probs = filtered_probs(row.float().cpu(), p)
        return draw(probs, self._generator(p, step))


def steer_logits(logits: torch.Tensor, params: Sequence[SamplingParams], finite: list[bool]) -> torch.Tensor:
    """``logits`` with each row's ``allowed_token_ids`` and ``logit_bias`` (a copy, where any row has
    either); a row naming a token outside the vocabulary is marked not ``finite``."""
    rows = [i for i, p in enumerate(params) if (p.logit_bias or p.allowed_token_ids is not None) and finite[i]]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        ids = [t for t, _ in p.logit_bias] + list(p.allowed_token_ids or ())
        if max(ids) >= vocab:
            log.warning("allowed_token_ids or logit_bias names a token outside the vocabulary of %d", vocab)
            finite[i] = False
            continue
        if p.allowed_token_ids is not None:
            kept = list(p.allowed_token_ids)
            row = torch.full_like(out[i], float("-inf"))
            row[kept] = out[i, kept]
            out[i] = row
        if p.logit_bias:
            out[i, [t for t, _ in p.logit_bias]] += torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype,
                                                                   device=out.device)
    return out


def apply_token_masks(logits: torch.Tensor, masks: Sequence[bytes | None], finite: list[bool]) -> dict[int, int]:
    """Set each masked row's disallowed tokens to -inf, in place; each masked row's greedy token after it.

    A token past the mask's bits is disallowed; a row whose mask allows nothing is marked not ``finite``."""
    picked = [(i, m) for i, m in enumerate(masks) if m is not None and finite[i]]
    if not picked:
        return {}
    rows = [i for i, _ in picked]
    packed = np.frombuffer(b"".join(m for _, m in picked), dtype=np.uint8).reshape(len(rows), -1)
    if cpu_token_mask.fits(logits) and packed.shape[1] % 4 == 0:
        allows, tokens = cpu_token_mask.mask_rows(logits, rows, packed)
    else:
        allows = _masked_fill_rows(logits, rows, packed)
        tokens = logits[rows].argmax(dim=-1).tolist()
    for i, some in zip(rows, allows, strict=True):
        if not some:
            log.warning("a grammar mask allows no token: its request fails")
            finite[i] = False
    return dict(zip(rows, tokens, strict=True))


def _masked_fill_rows(logits: torch.Tensor, rows: list[int], packed: np.ndarray) -> list[bool]:
    """``apply_token_masks``'s torch path (any device and dtype)."""
    vocab = logits.shape[-1]
    banned = np.ones((len(rows), vocab), dtype=np.uint8)
    width = min(vocab, 8 * packed.shape[1])
    banned[:, :width] = np.unpackbits(np.invert(packed), axis=1, count=width, bitorder="little")
    ban = torch.from_numpy(banned).view(torch.bool).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(ban, float("-inf"))
    else:
        for k, i in enumerate(rows):
            logits[i].masked_fill_(ban[k], float("-inf"))
    return [bool(packed[k].any()) for k in range(len(rows))]


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index of ``probs`` (1-D, non-negative, any positive sum), drawn by inverting its CDF with one
    uniform variate (``torch.multinomial`` draws one per vocabulary entry); never one of zero probability."""
    cdf = probs.double().cumsum(0)
    total = cdf[-1]
    if not bool(total > 0) or not bool(torch.isfinite(total)):
        raise ValueError(f"probabilities sum to {float(total)}")
    point = torch.rand(1, generator=generator, dtype=torch.float64) * total
    index = int(torch.searchsorted(cdf, point, right=True))
    # Rounding can put the point at the total itself: the last index with mass is the limit.
    return min(index, int(torch.count_nonzero(cdf < total)))


def draw_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw`` for every row of ``probs`` ([rows, vocab]) at once, with row r's uniform variate
    ``uniforms[r]`` (float64): the drawn indices, and whether each row had finite positive mass
    (a row without gets an arbitrary index).

    The CDF is each row's float64 running sum in token order, as ``draw``'s. On CPU float32 rows one
    C pass keeps only every block's sum (``fastserve.kernels.cpu_draw``); elsewhere torch writes the
    whole CDF and searches it."""
    if cpu_draw.fits(probs):
        return cpu_draw.draw_rows(probs, uniforms)
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    ok = (total[:, 0] > 0) & torch.isfinite(total[:, 0])
    index = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)[:, 0]
    # The rounding limit: the first index whose CDF reaches the total (the count of entries below it).
    return torch.minimum(index, torch.searchsorted(cdf, total)[:, 0]), ok


def batched_filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``filtered_probs`` of every row of ``logits`` ([rows, vocab]) with its own params, in one
    pass per filter (a filter no row uses is skipped). Top-k and top-p read only the most likely
    tokens they need (``torch.topk``, ``nucleus``), never a sort of the whole vocabulary."""
    rows, vocab = logits.shape
    column = {"dtype": logits.dtype, "device": logits.device}
    scaled = logits / torch.tensor([p.temperature for p in params], **column)[:, None]  # type: ignore[arg-type]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], **column)[:, None]  # type: ignore[arg-type]
        first = torch.softmax(scaled, dim=-1)
        cut = (first < min_p * first.max(dim=-1, keepdim=True).values) & (min_p > 0)
        scaled = scaled.masked_fill(cut, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, dtype=torch.long, device=logits.device)[:, None]
        # The k-th largest value, as the k-th of a full descending sort (ties counted).
        kth = scaled.topk(max(top_k), dim=-1).values.gather(-1, (k - 1).clamp(min=0))
        below = scaled < kth
        # ``scaled`` is this function's own tensor (the division made it): masked in place.
        scaled.masked_fill_(below if all(top_k) else below & (k > 0), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], **column)[:, None]  # type: ignore[arg-type]
        # In place: a row whose top_p is 1 keeps every token, so it is left as it was.
        probs.masked_fill_(~nucleus(probs, top_p), 0.0)
        kept = probs / probs.sum(dim=-1, keepdim=True)
        filtered = top_p < 1.0   # in float32, as the nucleus reads it (0.999999999 is 1 there)
        probs = kept if bool(filtered.all()) else torch.where(filtered, kept, probs)
    return probs


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [rows, vocab]: the tokens top-p keeps (all of a row whose ``top_p[row]`` is 1), exactly
    those a stable descending sort of the whole row keeps: each token whose mass strictly above
    it (the running sum less itself, in ``probs``' dtype) stays below ``top_p``, and the first.

    Only a window of the most likely tokens is sorted (``torch.topk``), tied probabilities put in
    id order as the stable sort has them, and the window is widened until it settles the row: its
    last token is dropped (every later token then is, its running sum being no smaller and its
    probability no larger) and none of that token's ties is kept (one outside the window might
    have a lower id), or its last probability is 0 (later tokens carry no mass, kept or not), or
    it spans the vocabulary."""
    rows, vocab = probs.shape
    keep = torch.ones_like(probs, dtype=torch.bool)
    todo: list[int] = (top_p[:, 0] < 1.0).nonzero()[:, 0].tolist()
    window = min(vocab, NUCLEUS_WINDOW)
    while todo:
        index = torch.tensor(todo, dtype=torch.long, device=probs.device)
        values, order = _sorted_window(probs if len(todo) == rows else probs[index], window)
        drop = (values.cumsum(-1) - values) >= top_p[index]
        drop[:, 0] = False   # the most likely token survives any top_p, even one that underflows
        last_kept = ((values == values[:, -1:]) & ~drop).any(dim=-1)
        settled = (drop[:, -1] & ~last_kept) | (values[:, -1] == 0) | (window == vocab)
        done = settled.nonzero()[:, 0]
        if done.numel():
            kept = torch.zeros(done.numel(), vocab, dtype=torch.bool, device=probs.device)
            keep[index[done]] = kept.scatter_(-1, order[done], ~drop[done])
        todo = [r for r, ok in zip(todo, settled.tolist(), strict=True) if not ok]
        window = min(vocab, window * NUCLEUS_GROWTH)
    return keep


def _sorted_window(probs: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``window`` largest values, descending, and their ids, equal values in id order
    (``torch.topk`` does not promise an order among ties): one integer sort by (run of equal
    values, id)."""
    values, order = probs.topk(window, dim=-1)
    if window > 1:
        run = torch.zeros_like(order)
        run[:, 1:] = torch.cumsum(values[:, 1:] != values[:, :-1], dim=-1)
        order = (run * probs.shape[-1] + order).sort(dim=-1).values % probs.shape[-1]
    return values, order


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    contexts: Sequence[SamplingContext]) -> torch.Tensor:
    """Rows of ``logits`` ([rows, vocab]) with vLLM's penalties: repetition (prompt and output), then
    ``- frequency * count - presence * [count > 0]`` (output); only the pairs a history names are touched."""
    rows, vocab = logits.shape
    out = logits.float().clone()
    flat = out.view(-1)
    out_keys = _keys([c.output_ids for c in contexts], vocab)
    all_keys = torch.cat([out_keys, _keys([c.prompt_ids for c in contexts], vocab)])
    if not all_keys.numel():
        return out
    keys = torch.unique(all_keys)                      # sorted (row, token) pairs
    counts = torch.zeros(keys.numel(), dtype=out.dtype)
    if out_keys.numel():
        named, times = torch.unique(out_keys, return_counts=True)
        counts[torch.searchsorted(keys, named)] = times.to(out.dtype)
    row_of = keys // vocab
    values = flat[keys]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=out.dtype)[row_of]
    values = torch.where(values > 0, values / repetition, values * repetition)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=out.dtype)[row_of]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=out.dtype)[row_of]
    flat[keys] = values - frequency * counts - presence * (counts > 0).to(out.dtype)
    return out


def _keys(histories: Sequence[tuple[int, ...]], vocab: int) -> torch.Tensor:
    """``row * vocab + token`` for every token of every row's history (flat-index keys)."""
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    if not int(lengths.sum()):
        return torch.zeros(0, dtype=torch.long)
    tokens = torch.tensor([t for h in histories for t in h], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(histories)) * vocab, lengths) + tokens


def gather_logprobs(raw: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                    tokens: Sequence[int | None]) -> dict[int, TokenLogprobs]:
    """Each asking row's sampled-token logprob and its ``params.logprobs`` most likely tokens
    (``raw``: the ``log_softmax`` of those rows' raw logits, in ``rows`` order)."""
    most = max(p.logprobs or 0 for p in params)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if most:
        values, indices = raw.topk(min(most, raw.shape[-1]), dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    out: dict[int, TokenLogprobs] = {}
    for k, (row, p, token) in enumerate(zip(rows, params, tokens, strict=True)):
        if token is None:
            continue
        n = p.logprobs or 0
        top = tuple(zip(top_ids[k][:n], top_vals[k][:n], strict=True)) if n else ()
        out[row] = TokenLogprobs(float(raw[k, token]), top)
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p (renormalised)."""
    scaled = logits / p.temperature
    if p.min_p > 0.0:
        first = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(first < p.min_p * first.max(), float("-inf"))
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True, stable=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
        drop = before >= p.top_p
        drop[0] = False   # the most likely token survives any top_p, even one that underflows
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int) -> tuple[TokenLogprobs, ...]:
    """Prompt logprobs of ``logits``' rows ([rows, vocab], row r scoring ``targets[r]``): each
    target's log-probability under the raw distribution, its rank (1 + the tokens strictly more
    likely, as vLLM ranks), and the ``top`` most likely ``(token id, logprob)`` pairs."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), dtype=torch.long, device=raw.device)[:, None]
    chosen = raw.gather(-1, index)
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    top_ids: list[list[int]] = [[] for _ in targets]
    top_vals: list[list[float]] = [[] for _ in targets]
    if top:
        values, indices = raw.topk(min(top, raw.shape[-1]), dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    return tuple(TokenLogprobs(value, tuple(zip(ids, vals, strict=True)), rank)
                 for value, ids, vals, rank in zip(chosen[:, 0].tolist(), top_ids, top_vals, ranks, strict=True))
