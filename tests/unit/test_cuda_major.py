"""One CUDA major across the GPU stack: torch's PyPI wheel, the ``gpu`` extra's CuPy and the
image's base name the same one (two CUDA runtimes in one process load two NCCLs and need the
newer one's driver anyway)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The CUDA major of torch's default (PyPI) Linux wheel, by version: what its metadata requires
#: (torch 2.13.0: cuda-toolkit==13.0.3, nvidia-nccl-cu13); checked against PyPI below.
TORCH_PYPI_CUDA_MAJOR = {"2.13.0": 13}
PUBLIC_INDEX = "https://pypi.org/simple"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _torch_pin() -> str:
    (pin,) = [d for d in _project()["dependencies"] if d.startswith("torch")]
    match = re.fullmatch(r"torch==([\d.]+)", pin)
    assert match, f"torch must be pinned exactly to know its CUDA major, got {pin!r}"
    return match.group(1)


def _cupy_major() -> int:
    (cupy,) = [d for d in _project()["optional-dependencies"]["gpu"] if d.startswith("cupy")]
    match = re.match(r"cupy-cuda(\d+)x", cupy)
    assert match, cupy
    return int(match.group(1))


def _image_major() -> int:
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", (ROOT / "Dockerfile").read_text(), flags=re.M))
    match = re.search(r"-cu(\d+)(\d)$", args["RAY_IMAGE"])   # Ray's tag: CUDA 13.0 -> cu130
    assert match, args["RAY_IMAGE"]
    return int(match.group(1))


def test_torch_cupy_and_the_image_share_one_cuda_major() -> None:
    torch_major = TORCH_PYPI_CUDA_MAJOR[_torch_pin()]
    assert (_cupy_major(), _image_major()) == (torch_major, torch_major)


def test_the_manifests_run_the_gpu_image_of_that_major() -> None:
    text = (ROOT / "config/kuberay/rayservice-opt175b.yaml").read_text()
    tags = set(re.findall(r"image: fastserve-ray:[\d.]+-(cu\d+|cpu)", text))
    assert tags <= {f"cu{_image_major()}0", "cpu"} and f"cu{_image_major()}0" in tags


@pytest.mark.slow
def test_torch_wheel_on_pypi_is_built_for_that_major(tmp_path: Path) -> None:
    """The table above against PyPI: the pinned torch's Linux wheel requires NVIDIA's -cuNN wheels."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
           "--index-url", PUBLIC_INDEX, "--report", str(report), "--platform", "manylinux_2_28_x86_64",
           "--only-binary", ":all:", f"torch=={_torch_pin()}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (item,) = json.loads(report.read_text())["install"]
    majors = {int(m) for r in item["metadata"]["requires_dist"] for m in re.findall(r"^nvidia-[\w-]+-cu(\d+)", r)}
    assert majors == {TORCH_PYPI_CUDA_MAJOR[_torch_pin()]}
