"""The shape of the package, read off its import graph (docs/design.md §1).

* The front layers (``serving``, ``api``, ``cli``, ``orchestrator``) import no model
  family module: only the models interface (``omnirelay.models`` and its interface
  names, ``omnirelay.models.family``, ``omnirelay.models.inputs``,
  ``omnirelay.models.tools``).
* No model family imports another (a family is a package of :data:`omnirelay.models.FAMILIES`,
  and ``omnirelay.models.testing``): what two families share lives in a shared module
  under ``omnirelay.models`` (``code2wav``, ``hf``, ``text``, ``runner`` …).
* Serving reaches the rest through one surface: it imports ``omnirelay.api`` (which
  re-exports the pipeline's types from their homes), the models interface, ``errors``,
  ``ids`` and ``pipeline`` — never the orchestrator, a connector or the engine.
* The request types are imported from their home, ``orchestrator/requests.py`` (or
  through ``omnirelay.api``), never through the router that uses them.
* No loop between packages: siblings never import each other both ways (a package's
  facade importing its own subpackages, and those importing their parent's base
  modules, is layering, not a loop).
* Reclaim goes through the connector contract: outside ``omnirelay.connectors`` nothing
  imports one backend's reclaim (``shm``'s ``sweep``), only
  ``omnirelay.connectors.reclaim_namespace``.
* No public class is defined in two product modules, except the backends' parts that
  play the same role (a connector's ``Producer`` and ``Reader``); no module name
  collides for the names that used to (``config``, ``control``, ``stages``,
  ``admission``).

Imports are read from the source (``ast``), lazy ones inside functions included; those
under ``if TYPE_CHECKING:`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterator
from pathlib import Path

import omnirelay.models
import omnirelay.orchestrator.requests

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "omnirelay"
FRONT = ("serving", "api", "cli", "orchestrator")
MODELS_INTERFACE = {
    "omnirelay.models",
    "omnirelay.models.family",
    "omnirelay.models.inputs",
    "omnirelay.models.tools",
}
#: The model family packages: each shipped family's, and the toys'.
FAMILY_PACKAGES = {type(f).__module__ for f in omnirelay.models.FAMILIES} | {"omnirelay.models.testing"}
#: What ``serving`` may import besides itself and the models interface (packages, with
#: their submodules).
SERVING_SURFACE = (
    "omnirelay.api",
    "omnirelay.errors",
    "omnirelay.ids",
    "omnirelay.pipeline",
    # The one definition of what a listener hears (first playable audio, gaps), which the
    # server's metrics share with ``run`` and ``bench pipeline``; ``timeline`` sits above
    # ``api`` as ``serving`` does, so this is no way around the API.
    "omnirelay.timeline.playback",
)
#: Public classes that are the same role in two backends.
SAME_ROLE = {"Producer", "Reader"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_edges() -> list[tuple[str, str, list[str]]]:
    """``(importer, imported module, names imported from it)`` for every omnirelay import."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges += [(module, a.name, []) for a in node.names if a.name.startswith("omnirelay")]
                continue
            target = _resolve(module, path.name == "__init__.py", node)
            if not target.startswith("omnirelay"):
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if _is_module(sub):  # `from pkg import submodule`
                    edges.append((module, sub, []))
                else:
                    names.append(alias.name)
            if names:
                edges.append((module, target, names))
    return edges


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package(module: str) -> str:
    """The node of the package graph: a top-level module is its own node, any other
    module belongs to the package it lives in."""
    if (ROOT / module.replace(".", "/") / "__init__.py").is_file():
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent == "omnirelay" else parent


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_front_layers_import_no_model_family() -> None:
    interface_names = set(omnirelay.models.__all__)
    leaks = [
        f"{src} imports {dst}"
        for src, dst, _ in import_edges()
        if _layer(src) in FRONT and dst.startswith("omnirelay.models") and dst not in MODELS_INTERFACE
    ]
    leaks += [
        f"{src} imports {name} from omnirelay.models (not one of its interface names)"
        for src, dst, names in import_edges()
        if _layer(src) in FRONT and dst == "omnirelay.models"
        for name in names
        if name not in interface_names
    ]
    assert leaks == []


def _family(module: str) -> str | None:
    return next((f for f in FAMILY_PACKAGES if module == f or module.startswith(f + ".")), None)


def test_no_model_family_imports_another() -> None:
    assert len(FAMILY_PACKAGES) == 5  # the rule below reads the families it is meant to
    borrowed = [
        f"{src} imports {dst}"
        for src, dst, _ in import_edges()
        if _family(src) is not None and _family(dst) not in (None, _family(src))
    ]
    assert borrowed == []


def test_serving_imports_only_the_api_surface() -> None:
    around = [
        f"{src} imports {dst}"
        for src, dst, _ in import_edges()
        if _layer(src) == "serving"
        and _layer(dst) != "serving"
        and dst not in MODELS_INTERFACE
        and not any(dst == ok or dst.startswith(ok + ".") for ok in SERVING_SURFACE)
    ]
    assert around == []


def test_request_types_are_not_imported_through_the_router() -> None:
    through = [
        f"{src} imports {name} from the router"
        for src, dst, names in import_edges()
        if dst == "omnirelay.orchestrator.router"
        for name in names
        if name in omnirelay.orchestrator.requests.__all__
    ]
    assert through == []


def test_the_models_facade_exports_only_the_interface() -> None:
    """What ``omnirelay.models`` exports is defined there or in its interface modules: a
    family's own names are imported from the family's package."""
    for name in omnirelay.models.__all__:
        obj = getattr(omnirelay.models, name)
        home = getattr(obj, "__module__", "omnirelay.models")
        assert home in MODELS_INTERFACE, f"omnirelay.models.{name} is {home}'s"


def test_no_package_loop() -> None:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for src, dst, _ in import_edges():
        a, b = _package(src), _package(dst)
        if a == b or a.startswith(b + ".") or b.startswith(a + "."):
            continue  # within a package, or a package and its own subpackages
        graph[a].add(b)
    assert _loops(graph) == []


def test_no_public_class_or_colliding_module_name_twice() -> None:
    homes: dict[str, list[str]] = collections.defaultdict(list)
    stems: collections.Counter[str] = collections.Counter()
    for path in PACKAGE.rglob("*.py"):
        stems[path.stem] += 1
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                homes[node.name].append(_module_name(path))
    twice = {name: where for name, where in homes.items() if len(where) > 1 and name not in SAME_ROLE}
    assert twice == {}
    assert {s: stems[s] for s in ("config", "control", "stages", "admission") if stems[s] > 1} == {}
    assert "Admission" not in homes


def test_reclaim_goes_through_the_connector_contract() -> None:
    direct = [
        f"{src} imports {dst} {names}"
        for src, dst, names in import_edges()
        if not src.startswith("omnirelay.connectors")
        and (dst.startswith("omnirelay.connectors.shm.reclaim") or "sweep" in names)
    ]
    assert direct == []
