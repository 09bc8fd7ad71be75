"""docs/conformance.md names, for every row marked supported, tests that exist: each
``file.py::test`` (``::test`` or a bare ``test`` continuing the last file named, ``conf
test`` meaning ``test_openai_conformance.py``) is a test function defined in that file,
and a row that says "same test" follows one that names some. (That they exercise the row is the tests'
own business; this keeps the table from naming tests that are gone or renamed.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = "test_openai_conformance.py"


def _tests_of(file: str) -> set[str]:
    tree = ast.parse((ROOT / "tests" / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def _named(cell: str, last_file: str | None) -> tuple[list[tuple[str, str]], str | None]:
    """The ``(file, test)`` pairs a how/test cell names, and the last file it named."""
    found = []
    for code in re.findall(r"(conf )?`([^`]+)`", cell):
        conf, text = code
        match = re.fullmatch(r"(test_\w+\.py)?(?:::)?(test_\w+)?", text)
        if match is None or not (match.group(1) or match.group(2)):
            continue
        file = CONF if conf else (match.group(1) or last_file)
        if file is None:
            raise AssertionError(f"{text!r} names no file: {cell}")
        last_file = file
        if match.group(2):
            found.append((file, match.group(2)))
    return found, last_file


def test_every_supported_row_names_tests_that_exist() -> None:
    text = (ROOT / "docs" / "conformance.md").read_text()
    missing, unnamed = [], []
    previous: list[tuple[str, str]] = []
    last_file: str | None = None  # "same file, `test_x`": the file the row before named
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[1] in ("status", "---"):
            continue
        named, last_file = _named(cells[2], last_file)
        if not named and cells[2].startswith("same"):
            named = previous
        previous = named
        if cells[1].startswith("supported") and not named:
            unnamed.append(cells[0])
        missing += [f"{f}::{t}" for f, t in named if t not in _tests_of(f)]
    assert unnamed == [] and missing == []


def _status_counts(text: str) -> list[int]:
    """Rows before the summary, by the first word of their status: supported, refused, n/a."""
    counts = [0, 0, 0]
    for line in text.split("\n## Summary", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        word = re.match(r"[\w/]+", cells[1].strip("*"))
        index = {"supported": 0, "refused": 1, "n/a": 2}.get(word.group(0) if word else "")
        if index is not None:
            counts[index] += 1
    return counts


def test_the_summary_total_counts_the_rows() -> None:
    text = (ROOT / "docs" / "conformance.md").read_text()
    total = re.search(r"\| \*\*all\*\* \| \*\*(\d+)\*\* \| \*\*(\d+)\*\* \| \*\*(\d+)\*\* \|", text)
    assert total is not None, "the summary has no **all** row"
    assert [int(n) for n in total.groups()] == _status_counts(text)
