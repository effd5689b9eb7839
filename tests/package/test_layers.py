"""The import graph of ``hpc_elastic/`` against the layers that docs/design.md lists.

No module imports one on a higher layer, and no modules import each other, directly or through
others. An import inside a function counts like one at the top of a file (it moves the cost,
not the dependency); only an ``if TYPE_CHECKING:`` import, which never runs, does not. The
graph is read from the source with ``ast``, so nothing is imported to check it; a module
imported by its name as a string (``importlib.import_module``: the CLI's lazy commands, the
training package's lazy names) is not seen, and each of those points down today.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpc_elastic"
DESIGN = ROOT / "docs" / "design.md"
WHERE = "docs/design.md"


@dataclass(frozen=True)
class Import:
    """One import of a module of the package by another: ``source`` imports ``target``."""

    source: str
    target: str
    where: str
    """``path:line`` of the import statement."""


@dataclass(frozen=True)
class Layer:
    number: int
    title: str
    names: tuple[str, ...]
    """``name`` is the module ``<package>.name``; ``name/`` a subpackage and its modules;
    ``__init__`` the package's own ``__init__.py``."""

    def holds(self, module: str, package: str) -> bool:
        return any(_named(name, module, package) for name in self.names)

    def __str__(self) -> str:
        return f"layer {self.number} ({self.title})"


def _named(name: str, module: str, package: str) -> bool:
    if name == "__init__":
        return module == package
    if name.endswith("/"):
        inner = f"{package}.{name[:-1]}"
        return module == inner or module.startswith(inner + ".")
    return module == f"{package}.{name}"


# --- reading the graph -------------------------------------------------------------------


def modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by its dotted name."""
    found: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that may run, at any depth (functions, methods, ``try``)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: Iterable[ast.AST] = node.orelse  # the `if` block never runs; its `else` does
    else:
        children = ast.iter_child_nodes(node)
    for child in children:
        yield from _runtime_imports(child)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names ``node`` imports; ``from a import b`` gives ``a.b`` (a module or not)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package that holds `module`
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" for alias in node.names]


def _module_of(name: str, known: Mapping[str, Path]) -> str | None:
    """The deepest module of the package that ``name`` is or lies in (``a.b.NAME`` is ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(package_dir: Path) -> dict[str, list[Import]]:
    """Each module's imports of other modules of the package (third-party ones left out)."""
    known = modules(package_dir)
    graph: dict[str, list[Import]] = {}
    for module, path in known.items():
        shown = path.relative_to(package_dir.parent)
        graph[module] = []
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                target = _module_of(name, known)
                if target is not None and target != module:
                    graph[module].append(Import(module, target, f"{shown}:{node.lineno}"))
    return graph


def layers(design: str) -> list[Layer]:
    """The numbered list under ``## Layers``: ``N. Title: `name`, `name/`, ...``."""
    found = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", design, re.M | re.S)
    section = found[1] if found else ""
    return [
        Layer(int(number), title, tuple(re.findall(r"`([^`]+)`", names)))
        for number, title, names in re.findall(r"^(\d+)\. ([^:\n]+): (.+)$", section, re.M)
    ]


# --- the checks --------------------------------------------------------------------------


def placement_problems(known: Sequence[str], stack: Sequence[Layer], package: str) -> list[str]:
    """Modules on no layer or on two, and names of the list that name no module."""
    problems: list[str] = []
    for module in known:
        on = [layer for layer in stack if layer.holds(module, package)]
        if not on:
            problems.append(f"{module} is on no layer; give it one under '## Layers' in {WHERE}")
        elif len(on) > 1:
            where = " and ".join(map(str, on))
            problems.append(f"{module} is on {where}; name it on one layer only in {WHERE}")
    for layer in stack:
        for name in layer.names:
            if not any(_named(name, module, package) for module in known):
                problems.append(
                    f"{layer} names {name!r}, which is no module of {package}; "
                    f"rename or remove it in {WHERE}"
                )
    return problems


def upward(
    graph: Mapping[str, Sequence[Import]], stack: Sequence[Layer], package: str
) -> list[str]:
    """Every import of a module on a higher layer than the importer's, one sentence each."""

    def layer_of(module: str) -> Layer:
        return next(layer for layer in stack if layer.holds(module, package))

    return [
        f"{edge.where}: {edge.source}, on {layer_of(edge.source)}, imports {edge.target}, "
        f"on {layer_of(edge.target)}; move what it needs down to a layer it may import"
        for edges in graph.values()
        for edge in edges
        if layer_of(edge.target).number > layer_of(edge.source).number
    ]


def _path(graph: Mapping[str, Sequence[Import]], start: str, goal: str) -> list[Import] | None:
    """The shortest chain of imports from ``start`` to ``goal``, or None (breadth first)."""
    reached: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            chain: list[Import] = []
            while (edge := reached[node]) is not None:
                chain.append(edge)
                node = edge.source
            return chain[::-1]
        for edge in graph.get(node, ()):
            if edge.target not in reached:
                reached[edge.target] = edge
                queue.append(edge.target)
    return None


def cycles(graph: Mapping[str, Sequence[Import]]) -> list[str]:
    """Each cycle of imports once, as its chain of ``path:line`` imports."""
    found: dict[frozenset[str], str] = {}
    for edges in graph.values():
        for edge in edges:
            back = _path(graph, edge.target, edge.source)
            if back is None:
                continue
            chain = [edge, *back]
            found.setdefault(
                frozenset(step.source for step in chain),
                ", then ".join(f"{step.where} imports {step.target}" for step in chain)
                + "; move what they share into a module that imports none of them",
            )
    return sorted(found.values())


# --- the package as it is ----------------------------------------------------------------


def test_every_module_of_the_package_sits_on_exactly_one_layer_of_the_design() -> None:
    stack = layers(DESIGN.read_text())
    assert [layer.number for layer in stack] == list(range(1, len(stack) + 1)), stack
    assert placement_problems(list(modules(PACKAGE)), stack, PACKAGE.name) == []


def test_no_module_imports_a_module_on_a_higher_layer() -> None:
    stack = layers(DESIGN.read_text())
    assert upward(imports(PACKAGE), stack, PACKAGE.name) == []


def test_no_modules_import_each_other_directly_or_through_others() -> None:
    assert cycles(imports(PACKAGE)) == []


def test_neither_the_agent_nor_the_simulation_imports_the_training_package() -> None:
    """The agent and the workers meet in the worker protocol and below (docs/design.md): the
    agent never loads the training helpers, nor torch through them; nor does the simulation,
    which runs the agent's rules."""
    package = PACKAGE.name
    into_train = [
        f"{edge.where} imports {edge.target}; take it from {package}.protocol or contract"
        for module, edges in imports(PACKAGE).items()
        if module.startswith((f"{package}.agent", f"{package}.simulation"))
        for edge in edges
        if edge.target.startswith(f"{package}.train")
    ]
    assert into_train == []


# --- the reader and the checks, on a package written for them ----------------------------


def _package(tmp_path: Path, files: Mapping[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_an_import_inside_a_function_counts_and_one_under_type_checking_does_not(
    tmp_path: Path,
) -> None:
    root = _package(
        tmp_path,
        {
            "a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from pkg import hints\n"
                "else:\n"
                "    import json\n"
                "def late():\n"
                "    from pkg.b import thing\n"
            ),
            "b.py": "thing = 1\n",
            "hints.py": "",
        },
    )
    assert imports(root)["pkg.a"] == [Import("pkg.a", "pkg.b", "pkg/a.py:7")]


def test_relative_imports_and_names_from_a_package_resolve_to_their_modules(
    tmp_path: Path,
) -> None:
    root = _package(
        tmp_path,
        {
            "sub/__init__.py": "from . import inner\nfrom .inner import NAME\n",
            "sub/inner.py": "from .. import top\nfrom ..top import VALUE\nNAME = 1\n",
            "top.py": "import pkg.sub.inner as alias\nVALUE = 2\n",
        },
    )
    graph = imports(root)
    assert [edge.target for edge in graph["pkg.sub"]] == ["pkg.sub.inner", "pkg.sub.inner"]
    assert [edge.target for edge in graph["pkg.sub.inner"]] == ["pkg.top", "pkg.top"]
    assert [edge.target for edge in graph["pkg.top"]] == ["pkg.sub.inner"]


def test_a_cycle_is_named_by_each_import_on_it_with_its_line(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "a.py": "import pkg.b\n",
            "b.py": "\ndef f():\n    from pkg import c\n",
            "c.py": "from pkg.a import x\n",
            "d.py": "import pkg.a\n",
        },
    )
    assert cycles(imports(root)) == [
        "pkg/a.py:1 imports pkg.b, then pkg/b.py:3 imports pkg.c, then pkg/c.py:1 imports pkg.a; "
        "move what they share into a module that imports none of them"
    ]


def test_an_upward_import_is_named_by_its_two_modules_their_layers_and_its_line(
    tmp_path: Path,
) -> None:
    root = _package(tmp_path, {"low.py": "\n\nimport pkg.high\n", "high/__init__.py": ""})
    stack = layers("## Layers\n\n1. Bottom: `low`\n2. Top: `high/`, `__init__`\n\n## Next\n")
    assert placement_problems(list(modules(root)), stack, "pkg") == []
    assert upward(imports(root), stack, "pkg") == [
        "pkg/low.py:3: pkg.low, on layer 1 (Bottom), imports pkg.high, on layer 2 (Top); "
        "move what it needs down to a layer it may import"
    ]


def test_a_module_on_no_layer_and_a_name_of_no_module_are_both_reported(tmp_path: Path) -> None:
    root = _package(tmp_path, {"new.py": "", "old.py": ""})
    stack = layers("## Layers\n\n1. Only: `old`, `gone`, `__init__`\n")
    assert placement_problems(list(modules(root)), stack, "pkg") == [
        f"pkg.new is on no layer; give it one under '## Layers' in {WHERE}",
        f"layer 1 (Only) names 'gone', which is no module of pkg; rename or remove it in {WHERE}",
    ]
