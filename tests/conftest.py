"""Fixtures every test directory may use."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from actors.model.llama_config import LlamaConfig


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The demo's real model folder (SmolLM2-135M-Instruct, fp32), converted first if missing:
    CI runs ``make model`` before the tests, so this never skips."""
    from app.model_folder import ensure

    return ensure()


@pytest.fixture(scope="session")
def smollm2_llama(smollm2_folder: Path) -> LlamaConfig:
    """The demo model's ``LlamaConfig``, read from its folder."""
    from tests.harness.smollm2 import smollm2_config

    return smollm2_config(smollm2_folder)


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_folder: Path) -> list[list[int]]:
    """The eight parity prompts' ids (``tests.harness.smollm2.prompt_ids``), jobs "0".."7"."""
    from tests.harness.smollm2 import prompt_ids

    return prompt_ids(smollm2_folder)
