"""The import tower, read from the sources: every room of ``fastserve`` imports only its own floor
and the floors below, no module is in an import cycle, and the policy and KV-manager rooms import
no torch, ray or cupy.

Floors, lowest first: ``kernels`` (device code) → ``worker`` (the data plane) → the control plane's
shared modules with ``scheduler`` and ``kv`` (config sections embed their settings; the policy
rooms raise the shared errors) → ``engine`` → ``server`` → ``bench``. ``fastserve.main`` and
``fastserve.cli`` compose the rooms and stand above ``server``.

Every import counts, at module level or inside a function (a lazy import is still a dependency),
type-only ones (``if TYPE_CHECKING:``) too: a cycle hidden from the interpreter is still two
modules a reader cannot understand one without the other.
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


def module_of(path: Path, root: Path = ROOT) -> str:
    """``fastserve/kv/manager.py`` → ``fastserve.kv.manager``; a package's ``__init__`` is the package."""
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_graph(package: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports (``from a import b`` names ``a.b`` where that
    is a module, else ``a``). Importing a submodule runs its package's ``__init__`` first, but
    that is no dependency of the importer's: it is not an edge."""
    paths = {module_of(p, root): p for p in sorted(package.rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        named = (resolve(dotted) for _, dotted in imported_modules(path))
        graph[module] = {m for m in named if m is not None and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each set of modules that reach each other (a strongly connected
    component of more than one module, Tarjan's walk), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_room_has_sources() -> None:
    """The walk below sees real files (a moved folder would make the tower test pass vacuously)."""
    rooms = [room for room in FLOORS if room]
    assert {room: len(sources(room)) > 3 for room in rooms} == {room: True for room in rooms}


def test_no_module_imports_a_room_above_its_own() -> None:
    upward = [f"{path.relative_to(ROOT)}:{line} imports {module}"
              for path in sources() for line, module in imported_modules(path)
              if (floor := floor_of_module(module)) is not None and floor > floor_of_file(path)]
    assert upward == []


def test_no_module_is_in_an_import_cycle() -> None:
    assert cycles(import_graph(PACKAGE)) == []


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


def test_the_cycle_check_sees_type_only_and_lazy_imports(tmp_path: Path) -> None:
    """Else the cycle test could not fail: a cycle through ``if TYPE_CHECKING:``, one through a
    function's import, and a package's ``__init__`` importing a submodule that imports it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "from pkg.a import A\n",
        "c.py": "def f() -> None:\n    import pkg.d\n",
        "d.py": "from pkg import c\n",
        "e.py": "from pkg.a import A\n",
        "sub/__init__.py": "def g() -> None:\n    from pkg.sub import leaf\n",
        "sub/leaf.py": "from pkg.sub import g\n",
        "sub/alone.py": "import pkg.sub.leaf\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg, tmp_path)
    assert graph["pkg.e"] == {"pkg.a"} and graph["pkg.sub.alone"] == {"pkg.sub.leaf"}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub", "pkg.sub.leaf"]]
