"""The import tower, read from the sources: ``loadtest → app → actors → kernels``, never upwards,
and the policy and KV-manager modules (``app/scheduler``, ``app/kv``) free of torch, ray and cupy.

Inside ``app`` the rooms stack the same way: ``app.server → app.engine → app.scheduler, app.kv``.
The top level's shared modules (config sections, errors, tokenizer, logs) may use the policy and
KV rooms (the config embeds their sections) but neither the engine nor the server room, so every
room can import them; ``app.main``, the builder Serve imports, composes the rooms and is exempt, as is a shim that keeps
a moved server module's old path for one release.

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
#: app's rooms, lowest first: a room may import its own and lower ones, never a higher one.
ROOMS = {"scheduler": 0, "kv": 0, "engine": 1, "server": 2}
#: The shared top level (``app/*.py``) sits just above the policy and KV rooms.
TOP_RANK = 0
#: Composes every room: the one top-level module that may import them all.
COMPOSER = "app/main.py"
#: Re-exports a moved server module from its old path for one release (``app/llm_server.py``).
DEPRECATED_SHIMS = frozenset({"app/llm_server.py"})


def imported_roots(path: Path) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``path`` (``from a import b`` → ``a.b``,
    which may name a module or an attribute; the room is all that is read from it)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def room_of_module(module: str) -> str | None:
    """The app room a dotted module lies in (``app.server.http_api`` → ``server``); None outside
    ``app`` or at its top level."""
    parts = module.split(".")
    return parts[1] if parts[0] == "app" and len(parts) > 2 and parts[1] in ROOMS else None


def rank_of_file(path: Path) -> int:
    rel = path.relative_to(ROOT / "app").parts
    return ROOMS[rel[0]] if len(rel) > 1 else TOP_RANK


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


def test_every_room_has_sources() -> None:
    """The rooms are where the rule below looks (a renamed room would pass it vacuously)."""
    assert {room: len(sources(f"app/{room}")) > 3 for room in ROOMS} == {room: True for room in ROOMS}


def test_no_app_module_imports_a_room_above_its_own() -> None:
    """``server → engine → scheduler, kv``; the shared top level imports neither engine nor server."""
    upward = [f"{path.relative_to(ROOT)}:{line} imports {module}"
              for path in sources("app")
              if path.relative_to(ROOT).as_posix() not in {COMPOSER, *DEPRECATED_SHIMS}
              for line, module in imported_modules(path)
              if (room := room_of_module(module)) is not None and ROOMS[room] > rank_of_file(path)]
    assert upward == []


@pytest.mark.parametrize("room", ["scheduler", "kv"])
def test_policy_and_kv_import_nothing_from_the_server_or_the_engine(room: str) -> None:
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sources(f"app/{room}") for line, module in imported_modules(path)
             if room_of_module(module) in ("server", "engine")]
    assert found == []


def test_the_room_checks_see_an_upward_import(tmp_path: Path) -> None:
    """Lazy and from-imports alike name their room (else the two tests above could not fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from app.errors import ErrorCode\n\ndef f() -> None:\n"
                     "    from app.server import http_api\n    import app.engine.async_engine\n")
    found = [(line, module, room_of_module(module)) for line, module in imported_modules(probe)]
    assert found == [(1, "app.errors.ErrorCode", None), (4, "app.server.http_api", "server"),
                     (5, "app.engine.async_engine", "engine")]
    assert rank_of_file(ROOT / "app" / "kv" / "manager.py") == 0 < ROOMS["engine"] < ROOMS["server"]
    assert rank_of_file(ROOT / "app" / "config.py") == TOP_RANK < ROOMS["engine"]
