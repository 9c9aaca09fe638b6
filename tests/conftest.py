"""Fixtures every test directory may use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The demo's real model folder (SmolLM2-135M-Instruct, fp32), converted first if missing:
    CI runs ``make model`` before the tests, so this never skips."""
    from app.model_folder import ensure

    return ensure()
