"""Weight loading for ``OPTStage``: Hugging Face checkpoints or seeded dummy weights.

Checkpoint names map one-to-one onto our module names once the ``model.decoder.`` (or
``decoder.``) prefix is stripped and the global layer index is rebased onto the stage. Each stage
and tensor-parallel rank takes only the slices it owns: column-parallel weights (q/k/v, fc1) are
split by output rows, row-parallel weights (out_proj, fc2) by input columns; biases of
row-parallel layers and everything else are replicated.

``load_format="dummy"`` (as vLLM's ``--load-format dummy``) draws every full tensor from a
generator seeded by ``(seed, name)`` and then slices it, so any TP/PP split of the same seed holds
exactly the same model as the unsplit one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from actors.model.opt import OPTStage

_PREFIXES = ("model.decoder.", "decoder.", "model.")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: Split by output rows (dim 0) / input columns (dim 1) across tensor-parallel ranks.
_COLUMN_PARALLEL = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "fc1.")
_ROW_PARALLEL_WEIGHTS = ("self_attn.out_proj.weight", "fc2.weight")
_TIED = ("lm_head.weight",)
#: Hugging Face's OPT initialisation scale, reused for dummy weights so activations stay sane.
DUMMY_INIT_STD = 0.02


def canonical_name(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _local_name(stage: OPTStage, name: str) -> str | None:
    """Our parameter name for a checkpoint tensor, or None if this stage does not hold it."""
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = int(m.group(1))
    if not stage.shard.layer_start <= layer < stage.shard.layer_end:
        return None
    return f"layers.{layer - stage.shard.layer_start}.{m.group(2)}"


def _shard(stage: OPTStage, name: str, full: torch.Tensor) -> torch.Tensor:
    rank, size = stage.shard.tp_rank, stage.shard.tp_size
    if size == 1:
        return full
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if suffix.startswith(_COLUMN_PARALLEL):
        return full.chunk(size, dim=0)[rank]
    if suffix in _ROW_PARALLEL_WEIGHTS:
        return full.chunk(size, dim=1)[rank]
    return full


def load_weights(stage: OPTStage, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
    """Copy checkpoint tensors into ``stage``, taking this stage's slices; check every shape."""
    params = dict(stage.named_parameters())
    loaded: set[str] = set()
    for raw_name, full in tensors:
        name = canonical_name(raw_name)
        if name in _TIED:
            continue
        local = _local_name(stage, name)
        if local is None or local not in params:
            continue
        piece = _shard(stage, local, full)
        target = params[local]
        if tuple(piece.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {raw_name!r} has shape {tuple(full.shape)}; this stage expects "
                f"{tuple(target.shape)} for {local!r} (tp_rank {stage.shard.tp_rank}/{stage.shard.tp_size})"
            )
        with torch.no_grad():
            target.copy_(piece)
        loaded.add(local)
    missing = sorted(set(params) - loaded)
    if strict and missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors this stage needs, e.g. {missing[:5]}")


def _dummy_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if name.endswith("layer_norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * DUMMY_INIT_STD


def full_shapes(stage: OPTStage) -> dict[str, tuple[int, ...]]:
    """Unsharded shapes, keyed by global checkpoint name, of every tensor this stage holds."""
    shapes: dict[str, tuple[int, ...]] = {}
    for local, p in stage.named_parameters():
        m = _LAYER.match(local)
        name = local if m is None else f"layers.{int(m.group(1)) + stage.shard.layer_start}.{m.group(2)}"
        shape = list(p.shape)
        suffix = m.group(2) if m else local
        if suffix.startswith(_COLUMN_PARALLEL):
            shape[0] *= stage.shard.tp_size
        elif suffix in _ROW_PARALLEL_WEIGHTS:
            shape[1] *= stage.shard.tp_size
        shapes[name] = tuple(shape)
    return shapes


def dummy_weights(stage: OPTStage, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in full_shapes(stage).items():
        yield name, _dummy_tensor(name, shape, seed)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a local Hugging Face model folder: safetensors preferred, else .bin."""
    for pattern in ("*.safetensors", "pytorch_model*.bin", "*.bin", "*.pt"):
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"no .safetensors or .bin weights in {path}")


def iter_checkpoint(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, handle.get_tensor(name)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            yield from state.items()


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id downloaded where the machine is online (never in tests)."""
    path = Path(model)
    if path.exists():
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"model {model!r} is not a local folder and HF_HUB_OFFLINE=1")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def load_stage_weights(stage: OPTStage, load_format: str, model_path: str | None = None, seed: int = 0) -> None:
    """Fill ``stage`` from ``load_format``: ``dummy`` (seeded random) or ``auto`` (a checkpoint)."""
    if load_format == "dummy":
        load_weights(stage, dummy_weights(stage, seed))
        return
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if model_path is None:
        raise ValueError("load_format 'auto' needs a model path or hub id")
    load_weights(stage, iter_checkpoint(checkpoint_files(resolve_model_path(model_path))))

