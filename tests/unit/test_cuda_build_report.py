"""The CUDA kernels' build report for the GPUs we deploy on (A100: sm_80, H100/H200: sm_90):
every ``fastserve/kernels/cuda/*.cu`` compiles with ``nvcc -Xptxas -v`` and no kernel spills registers to
local memory (a spill turns a register access into a memory round trip in the inner loop).
CuPy compiles the same sources with NVRTC at run time (no extra options), so this is the code a
GPU runs. Skipped only where nvcc is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fastserve import kernels

CUDA_DIR = Path(kernels.__file__).resolve().parent / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")
NVCC_TIMEOUT_S = 180
ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
#: The hardware's limit per thread (sm_80 and sm_90): the report must show a count within it.
MAX_REGISTERS_PER_THREAD = 255

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


SUFFIXES = tuple(kernels.CUDA_KERNEL_SUFFIX.values())
#: The entry points of each source: one per dtype the dispatcher launches for each base name, or
#: (gather_kv.cu, a bit-exact copy) one per word width.
KERNELS = {"paged_attention.cu": {f"paged_attention_{s}" for s in SUFFIXES},
           "write_kv.cu": {f"write_kv_{s}" for s in SUFFIXES},
           "paged_attention_v2.cu": {f"{b}_{s}" for b in ("paged_attention_v2", "paged_attention_reduce")
                                     for s in SUFFIXES},
           "gather_kv.cu": {"gather_kv_w16", "gather_kv_w4", "gather_kv_w2"}}
#: paged_attention_v2.cu is compiled per (head dim, query-head tile): beside its defaults, the
#: widest tiles (registers) and a single-head tile (OPT).
V2_VARIANTS = [("-DPA_HEAD_DIM=128", "-DPA_GROUP=8"), ("-DPA_HEAD_DIM=256", "-DPA_GROUP=8"),
               ("-DPA_HEAD_DIM=128", "-DPA_GROUP=1")]


def build_report(source: Path, arch: str, out: Path,
                 options: tuple[str, ...] = ()) -> dict[str, tuple[int, int, int, int]]:
    """Per kernel: (registers, stack frame, spill stores, spill loads) bytes, from ptxas -v."""
    done = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", *options, "-o", str(out),
                           str(source)],
                          capture_output=True, text=True, timeout=NVCC_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    report: dict[str, tuple[int, int, int, int]] = {}
    current = None
    for line in done.stderr.splitlines():
        if entry := ENTRY.search(line):
            current = entry.group(1)
            assert entry.group(2) == arch
        elif (spill := SPILLS.search(line)) and current:
            frame, stores, loads = map(int, spill.groups())
            report[current] = (-1, frame, stores, loads)
        elif (regs := REGISTERS.search(line)) and current:
            report[current] = (int(regs.group(1)), *report[current][1:])
    return report


def test_every_kernel_source_is_checked() -> None:
    assert {p.name for p in SOURCES} == set(KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernels_build_without_spills(source: Path, arch: str, tmp_path: Path) -> None:
    report = build_report(source, arch, tmp_path / f"{source.stem}.cubin")
    check_report(report, source.name, arch)


@pytest.mark.parametrize("options", V2_VARIANTS, ids=lambda o: "-".join(o))
def test_paged_attention_v2_variants_build_without_spills(options: tuple[str, ...], tmp_path: Path) -> None:
    source = CUDA_DIR / "paged_attention_v2.cu"
    check_report(build_report(source, "sm_90", tmp_path / "v2.cubin", options), source.name, "sm_90")


def check_report(report: dict[str, tuple[int, int, int, int]], source: str, arch: str) -> None:
    assert set(report) == KERNELS[source]
    for name, (registers, frame, stores, loads) in report.items():
        print(f"{arch} {name}: {registers} registers, {frame} B stack, {stores}/{loads} B spill stores/loads")
        assert (stores, loads) == (0, 0), f"{name} spills on {arch}"
        assert 0 < registers <= MAX_REGISTERS_PER_THREAD, name
