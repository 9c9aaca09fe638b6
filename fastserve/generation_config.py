"""What a model folder says about generating: the ids that end a job (``eos_token_ids``: the
generation config's, else ``config.json``'s, else the tokenizer's) and the sampling values a request
that omits them gets (``sampling_defaults``, as vLLM's ``--generation-config auto``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "SamplingDefaults", "eos_token_ids", "parse_token_ids",
           "sampling_defaults"]

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


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling values; None where it sets none (the OpenAI default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None


#: generation_config.json's keys, by the field of ``SamplingDefaults`` each sets.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_tokens": "max_new_tokens"}


def sampling_defaults(folders: Iterable[Path]) -> SamplingDefaults:
    """The first ``generation_config.json`` in ``folders``: its sampling values (every key it
    writes, as vLLM reads them); none when no folder has the file. A value of the wrong type is a
    ValueError naming the file and the key."""
    for folder in folders:
        path = folder / GENERATION_CONFIG_FILE
        if not path.is_file():
            continue
        raw = json.loads(path.read_text(encoding="utf-8"))
        values: dict[str, Any] = {}
        for field, key in _SAMPLING_KEYS.items():
            value = raw.get(key) if isinstance(raw, dict) else None
            if value is None:
                continue
            integral = field in ("top_k", "max_tokens")
            if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
                raise ValueError(f"{path}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
            values[field] = value if integral else float(value)
        return SamplingDefaults(**values)
    return SamplingDefaults()
