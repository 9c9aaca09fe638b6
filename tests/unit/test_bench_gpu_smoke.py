"""The device check's benchmark, rehearsed on the CPU with tiny shapes (``--smoke``), so the one
GPU lease measures instead of debugging: it runs end to end, and its last line is the JSON object
the README's GPU section quotes, with every measurement present and positive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT_S = 300

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
    grid = [(r["batch"], r["context"]) for r in result["paged_attention"]]
    assert grid == [(1, 16), (2, 16), (1, 32), (2, 32)]
    assert all(r["us"] > 0 and r["GBps"] >= 0 for r in result["paged_attention"])
    assert result["swaps"]["blocks"] == 8 and result["swaps"]["contiguous_GBps"] > 0
    assert [r["batch"] for r in result["engine"]] == [1, 2]
    assert all(r["ours_ms"] > 0 and r["hf_ms"] > 0 and r["floor_ms"] > 0 for r in result["engine"])
