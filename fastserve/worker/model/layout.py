"""``WeightLayout``: how an architecture's checkpoint names map and split onto a served stage.
Names match on the part after ``layers.N.`` (the whole name outside the decoder layers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightLayout:
    #: Checkpoint prefixes stripped (first match) to get our module names.
    prefixes: tuple[str, ...]
    #: Prefixes split by output rows (dim 0) into equal tensor-parallel chunks.
    column_parallel: tuple[str, ...]
    #: Exact names split by input columns (dim 1); their biases are replicated.
    row_parallel: tuple[str, ...]
    #: K/V projection prefixes: the rows of the KV heads this rank stores.
    kv_parallel: tuple[str, ...] = ()
    #: Never loaded (a tied LM head: the embedding serves as it).
    skipped: tuple[str, ...] = ()
    #: Suffixes a dummy model sets to ones (norm scales) or zeros.
    ones: tuple[str, ...] = ()
    zeros: tuple[str, ...] = (".bias",)
