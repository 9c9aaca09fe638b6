"""Which token ids end a job: a model folder's EOS set, read as transformers' ``generate`` reads it.

This module owns `eos_token_ids`: ``generation_config.json``'s ``eos_token_id`` (an int or a list:
Llama-3.1 stops on three ids), else ``config.json``'s, else the tokenizer's ``eos_token``. Every id
of the set stops a job with finish reason ``stop`` (unless the request sets ``ignore_eos``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "eos_token_ids", "parse_token_ids"]

GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
_KEY = "eos_token_id"


def parse_token_ids(value: Any, where: Path) -> frozenset[int]:
    """An ``eos_token_id`` field (an int, a list of ints, or null) as a set."""
    if value is None:
        return frozenset()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: {_KEY} must be a token id or a list of them, got {value!r}")
    return frozenset(values)


def _field(path: Path) -> frozenset[int]:
    if not path.is_file():
        return frozenset()
    raw = json.loads(path.read_text(encoding="utf-8"))
    return parse_token_ids(raw.get(_KEY) if isinstance(raw, dict) else None, path)


def eos_token_ids(folders: Iterable[Path], config_file: Path | None,
                  tokenizer_eos: int | None) -> frozenset[int]:
    """The EOS set: the first ``generation_config.json`` in ``folders`` that names one, else
    ``config_file``'s ``eos_token_id``, else ``tokenizer_eos``. Raises ValueError if none does."""
    for folder in folders:
        found = _field(folder / GENERATION_CONFIG_FILE)
        if found:
            return found
    found = _field(config_file) if config_file is not None else frozenset()
    if found:
        return found
    if tokenizer_eos is not None:
        return frozenset({tokenizer_eos})
    raise ValueError(f"no {_KEY} in {GENERATION_CONFIG_FILE} of {[str(f) for f in folders]}, "
                     f"in {config_file}, nor an eos_token in the tokenizer")
