"""``WeightLayout``: how an architecture's checkpoint names map and split onto a served stage.

Each model module declares one (``OPT_WEIGHTS``, ``LLAMA_WEIGHTS``); ``fastserve.worker.model.weights`` is
the single loader that reads it. Names are matched on the part after ``layers.N.`` (or the whole
name outside the decoder layers). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightLayout:
    #: Checkpoint prefixes stripped (first match) to get our module names.
    prefixes: tuple[str, ...]
    #: Name prefixes split by output rows (dim 0) into equal tensor-parallel chunks.
    column_parallel: tuple[str, ...]
    #: Exact names split by input columns (dim 1); their biases are replicated.
    row_parallel: tuple[str, ...]
    #: Name prefixes of K/V projections: rows of the KV heads the rank stores (split or replicated).
    kv_parallel: tuple[str, ...] = ()
    #: Checkpoint names that are never loaded (a tied LM head: the embedding serves as it).
    skipped: tuple[str, ...] = ()
    #: Name suffixes a dummy model initialises to ones (norm scales) rather than noise.
    ones: tuple[str, ...] = ()
    #: Name suffixes a dummy model initialises to zeros.
    zeros: tuple[str, ...] = (".bias",)
