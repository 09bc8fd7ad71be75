"""``omnirelay bench``: a thin entry to the benchmarks of a source checkout.

The benchmarks are their own package, ``benchmarks/`` beside ``omnirelay/`` in the
repository; they import omnirelay, never the other way round. This command forwards
its arguments to :func:`benchmarks.cli.main`, importing it only when a benchmark runs
(or its help is asked for): registering the command imports nothing of the benchmarks
nor their dependencies, so every other command starts without them. Where the package
is not importable (omnirelay installed without its repository), the command says how
to run it from a checkout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import omnirelay

__all__ = ["register", "run_bench"]

#: Every benchmark of benchmarks/cli.py, for ``omnirelay --help`` (a test holds the two together).
_BENCHES = "transfer, stress, adapter, pipeline, serve, runner, tts-talker, speech, chaos"


def register(sub: Any) -> None:
    # No parser of the benchmarks here: their options live with them (benchmarks/cli.py);
    # help included, so ``omnirelay bench [BENCH] --help`` shows theirs.
    p = sub.add_parser(
        "bench",
        help=f"benchmarks of a source checkout: {_BENCHES} (omnirelay bench --help)",
        add_help=False,
    )
    p.add_argument("-h", "--help", action="store_true", dest="bench_help")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_bench)


def _checkout_root() -> Path | None:
    """The source checkout omnirelay was imported from, if it holds the benchmarks.

    An editable install imports omnirelay from its checkout, where ``benchmarks/`` sits
    beside it; a console script does not put that directory on ``sys.path``.
    """
    root = Path(omnirelay.__file__).resolve().parent.parent
    return root if (root / "benchmarks" / "cli.py").is_file() else None


def run_bench(args: argparse.Namespace) -> int:
    root = _checkout_root()
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from benchmarks.cli import main
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.cli"):
            raise  # a dependency of the benchmarks is missing: say which
        print(
            "omnirelay bench: error: the benchmarks are not part of the installed omnirelay: they "
            "are the benchmarks/ package of a source checkout. Install omnirelay from a checkout "
            "(pip install -e /path/to/omnirelay), or point PYTHONPATH at one "
            "(PYTHONPATH=/path/to/omnirelay omnirelay bench ...).",
            file=sys.stderr,
        )
        return 1
    return main(["--help", *args.bench_args] if args.bench_help else list(args.bench_args))
