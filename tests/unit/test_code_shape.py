"""The shape ``fastserve/``'s control plane keeps for a reader: functions short enough to read
at once, each class whole in one module, and every module saying what it owns.

A module's length and a class's count of methods are not checked: a class that owns one piece of
state keeps every operation on it, however many, and splitting it to pass a count (a base class
in one file, its only subclass in the next) makes a reader open both to follow either. Import
cycles are ``tests/unit/test_import_tower.py``'s.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fastserve"
#: The control plane: the package's top level and these rooms.
CONTROL_ROOMS = ("server", "engine", "scheduler", "kv")
#: Lines of a function's own code (its docstring and nested functions not counted; each nested
#: function is checked on its own). Past this a function does several things.
MAX_FUNCTION_LINES = 60

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def control_plane_sources() -> list[Path]:
    return sorted([*PACKAGE.glob("*.py"), *(p for room in CONTROL_ROOMS for p in (PACKAGE / room).rglob("*.py"))])


def room_of(path: Path) -> str:
    """The folder under ``fastserve/`` a module lives in ("" for the top level)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def functions(tree: ast.AST) -> Iterator[FunctionNode]:
    for node in ast.walk(tree):
        if isinstance(node, FunctionNode):
            yield node


def own_lines(fn: FunctionNode) -> int:
    """Lines from the function's first statement after its docstring to its end, less the lines
    of functions and classes defined inside it."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str) and len(body) > 1:
        body = body[1:]
    total = fn.end_lineno - body[0].lineno + 1   # type: ignore[operator]
    return total - sum(d.end_lineno - d.lineno + 1 for d in nested_definitions(fn))   # type: ignore[operator]


def nested_definitions(node: ast.AST) -> Iterator[FunctionNode | ast.ClassDef]:
    """Functions and classes defined inside ``node``, outermost only."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, FunctionNode | ast.ClassDef):
            yield child
        else:
            yield from nested_definitions(child)


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, line, own lines) of each function over ``MAX_FUNCTION_LINES``."""
    return [(fn.name, fn.lineno, n) for fn in functions(ast.parse(source))
            if (n := own_lines(fn)) > MAX_FUNCTION_LINES]


def split_classes(sources: dict[str, tuple[str, str]]) -> list[str]:
    """Classes split across modules of one room: a base class of ours with exactly one subclass,
    defined in a sibling module. ``sources``: module path → (room, source)."""
    defined: dict[str, list[str]] = {}
    subclasses: dict[str, list[str]] = {}
    for path, (_, source) in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(path)
                for base in node.bases:
                    name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    if name is not None:
                        subclasses.setdefault(name, []).append(f"{path}:{node.name}")
    split = []
    for base, subs in subclasses.items():
        homes = defined.get(base, [])
        if len(homes) != 1 or len(subs) != 1:
            continue
        sub_path = subs[0].rpartition(":")[0]
        if sub_path != homes[0] and sources[sub_path][0] == sources[homes[0]][0]:
            split.append(f"{homes[0]}:{base} -> {subs[0]}")
    return split


def test_no_control_plane_function_is_longer_than_60_lines() -> None:
    long = [f"{p.relative_to(ROOT)}:{line} {name}: {n} lines" for p in control_plane_sources()
            for name, line, n in long_functions(p.read_text())]
    assert long == []


def test_no_class_is_split_across_modules_of_one_room() -> None:
    sources = {str(p.relative_to(ROOT)): (room_of(p), p.read_text()) for p in control_plane_sources()}
    assert split_classes(sources) == []


def test_every_module_says_what_it_owns() -> None:
    silent = [str(p.relative_to(ROOT)) for p in control_plane_sources()
              if not ast.get_docstring(ast.parse(p.read_text()))]
    assert silent == []


def test_the_length_check_counts_own_lines_only() -> None:
    """Else the checks above could not fail (or would fail on a builder of routes)."""
    lines = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    nested = "".join(f"        y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    long = f"def long():\n    \"\"\"Doc.\"\"\"\n{lines}    return x0\n"
    builder = f"def builder():\n    def route():\n{nested}        return 0\n    return route\n"
    assert long_functions(long) == [("long", 1, MAX_FUNCTION_LINES + 1)]
    assert long_functions(builder) == []
    assert long_functions(f"def exact():\n{lines}") == []


def test_the_split_check_finds_a_single_use_base_in_a_sibling_module() -> None:
    base = "class Base:\n    pass\n"
    sub = "from x.a import Base\n\n\nclass Whole(Base):\n    pass\n"
    assert split_classes({"a.py": ("kv", base), "b.py": ("kv", sub)}) == ["a.py:Base -> b.py:Whole"]
    assert split_classes({"a.py": ("kv", base + sub.split("\n\n\n")[1])}) == []   # one module
    assert split_classes({"a.py": ("worker", base), "b.py": ("", sub)}) == []   # another room: a layer's extension
    two = sub + "\n\nclass Other(Base):\n    pass\n"
    assert split_classes({"a.py": ("kv", base), "b.py": ("kv", two)}) == []   # a real base
