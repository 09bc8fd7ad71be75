"""``omnirelay bench``: a thin entry that loads the ``benchmarks`` package only on use.

The product never imports the benchmarks (checked on the source and in a fresh
interpreter); ``omnirelay bench`` forwards its arguments, help included, to
:func:`benchmarks.cli.main`; without the package (omnirelay installed alone) it says
how to run it from a checkout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnirelay.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _imports_of(path: Path) -> list[tuple[str, bool]]:
    """``(module, at_module_level)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, id(node) in top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            out.append((node.module, id(node) in top))
    return out


def test_the_product_imports_the_benchmarks_only_from_the_bench_entry() -> None:
    importers = {}
    for path in sorted((ROOT / "omnirelay").rglob("*.py")):
        found = [(m, top) for m, top in _imports_of(path) if m.split(".")[0] == "benchmarks"]
        if found:
            importers[str(path.relative_to(ROOT))] = found
    # The one import is lazy: inside the command's function, not at module level.
    assert importers == {"omnirelay/cli/bench.py": [("benchmarks.cli", False)]}


def test_registering_the_commands_loads_no_benchmark() -> None:
    code = (
        "import sys\n"
        "from omnirelay.cli import bench\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'benchmarks', 'torch', 'fastapi'})\n"
        "assert not heavy, heavy\n"
        "from omnirelay.cli.main import build_parser\n"
        "build_parser()\n"
        "assert 'benchmarks' not in sys.modules, 'omnirelay run imports the benchmarks'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_help_is_the_benchmarks_own(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench", "--help"], ["bench", "-h"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "usage: omnirelay bench" in out
        for name in ("transfer", "stress", "adapter", "pipeline", "serve"):
            assert name in out
    with pytest.raises(SystemExit) as exc:
        main(["bench", "stress", "--help"])
    assert exc.value.code == 0
    assert "--cancel-fraction" in capsys.readouterr().out
    assert main(["bench"]) == 2  # no benchmark named: the help, and a usage status
    assert "usage: omnirelay bench" in capsys.readouterr().out


def test_without_the_benchmarks_package_the_command_says_how_to_run_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As an installed omnirelay without its repository: the package cannot be imported.
    monkeypatch.setitem(sys.modules, "benchmarks", None)
    monkeypatch.setitem(sys.modules, "benchmarks.cli", None)
    assert main(["bench", "stress"]) == 1
    err = capsys.readouterr().err
    assert "the benchmarks are not part of the installed omnirelay" in err
    assert "source checkout" in err and "PYTHONPATH" in err
