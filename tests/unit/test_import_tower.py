"""The import tower, read from the sources: every room of ``fastserve`` imports only its own floor
and the floors below, and the policy and KV-manager rooms import no torch, ray or cupy.

Floors, lowest first: ``kernels`` (device code) → ``worker`` (the data plane) → the control plane's
shared modules with ``scheduler`` and ``kv`` (config sections embed their settings; the policy
rooms raise the shared errors) → ``engine`` → ``server`` → ``bench``. ``fastserve.main`` and
``fastserve.cli`` compose the rooms and stand above ``server``.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
The torch-free rule is checked twice: no such import in the sources, and none loaded when a fresh
interpreter imports every one of them (what the simulator relies on).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fastserve"
#: A room's floor: it may import rooms on its own floor or lower, never higher.
FLOORS = {"kernels": 0, "worker": 1, "": 2, "scheduler": 2, "kv": 2, "engine": 3, "server": 4, "bench": 6}
#: Top-level modules that compose the rooms (the Serve builder and the console script).
COMPOSERS = {"main": 5, "cli": 5}
TORCH_FREE = ("scheduler", "kv")
DEVICE_PACKAGES = frozenset({"torch", "ray", "cupy"})


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``path`` (``from a import b`` → ``a.b``,
    which may name a module or an attribute; only its room is read from it)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def floor_of_module(module: str) -> int | None:
    """The floor a dotted name lies on (``fastserve.server.http_api`` → 4); None outside fastserve."""
    parts = module.split(".")
    if parts[0] != "fastserve" or len(parts) < 2:
        return None
    if parts[1] in FLOORS:
        return FLOORS[parts[1]]
    return COMPOSERS.get(parts[1], FLOORS[""])


def floor_of_file(path: Path) -> int:
    rel = path.relative_to(PACKAGE).parts
    if len(rel) > 1:
        return FLOORS[rel[0]]
    return COMPOSERS.get(path.stem, FLOORS[""])


def sources(room: str = "") -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


def test_every_room_has_sources() -> None:
    """The walk below sees real files (a moved folder would make the tower test pass vacuously)."""
    rooms = [room for room in FLOORS if room]
    assert {room: len(sources(room)) > 3 for room in rooms} == {room: True for room in rooms}


def test_no_module_imports_a_room_above_its_own() -> None:
    upward = [f"{path.relative_to(ROOT)}:{line} imports {module}"
              for path in sources() for line, module in imported_modules(path)
              if (floor := floor_of_module(module)) is not None and floor > floor_of_file(path)]
    assert upward == []


def test_nothing_imports_the_old_top_level_packages() -> None:
    """``app``, ``actors``, ``kernels`` and ``loadtest`` are gone; a stale import would find
    another package of that name (Hugging Face ships one called ``kernels``)."""
    old = {"app", "actors", "kernels", "loadtest"}
    stale = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in [*sources(), *sorted((ROOT / "tests").rglob("*.py"))]
             for line, module in imported_modules(path) if module.split(".")[0] in old]
    assert stale == []


@pytest.mark.parametrize("room", TORCH_FREE)
def test_policy_and_kv_sources_import_no_torch_ray_or_cupy(room: str) -> None:
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sources(room) for line, module in imported_modules(path)
             if module.split(".")[0] in DEVICE_PACKAGES]
    assert found == []


def test_importing_every_policy_and_kv_module_loads_no_torch_ray_or_cupy() -> None:
    """Transitively too: whatever they import (``fastserve.worker.messages``, ``fastserve.errors``, ...)
    stays light."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for room in TORCH_FREE for p in sources(room)]
    modules = [m.removesuffix(".__init__") for m in modules]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted({{k.split('.')[0] for k in sys.modules}} & {set(DEVICE_PACKAGES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_checks_see_lazy_dotted_and_from_imports(tmp_path: Path) -> None:
    """Else the tests above could not fail."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom fastserve.errors import ErrorCode\n\ndef f() -> None:\n"
                     "    from fastserve.server import http_api\n    import fastserve.engine.async_engine\n"
                     "    import torch.nn\n    from . import sibling\n")
    found = [(line, module, floor_of_module(module)) for line, module in imported_modules(probe)]
    assert found == [(1, "os", None), (2, "fastserve.errors.ErrorCode", 2), (5, "fastserve.server.http_api", 4),
                     (6, "fastserve.engine.async_engine", 3), (7, "torch.nn", None)]
    assert floor_of_file(PACKAGE / "kv" / "manager.py") == 2 < floor_of_file(PACKAGE / "engine" / "core.py")
    assert floor_of_file(PACKAGE / "worker" / "model" / "llama.py") == 1
    assert floor_of_file(PACKAGE / "main.py") > floor_of_file(PACKAGE / "server" / "ingress.py")
