"""The device check, rehearsed on the CPU with tiny shapes (``--smoke``), so the one GPU lease
measures instead of debugging: the benchmark runs every part end to end and its last line is one
JSON object with every measurement present; ``tests/gpu/run_on_device.sh --smoke`` runs the whole
script (imports, pytest, each bench process under its own timeout, the report) and leaves its
files under ``$OUT``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT_S = 300
SCRIPT_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


def test_smoke_run_ends_with_one_complete_json_object() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fastserve.bench.bench_gpu", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mode"] == "smoke" and result["env"]["device"] == "cpu"
    assert set(result["ceilings"]) == {"copy_GBps", "h2d_GBps", "d2h_GBps"}
    assert all(v > 0 for v in result["ceilings"].values())
    grid = [(r["batch"], r["context"]) for r in result["attention"]]
    assert grid == [(1, 16), (2, 16), (1, 32), (2, 32)]
    assert all(r["v1_us"] > 0 and r["v2_us"] > 0 for r in result["attention"])
    assert result["swaps"]["blocks"] == 8 and result["swaps"]["contiguous_GBps"] > 0
    assert [r["batch"] for r in result["engine"]["steps"]] == [1, 2]
    assert all(r["eager_ms"] > 0 and r["floor_ms"] > 0 for r in result["engine"]["steps"])
    assert result["prefill"]["prompts"]["reference_ms"] > 0 and result["prefill"]["chunks"]["reference_ms"] > 0
    for name in ("llama70b_tp8", "opt175b_tp8_stage0"):
        rank = result[name]
        assert rank["tp"] == 8 and [d["batch"] for d in rank["decode"]] == [1, 2], rank
        assert all(d["step_ms"] > 0 for d in rank["decode"]) and rank["prefill_tokens"] > 0
    assert result["llama70b_tp8"]["kv_heads"] == 1
    assert result["host_register"] == {"skipped": "no CUDA device"}
    assert not [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    assert len(result["goals"]) == 7


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_the_device_script_rehearses_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "tests/gpu/run_on_device.sh", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    status = result["status"]
    steps = {"env", "pytest", "bench_kernels", "bench_engine", "bench_llama70b", "bench_opt175b", "bench_host"}
    assert {k: status[k] for k in steps} == dict.fromkeys(steps, "0"), status
    assert "skipped" in status["pytest_summary"] or "passed" in status["pytest_summary"]
    files = {p.name for p in out.iterdir()}
    assert files == {"check.log", "pytest.xml", "env.txt", "bench.json"}   # the tool takes back at most 8
    assert json.loads((out / "bench.json").read_text()) == result
