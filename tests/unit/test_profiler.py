"""The job profiler (fastserve.engine.profiler) on a tiny random OPT: the file it writes is the one the scheduler
reads. Checked exactly: its name, grids, layout fields and KV block size; the measured seconds only
for being one positive number per grid point (their values are the machine's, not the test's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastserve.engine.profiler import hardware_name, main, profile, profile_path
from fastserve.scheduler.profile import Profile

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, BLOCK = 2, 32, 2, 4
#: K and V of every layer for one block, fp32.
BYTES_PER_BLOCK = 2 * LAYERS * BLOCK * HIDDEN * 4


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config folder of OPT-125M's shape rules, shrunk (random weights: ``load_format`` dummy)."""
    raw = json.loads((ROOT / "config/models/opt-125m/config.json").read_text())
    raw.update(hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, ffn_dim=64, vocab_size=128, max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("models") / "tiny-opt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def result(tiny_opt: Path) -> dict[str, Any]:
    return profile(str(tiny_opt), "float32", "cpu", BLOCK, prompt_lens=[1, 8, 20], batch_sizes=[1, 3],
                   repeats=1)


def test_the_profile_names_its_model_layout_and_grids(result: dict[str, Any]) -> None:
    fixed = {k: v for k, v in result.items() if k not in ("host", "t_init", "t_dec", "swap")}
    assert fixed == {"model": "tiny-opt", "hardware": "cpu", "tp": 1, "pp": 1, "dtype": "float32",
                     "block_size": BLOCK, "decode_context": 128}
    assert result["t_init"]["prompt_lens"] == [1, 8, 20]
    assert result["t_dec"]["batch_sizes"] == [1, 3]
    assert result["swap"]["bytes_per_block"] == BYTES_PER_BLOCK


def test_every_grid_point_has_one_measured_time(result: dict[str, Any]) -> None:
    times = [*result["t_init"]["seconds"], *result["t_dec"]["seconds"], result["swap"]["seconds_per_block"]]
    assert len(times) == 3 + 2 + 1
    assert all(isinstance(t, float) and t > 0 for t in times), times


def test_the_scheduler_reads_what_it_measured(result: dict[str, Any], tmp_path: Path) -> None:
    path = profile_path(result, tmp_path)
    assert path == tmp_path / "tiny-opt-cpu-tp1-pp1.json"
    path.write_text(json.dumps(result))
    prof = Profile.load(path)
    assert (prof.tp, prof.pp, prof.block_size, prof.swap_bytes_per_block) == (1, 1, BLOCK, BYTES_PER_BLOCK)
    assert prof.t_init(8) == result["t_init"]["seconds"][1]
    assert prof.t_dec(3) == result["t_dec"]["seconds"][1]


def test_hardware_is_cpu_off_cuda() -> None:
    assert hardware_name("cpu") == "cpu"


def test_main_writes_the_file_and_prints_each_measurement(tiny_opt: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", str(tiny_opt), "--block-size", str(BLOCK), "--prompt-lens", "16", "2",
          "--batch-sizes", "2", "--repeats", "1", "--out-dir", str(tmp_path / "profiles")])
    path = tmp_path / "profiles/tiny-opt-cpu-tp1-pp1.json"
    written = json.loads(path.read_text())
    assert written["t_init"]["prompt_lens"] == [2, 16]   # sorted
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("=")[0] for line in lines[:3]] == ["t_init(    2) ", "t_init(   16) ", "t_dec(b"]
    assert lines[3].startswith("swap: ") and lines[3].endswith(f"us per block of {BYTES_PER_BLOCK} B")
    assert lines[4:] == [f"wrote {path}"]


def test_progress_gets_one_line_per_phase_and_grid_point(tiny_opt: Path) -> None:
    lines: list[str] = []
    profile(str(tiny_opt), "float32", "cpu", BLOCK, prompt_lens=[1, 8], batch_sizes=[2], repeats=1,
            progress=lines.append)
    assert lines[0] == "loading tiny-opt (float32, cpu) to profile 2 prompt lengths and 1 batch sizes"
    assert [line.split(" = ")[0] for line in lines[1:]] == ["t_init(    1)", "t_init(    8)", "t_dec(b=  2)"]
    assert all(line.endswith(" ms") for line in lines[1:])
