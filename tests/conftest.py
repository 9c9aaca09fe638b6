"""Fixtures every test directory may use, and how the test process ends."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fastserve.worker.model.llama_config import LlamaConfig

_exit_status = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_exit_status] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's own status once every report is written, without the
    interpreter's finalization. A full run (1,118 passed, 2026-12-03) printed its summary and
    then died with SIGSEGV while Python tore down: by then the process holds threads it did not
    start in Python (Ray's core worker from the integration modules' drivers, libgomp's teams
    from torch and our C kernels) and freeing modules under them is not safe; the same run again
    under ``-X faulthandler`` exited cleanly. The verdict is the tests': the status is kept."""
    status = config.stash.get(_exit_status, None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The demo's real model folder (SmolLM2-135M-Instruct, fp32), converted first if missing:
    CI runs ``make model`` before the tests, so this never skips."""
    from fastserve.model_folder import ensure

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
