"""``python -m fastserve.plan``: the footprint it is built on matches the real stage modules, every
shipped GPU config fits the GPU it names, and one figure checked by hand from the model's dims."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastserve.gpu_kinds import load_gpu_table
from fastserve.plan import main, plan_config
from fastserve.worker.executor import build_model
from fastserve.worker.model.config import load_model_config
from fastserve.worker.model.footprint import stage_weight_shapes
from fastserve.worker.model.shard import StageShard
from fastserve.worker.parallel import layer_ranges

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = ["opt13b", "opt66b", "opt175b", "llama3-8b", "llama3-70b"]
#: (model, TP, PP): every shipped layout, plus small ones with uneven stages and GQA replication.
LAYOUTS = [("opt-175b", 8, 2), ("opt-66b", 4, 1), ("opt-13b", 1, 1), ("opt-350m", 2, 3),
           ("llama-3.1-70b", 8, 1), ("llama-3.1-8b", 1, 1), ("llama-3.2-1b", 4, 3), ("llama-demo-150m", 2, 2)]


@pytest.mark.parametrize("model,tp,pp", LAYOUTS, ids=lambda v: str(v))
def test_footprint_shapes_are_the_stage_modules(model: str, tp: int, pp: int) -> None:
    config = load_model_config(ROOT / "config/models" / model)
    for start, end in layer_ranges(config.num_hidden_layers, pp):
        shard = StageShard(start, end, config.num_hidden_layers, tp - 1, tp)
        with torch.device("meta"):
            stage = build_model(config, shard, None)
        built = {name: tuple(p.shape) for name, p in stage.named_parameters()}
        assert stage_weight_shapes(config, shard) == built


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_every_shipped_gpu_config_fits_the_gpu_it_names(name: str, capsys: pytest.CaptureFixture) -> None:
    assert main([str(ROOT / "config" / f"{name}.yaml")]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "DOES NOT FIT" not in out and " NO" not in out
    (plan,) = plan_config(ROOT / "config" / f"{name}.yaml")
    assert plan.fits and plan.gpu_kind == "A100-80GB"


def test_opt175b_stage0_rank_weights_by_hand() -> None:
    (plan,) = plan_config(ROOT / "config/opt175b.yaml")
    h, ffn, vocab, positions, layers, tp, fp16 = 12288, 49152, 50272, 2048 + 2, 96 // 2, 8, 2
    attention = 3 * (h // tp * h + h // tp) + (h * h // tp + h)          # q, k, v split; out_proj's bias whole
    mlp = (ffn // tp * h + ffn // tp) + (h * ffn // tp + h)
    norms = 2 * 2 * h                                                    # two LayerNorms, weight + bias
    embeddings = vocab * h + positions * h                               # replicated on every rank
    expected = (layers * (attention + mlp + norms) + embeddings) * fp16
    assert expected == 23_037_247_488   # 11,518,623,744 parameters: 21.46 GiB
    stage0 = [r for r in plan.ranks if r.stage == 0]
    assert len(stage0) == tp and {r.weight_bytes for r in stage0} == {expected}
    # KV: 9,000 blocks x 16 tokens x K,V x 48 layers x 12 heads of 128 (96 / 8) x fp16.
    assert {r.kv_bytes for r in stage0} == {9000 * 16 * 2 * layers * (96 // tp) * 128 * fp16}


def test_a_layout_too_big_for_the_gpu_says_so(capsys: pytest.CaptureFixture) -> None:
    assert main([str(ROOT / "config/opt175b.yaml"), "--gpu-kind", "A100-40GB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_unknown_gpu_kind_is_refused_naming_the_table() -> None:
    with pytest.raises(ValueError, match=r"unknown gpu_kind 'B300'.*A100-80GB"):
        load_gpu_table().kind("B300")


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_load_offline_from_mounted_folders(name: str) -> None:
    """No hub ids (the image is offline), a tokenizer of the model's own, and every command the
    comments tell a user to run exists."""
    import importlib.util
    import re

    import yaml

    text = (ROOT / "config" / f"{name}.yaml").read_text()
    (app,) = yaml.safe_load(text)["applications"]
    model = app["args"]["model"]
    assert model["model_path"] == f"/models/{model['name']}"
    family = "opt" if name.startswith("opt") else "llama"
    assert model["tokenizer_path"] == ("config/tokenizers/opt" if family == "opt" else model["model_path"])
    commands = re.findall(r"python -m ([\w.]+)", text)
    assert commands and all(importlib.util.find_spec(m) is not None for m in commands), commands


def test_the_planner_runs_without_torch_ray_or_cupy() -> None:
    """A dry run on a laptop or a CI box: nothing of the data plane's device stack is imported."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'ray', 'cupy'):\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from fastserve.plan import main\n"
        f"sys.exit(main([{str(ROOT / 'config/opt175b.yaml')!r}, '--json']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"fits": true' in done.stdout


def test_the_fastserve_command_has_a_plan_subcommand(capsys: pytest.CaptureFixture) -> None:
    from fastserve.cli import main as cli

    with pytest.raises(SystemExit) as done:
        cli(["plan", str(ROOT / "config/llama3-70b.yaml")])
    assert done.value.code == 0
    assert "on A100-80GB: 8 GPUs, fits" in capsys.readouterr().out
