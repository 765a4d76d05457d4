"""The package's import structure, read from the source with ``ast`` (nothing is imported).

Every module under ``nsp/`` (and ``models/``, installed as ``nsp.models``) is parsed, its imports taken from
anywhere in it (module level, inside functions, under ``if TYPE_CHECKING``), and grouped by *unit*: a subpackage
of ``nsp`` (``nsp.storage``, ``nsp.optim``, ...) or a top-level module (``nsp.cli``, ``nsp.engine``). Three
rules hold:

1. No cycle between units: the units form a layered order (``LAYERS`` below documents it; the test derives the
   order from the imports and fails on any cycle, naming the import lines that close it).
2. No private name crosses a unit: a module or name with a leading underscore (``nsp.primitives._ffi``,
   ``from nsp.optim.storage import _mark``) is imported only from inside its own unit.
3. The compiled extension ``nsp._nsp_ffi`` is imported by one unit only, ``FFI_UNIT``; every other unit reaches
   the C++ engine through that unit's public names.

Besides, inside a unit no two modules import each other (imports under ``if TYPE_CHECKING`` aside): a module
that two others need goes below both (``nsp.distributed.coordination`` under ``runtime`` and ``agree``).

The checker itself is tested on a tiny synthetic package (a cycle, a private import, a stray extension import),
so a checker that stopped seeing imports would fail here too.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The source trees of the package: top-level name -> folder (models/ is installed as nsp.models).
SOURCES = {"nsp": ROOT / "nsp", "nsp.models": ROOT / "models"}
#: The compiled C++ extension, and the one unit that imports it.
FFI_MODULE = "nsp._nsp_ffi"
FFI_UNIT = "nsp.engine"
#: The order the units are layered in, lowest first: a unit imports only units before it. Documentation for the
#: reader; the test checks that the imports are acyclic, and that this list agrees with them.
LAYERS = ("nsp.rss", "nsp.engine", "nsp.spec", "nsp.csd", "nsp.storage", "nsp.primitives", "nsp.offload", "nsp.optim",
          "nsp.distributed", "nsp.models", "nsp.train", "nsp.emulate", "nsp.cli")


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's reference to one module (and, for ``from M import a, b``, the names taken)."""

    source: str  # the importing module
    target: str  # the imported module (``from P import m`` where P.m is a module: P.m)
    names: tuple[str, ...]  # names taken from ``target`` (empty for ``import M`` and for submodules)
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: never executed

    def where(self) -> str:
        return f"{self.source}:{self.line}"


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file under the source trees."""
    modules = {}
    for top, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([top, *parts])] = path
    return modules


def read_imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of every module, wherever it appears in the file."""
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(name, alias.name, (), node.lineno, id(node) in typing_only) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module
                names = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules or sub == FFI_MODULE:
                        found.append(Import(name, sub, (), node.lineno, id(node) in typing_only))
                    else:
                        names.append(alias.name)
                if names:
                    found.append(Import(name, base, tuple(names), node.lineno, id(node) in typing_only))
    return found


def unit_of(module: str) -> str | None:
    """The unit a module belongs to (``nsp.storage.store`` -> ``nsp.storage``); None outside the package."""
    parts = module.split(".")
    if parts[0] != "nsp":
        return None
    return ".".join(parts[:2])


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


@dataclasses.dataclass
class Report:
    cycles: list[list[Import]]  # each: the imports that close one cycle between units
    groups: list[list[str]]  # each: the units that import each other, directly or not (one per cycle above)
    private: list[Import]
    ffi: list[Import]
    edges: dict[str, dict[str, Import]]  # unit -> unit it imports -> one import that does

    @property
    def problems(self) -> list[str]:
        out = []
        for cycle in self.cycles:
            path = " -> ".join([unit_of(i.source) for i in cycle] + [unit_of(cycle[0].source)])
            group = ", ".join(sorted(self.groups[self.cycles.index(cycle)]))
            out.append(f"import cycle between units {path}: "
                       + "; ".join(f"{i.where()} imports {i.target}" for i in cycle)
                       + f" (units caught in cycles together: {group})")
        for i in self.private:
            what = ", ".join(i.names) if i.names else i.target
            out.append(f"{i.where()} imports the private {what} from {i.target}, another unit")
        for i in self.ffi:
            out.append(f"{i.where()} imports {FFI_MODULE}: only {FFI_UNIT} may (use its public names)")
        return out


def check(sources: dict[str, Path], ffi_unit: str = FFI_UNIT) -> Report:
    """Reads the imports of the package at ``sources`` and applies the three rules."""
    modules = module_files(sources)
    imports = read_imports(modules)
    edges: dict[str, dict[str, Import]] = {}
    private, ffi = [], []
    for i in imports:
        source, target = unit_of(i.source), unit_of(i.target)
        if target is None:
            continue
        if i.target == FFI_MODULE:
            if source != ffi_unit:
                ffi.append(i)
            continue
        if target == source or i.target == "nsp":
            continue
        inner = i.target.split(".")[1:]  # the module's path below nsp
        if any(_private(p) for p in inner) or any(_private(n) for n in i.names):
            private.append(i)
        edges.setdefault(source, {}).setdefault(target, i)
    return Report(*_cycles(edges), private, ffi, edges)


def _cycles(edges: dict[str, dict[str, Import]]) -> tuple[list[list[Import]], list[list[str]]]:
    """One cycle (as the imports along it) per strongly connected group of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(u: str) -> None:
        index[u] = low[u] = len(index)
        stack.append(u)
        for v in edges.get(u, {}):
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in stack:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            group = []
            while True:
                v = stack.pop()
                group.append(v)
                if v == u:
                    break
            if len(group) > 1:
                groups.append(group)

    for u in sorted(set(edges) | {v for out in edges.values() for v in out}):
        if u not in index:
            visit(u)
    cycles = []
    for group in groups:
        # A shortest way back to the group's first unit, through the group: the imports that close the cycle.
        start, members = sorted(group)[0], set(group)
        paths = {start: []}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for u in frontier:
                for v, imp in sorted(edges.get(u, {}).items()):
                    if v == start:
                        found = paths[u] + [imp]
                        break
                    if v in members and v not in paths:
                        paths[v] = paths[u] + [imp]
                        nxt.append(v)
                if found:
                    break
            frontier = nxt
        cycles.append(found)
    return cycles, groups


def module_cycles(sources: dict[str, Path]) -> list[tuple[str, ...]]:
    """Groups of modules of one unit that import each other, directly or not (typing-only imports aside)."""
    modules = module_files(sources)
    edges: dict[str, dict[str, Import]] = {}
    for i in read_imports(modules):
        target = i.target
        while target and target not in modules:  # ``from P.m import x`` where x is a name: module P.m
            target = target.rpartition(".")[0]
        if (target and target != i.source and not i.typing_only and unit_of(target) == unit_of(i.source)
                and target != unit_of(target)):  # a unit's __init__ gathers its modules' names: not a cycle
            edges.setdefault(i.source, {}).setdefault(target, i)
    return [tuple(sorted(group)) for group in _cycles(edges)[1]]


# ---- the package ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report() -> Report:
    return check(SOURCES)


def test_no_import_cycle_between_units(report):
    cycles = [p for p in report.problems if p.startswith("import cycle")]
    assert not cycles, "\n".join(cycles)


def test_no_private_name_crosses_a_unit(report):
    private = [i for i in report.private]
    assert not private, "\n".join(p for p in report.problems if "private" in p)


def test_only_one_unit_imports_the_extension(report):
    assert not report.ffi, "\n".join(p for p in report.problems if FFI_MODULE in p)
    assert FFI_MODULE in {i.target for i in read_imports(module_files(SOURCES))}, "nothing imports the extension?"


def test_no_import_cycle_between_modules_of_a_unit():
    assert not module_cycles(SOURCES)


def test_layers_agree_with_the_imports(report):
    """Every unit is listed in ``LAYERS``, and imports only units listed before it."""
    units = {unit_of(m) for m in module_files(SOURCES)} - {"nsp"}
    assert units <= set(LAYERS), f"units missing from LAYERS: {sorted(units - set(LAYERS))}"
    wrong = [f"{imp.where()} imports {imp.target}: {target} is not below {source} in LAYERS"
             for source, out in report.edges.items() for target, imp in out.items()
             if source in LAYERS and target in LAYERS and LAYERS.index(target) > LAYERS.index(source)]
    assert not wrong, "\n".join(wrong)


# ---- the checker, on a synthetic package ----------------------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / "nsp" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return {"nsp": tmp_path / "nsp"}


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    sources = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": """
            def f():
                from nsp.high.b import g   # the import that closes the cycle, inside a function
                return g
            """,
        "high/__init__.py": "from nsp.high.b import g\n",
        "high/b.py": "from nsp.low import a\n\ndef g():\n    return a\n",
        "other/__init__.py": "from . import x\n",
        "other/x.py": "from ..low.a import f\n",  # relative, and one-way: no cycle
    })
    report = check(sources)
    assert len(report.cycles) == 1
    [problem] = [p for p in report.problems if p.startswith("import cycle")]
    assert "nsp.high -> nsp.low -> nsp.high" in problem and "nsp.low.a:3 imports nsp.high.b" in problem, problem
    assert report.edges["nsp.other"] == {"nsp.low": report.edges["nsp.other"]["nsp.low"]}
    assert not report.private and not report.ffi


def test_checker_finds_private_names_and_the_extension(tmp_path):
    sources = _package(tmp_path, {
        "__init__.py": "",
        "engine.py": "from nsp import _nsp_ffi\n",
        "lib/__init__.py": "",
        "lib/_inner.py": "X = 1\n",
        "lib/pub.py": "from nsp.lib._inner import X\n_hidden = X\n",  # private, but inside its own unit: fine
        "user/__init__.py": "",
        "user/u.py": """
            from nsp.lib import _inner
            from nsp.lib.pub import _hidden
            import nsp._nsp_ffi
            from nsp.engine import __doc__ as doc   # a dunder is not private
            """,
    })
    report = check(sources, ffi_unit="nsp.engine")
    assert not report.cycles
    assert sorted((i.target, i.names) for i in report.private) == [("nsp.lib._inner", ()),
                                                                    ("nsp.lib.pub", ("_hidden",))]
    assert [(i.source, i.line) for i in report.ffi] == [("nsp.user.u", 4)]
    assert check(sources, ffi_unit="nsp.user").ffi[0].source == "nsp.engine"


def test_checker_finds_modules_of_a_unit_that_import_each_other(tmp_path):
    sources = _package(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "from nsp.pkg.a import f\n",
        "pkg/a.py": "def f():\n    from nsp.pkg.b import g\n    return g\n",
        "pkg/b.py": "from nsp.pkg import a\n\ng = a\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nsp.pkg.d import D\n",
        "pkg/d.py": "from nsp.pkg.c import TYPE_CHECKING as D\n",  # c -> d only for typing: no cycle
    })
    assert module_cycles(sources) == [("nsp.pkg.a", "nsp.pkg.b")]
