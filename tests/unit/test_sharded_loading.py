"""Sharded weight loading: at TP 2 x PP 2 each rank reads only its own tensors, and of the split
ones only its slice, from a tiny LLaMA (grouped-query attention, untied head) saved as several
safetensors files with an index; what it loads equals the matching slice of the full weights
exactly. Dummy weights are drawn per shard and equal slices of the unsplit dummy model."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
import transformers

from fastserve.worker.model.llama import LlamaStage
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.model.shard import StageShard
from fastserve.worker.model.weights import SAFETENSORS_INDEX, dummy_weights, load_stage_weights

CONFIG = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny-llama-shards")
TP, PP = 2, 2
LAYERS_PER_STAGE = CONFIG.num_hidden_layers // PP
#: Small enough that the checkpoint is written as several files plus an index.
SHARD_SIZE = "60KB"
#: The brief's bound on what a rank may read beyond its share.
READ_SLACK = 1.1
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # split by rows (2 KV heads: split too)
ROW = ("o_proj.weight", "down_proj.weight")                         # split by columns


def _shards() -> list[StageShard]:
    return [StageShard(s * LAYERS_PER_STAGE, (s + 1) * LAYERS_PER_STAGE, CONFIG.num_hidden_layers, r, TP)
            for s in range(PP) for r in range(TP)]


def _expected_slice(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's part of a full tensor, by the rule written out independently of the loader."""
    if any(f".{c}." in name for c in COLUMN):
        return full.chunk(TP, dim=0)[rank]
    if name.endswith(ROW):
        return full.chunk(TP, dim=1)[rank]
    return full


def _global(shard: StageShard, local: str) -> str:
    if local.startswith("layers."):
        i, rest = local.split(".", 2)[1:]
        return f"model.layers.{int(i) + shard.layer_start}.{rest}"
    return local if local == "lm_head.weight" else f"model.{local}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG.to_hf_dict())).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path, max_shard_size=SHARD_SIZE)
    return path, {k: v.detach().clone() for k, v in hf.state_dict().items()}


class _CountingHandle:
    """A safetensors handle that records every tensor (and byte) read through it."""

    def __init__(self, handle: Any, reads: list[tuple[str, int]]) -> None:
        self._handle, self._reads = handle, reads

    def __enter__(self) -> _CountingHandle:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        t = self._handle.get_tensor(name)
        self._reads.append((name, t.numel() * t.element_size()))
        return t

    def get_slice(self, name: str) -> Any:
        inner, reads = self._handle.get_slice(name), self._reads

        class _Slice:
            def get_shape(self) -> list[int]:
                return list(inner.get_shape())

            def __getitem__(self, index: Any) -> torch.Tensor:
                t = inner[index]
                reads.append((name, t.numel() * t.element_size()))
                return t

        return _Slice()


def _load_counting(monkeypatch: pytest.MonkeyPatch, shard: StageShard, path: Path
                   ) -> tuple[LlamaStage, list[tuple[str, int]], list[str]]:
    reads: list[tuple[str, int]] = []
    opened: list[str] = []
    real = safetensors.safe_open

    def counting_open(file: str, framework: str, **kw: Any) -> _CountingHandle:
        opened.append(Path(file).name)
        return _CountingHandle(real(file, framework=framework, **kw), reads)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    stage = LlamaStage(CONFIG, shard)
    load_stage_weights(stage, "auto", str(path))
    monkeypatch.setattr(safetensors, "safe_open", real)
    return stage, reads, opened


def test_checkpoint_is_sharded_over_several_files(checkpoint: tuple[Path, dict]) -> None:
    path, _ = checkpoint
    assert (path / SAFETENSORS_INDEX).is_file()
    assert len(list(path.glob("*.safetensors"))) >= 2


@pytest.mark.parametrize("shard", _shards(), ids=lambda s: f"stage{s.layer_start}-rank{s.tp_rank}")
def test_each_rank_reads_only_its_own_slices(monkeypatch: pytest.MonkeyPatch, checkpoint: tuple[Path, dict],
                                             shard: StageShard) -> None:
    path, full = checkpoint
    stage, reads, opened = _load_counting(monkeypatch, shard, path)
    params = dict(stage.named_parameters())
    owned = {_global(shard, local) for local in params}
    # Only its own tensors, each once, and only from the files the index says hold them.
    read_names = [n for n, _ in reads]
    assert sorted(read_names) == sorted(owned)
    weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    assert set(opened) == {weight_map[n] for n in owned}
    assert len(opened) == len(set(opened))
    # Its share: the bytes of what it holds (replicated embedding, norms, head included).
    share = sum(p.numel() * p.element_size() for p in params.values())
    read_bytes = sum(b for _, b in reads)
    assert read_bytes <= READ_SLACK * share
    full_bytes = sum(full[n].numel() * full[n].element_size() for n in owned)
    assert read_bytes < full_bytes   # the split tensors were not read whole
    # What it loaded is exactly its slice of the full weights.
    for local, p in params.items():
        name = _global(shard, local)
        assert torch.equal(p.detach(), _expected_slice(name, full[name], shard.tp_rank)), name


def test_reads_per_rank_sum_to_the_checkpoint_plus_replicas(monkeypatch: pytest.MonkeyPatch,
                                                            checkpoint: tuple[Path, dict]) -> None:
    path, full = checkpoint
    per_tensor: dict[str, int] = defaultdict(int)
    for shard in _shards():
        for name, n in _load_counting(monkeypatch, shard, path)[1]:
            per_tensor[name] += n
    for name, t in full.items():
        nbytes = t.numel() * t.element_size()
        split = any(f".{c}." in name for c in COLUMN) or name.endswith(ROW)
        # A split tensor is read once in all (its TP slices, by each stage that holds it once);
        # a replicated one once by each of the TP ranks of the stage that holds it.
        assert per_tensor[name] == (nbytes if split else TP * nbytes), name


@pytest.mark.parametrize("shard", _shards(), ids=lambda s: f"stage{s.layer_start}-rank{s.tp_rank}")
def test_dummy_weights_are_drawn_per_shard_and_equal_the_unsplit_model(monkeypatch: pytest.MonkeyPatch,
                                                                       shard: StageShard) -> None:
    whole = dict(dummy_weights(LlamaStage(CONFIG, StageShard.whole(CONFIG)), seed=5))
    drawn = [0]
    real_randn = torch.randn

    def counting_randn(*args: Any, **kw: Any) -> torch.Tensor:
        t = real_randn(*args, **kw)
        drawn[0] += t.numel()
        return t

    monkeypatch.setattr(torch, "randn", counting_randn)
    stage = LlamaStage(CONFIG, shard)
    load_stage_weights(stage, "dummy", seed=5)
    monkeypatch.setattr(torch, "randn", real_randn)
    params = dict(stage.named_parameters())
    # Matrices are drawn only for the rank's lines; vectors (norms, biases) are ones/zeros here.
    assert drawn[0] == sum(p.numel() for p in params.values() if p.dim() == 2)
    for local, p in params.items():
        name = _global(shard, local).removeprefix("model.")
        assert torch.equal(p.detach(), _expected_slice(name, whole[name], shard.tp_rank)), name


def test_startup_timeout_grows_with_the_bytes_a_rank_reads() -> None:
    import dataclasses

    import yaml

    from fastserve.config import AppArgs

    root = Path(__file__).resolve().parents[2]
    app = yaml.safe_load((root / "config/opt175b.yaml").read_text())["applications"][0]
    spec = AppArgs.model_validate(app["args"], context={"require_profile": False}).engine_spec()
    # Stage 0's rank holds the most: its 48 layers' slices plus the replicated embeddings
    # (tests/unit/test_plan.py works the figure out by hand).
    assert spec.max_rank_weight_bytes() == 23_037_247_488
    assert spec.startup_timeout_s() == spec.timeouts.startup_timeout_s == 300.0   # 115 s at 200 MB/s: the floor
    slow = dataclasses.replace(spec, timeouts=dataclasses.replace(spec.timeouts, weight_read_bytes_per_s=50e6))
    assert slow.startup_timeout_s() == 23_037_247_488 / 50e6
    dummy = dataclasses.replace(slow, model=dataclasses.replace(slow.model, load_format="dummy"))
    assert dummy.startup_timeout_s() == 300.0


def test_torch_pickles_load_the_same_slices(tmp_path: Path, checkpoint: tuple[Path, dict]) -> None:
    """A ``.bin`` checkpoint is memory-mapped and sliced the same way."""
    _, full = checkpoint
    torch.save(full, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    shard = _shards()[-1]
    stage = LlamaStage(CONFIG, shard)
    load_stage_weights(stage, "auto", str(tmp_path))
    for local, p in stage.named_parameters():
        name = _global(shard, local)
        assert torch.equal(p.detach(), _expected_slice(name, full[name], shard.tp_rank)), name
