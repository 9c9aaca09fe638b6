"""The shape ``fastserve/`` keeps for a reader: small modules, and no wide class without its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fastserve"
#: The control plane: the package's top level and these rooms.
CONTROL_ROOMS = ("server", "engine", "scheduler", "kv")


def control_plane_sources() -> list[Path]:
    return sorted([*PACKAGE.glob("*.py"), *(p for room in CONTROL_ROOMS for p in (PACKAGE / room).rglob("*.py"))])


MAX_MODULE_LINES = 400
#: Past this many public methods a class says why in its docstring ("... on purpose: ...").
MAX_PUBLIC_METHODS = 15


def wide_classes(source: str) -> list[tuple[str, int, str]]:
    """(name, public methods, docstring) of each class with more than ``MAX_PUBLIC_METHODS``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            public = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                      and not f.name.startswith("_")]
            if len(public) > MAX_PUBLIC_METHODS:
                out.append((node.name, len(public), ast.get_docstring(node) or ""))
    return out


def test_no_app_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in control_plane_sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_every_wide_class_says_why_in_its_docstring() -> None:
    unexplained = [(str(p.relative_to(ROOT)), name, n) for p in control_plane_sources()
                   for name, n, doc in wide_classes(p.read_text()) if "on purpose" not in doc]
    assert unexplained == []


def test_the_width_check_counts_public_methods_only() -> None:
    methods = "".join(f"    def m{i}(self) -> None: ...\n" for i in range(MAX_PUBLIC_METHODS + 1))
    wide = f"class Wide:\n{methods}    def _private(self) -> None: ...\n"
    narrow = f"class Narrow:\n    def _a(self) -> None: ...\n{methods.replace('def m0', 'def _m0')}"
    assert wide_classes(wide) == [("Wide", MAX_PUBLIC_METHODS + 1, "")]
    assert wide_classes(narrow) == []
