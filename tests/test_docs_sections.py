"""docs/protocol.md's sections are numbered once each, and every ``docs/protocol.md §N``
that the code cites names one of them (§10.N: the N-th item of §10)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()


def _numbers() -> list[str]:
    return re.findall(r"^#{2,3} (\d+(?:\.\d+[a-z]?)?)\.? ", PROTOCOL, flags=re.M)


def _beyond_the_reference() -> set[str]:
    """§10's numbered items, cited as §10.N."""
    section = PROTOCOL.split("\n## 10.", 1)[1]
    return {f"10.{n}" for n in re.findall(r"^(\d+)\. \*\*", section, flags=re.M)}


def test_every_section_number_is_used_once() -> None:
    numbers = _numbers()
    assert len(numbers) > 40
    twice = sorted({n for n in numbers if numbers.count(n) > 1})
    assert twice == [], f"sections numbered twice: {twice}"


def test_every_cited_section_exists() -> None:
    known = set(_numbers()) | _beyond_the_reference()
    cited: dict[str, set[str]] = {}
    for path in [*ROOT.glob("omnirelay/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]:
        text = path.read_text()
        for number in re.findall(r"protocol\.md\W{0,6}\s*§\s?(\d+(?:\.\d+[a-z]?)?)", text):
            cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    assert len(cited) > 10
    missing = {n: sorted(paths) for n, paths in cited.items() if n not in known}
    assert missing == {}, f"cited sections that docs/protocol.md does not have: {missing}"
