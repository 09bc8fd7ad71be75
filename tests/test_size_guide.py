"""docs/design.md §9 is true: it names every file of ``omnirelay/`` over the size guide
(600 lines) and every function over it (80 lines, from ``def`` to its last line), and
nothing that is back under the guide."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """Every function's qualified name (``Class.method``) and length in lines."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((prefix + node.name, (node.end_lineno or node.lineno) - node.lineno + 1))
            found += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, f"{prefix}{node.name}.")
    return found


def over_the_guide() -> set[str]:
    """``path`` for each file over the guide, ``path: function`` for each function
    (paths relative to ``omnirelay/``, as §9 writes them)."""
    over: set[str] = set()
    for path in sorted((ROOT / "omnirelay").rglob("*.py")):
        rel = path.relative_to(ROOT / "omnirelay").as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            over.add(rel)
        over |= {f"{rel}: {name}" for name, n in _functions(ast.parse(text)) if n > MAX_FUNCTION_LINES}
    return over


def listed() -> set[str]:
    """What design.md §9's table names (its first column)."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n## 9.", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_design_names_every_file_and_function_over_the_size_guide() -> None:
    over, named = over_the_guide(), listed()
    assert sorted(over - named) == [], (
        "over the size guide and not in docs/design.md §9 (split it or name it)"
    )
    assert sorted(named - over) == [], "in docs/design.md §9 but back under the size guide (drop the row)"
