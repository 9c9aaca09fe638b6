"""The import tower, read from the sources: ``loadtest → app → actors → kernels``, never upwards,
and the policy and KV-manager modules (``app/scheduler``, ``app/kv``) free of torch, ray and cupy.

Every import counts, at module level or inside a function (a lazy import is still a dependency);
relative imports stay inside their package. The torch-free rule is checked twice: no such import
in the modules' sources, and none loaded when a fresh interpreter imports every one of them
(what the simulator relies on).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Higher layers may import lower ones, never the reverse.
TOWER = ("kernels", "actors", "app", "loadtest")
RANK = {name: level for level, name in enumerate(TOWER)}
TORCH_FREE = ("app/scheduler", "app/kv")
DEVICE_PACKAGES = frozenset({"torch", "ray", "cupy"})


def imported_roots(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_every_layer_has_sources() -> None:
    """The walk below sees real files (a moved folder would make the tower test pass vacuously)."""
    assert {layer: len(sources(layer)) > 3 for layer in TOWER} == {layer: True for layer in TOWER}
    assert {d: len(sources(d)) > 3 for d in TORCH_FREE} == {d: True for d in TORCH_FREE}


@pytest.mark.parametrize("layer", TOWER)
def test_no_layer_imports_one_above_it(layer: str) -> None:
    upward = [f"{path.relative_to(ROOT)}:{line} imports {root}"
              for path in sources(layer) for line, root in imported_roots(path)
              if RANK.get(root, -1) > RANK[layer]]
    assert upward == []


@pytest.mark.parametrize("folder", TORCH_FREE)
def test_policy_and_kv_sources_import_no_torch_ray_or_cupy(folder: str) -> None:
    found = [f"{path.relative_to(ROOT)}:{line} imports {root}"
             for path in sources(folder) for line, root in imported_roots(path) if root in DEVICE_PACKAGES]
    assert found == []


def test_importing_every_policy_and_kv_module_loads_no_torch_ray_or_cupy() -> None:
    """Transitively too: whatever they import (``actors.messages``, ``app.errors``, ...) stays light."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for d in TORCH_FREE for p in sources(d)]
    modules = [m.removesuffix(".__init__") for m in modules]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted({{k.split('.')[0] for k in sys.modules}} & {set(DEVICE_PACKAGES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_checks_see_an_upward_import(tmp_path: Path) -> None:
    """The reader finds lazy, dotted and from-imports alike (else the tests above could not fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom app.scheduler import job\n\ndef f() -> None:\n    import torch.nn\n"
                     "    from . import sibling\n")
    assert list(imported_roots(probe)) == [(1, "os"), (2, "app"), (5, "torch")]
