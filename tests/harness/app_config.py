"""Shared set-up for the config tests: the experiments' dummy-OPT app args, and the message a bad
set of args fails validation with."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fastserve.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]


def demo_args() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "config" / "opt125m-dummy.yaml").read_text())
    return copy.deepcopy(raw["applications"][0]["args"])


def error_of(args: dict[str, Any], **context: Any) -> str:
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate(args, context=context or None)
    return str(info.value)
