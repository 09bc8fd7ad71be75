"""One ``omnirelay bench`` command under several sets of the runner's switches, one table.

``python -m benchmarks.switches --out DIR --variant base= --variant frame=OMNIRELAY_FRAME_COMPILE=1
-- tts-talker --batches 1,16,64 --profile 64`` runs ``omnirelay bench tts-talker …`` once per
variant, each in a process of its own whose environment adds the variant's ``NAME=VALUE``
pairs (comma-separated; ``base=`` adds none), and prints one table of them all: per batch
the step, the frame and the kernels (``bench tts-talker``), per stage and shape the graph
step (``bench runner``), per rate or concurrency first playable audio and gap-free
streams (``bench speech``, ``bench pipeline``). The environment switches are read when a
stage is built, so variants cannot share a process; compiled kernels are cached on disk
across them (docs/design.md §12), so a variant that compiles what an earlier one compiled
starts faster.

Each variant writes ``DIR/<name>.json`` (the bench's ``--json``) and ``DIR/<name>.log``;
``DIR/summary.json`` holds the table, the commit (``OMNIRELAY_BENCH_COMMIT``) and each
variant's exit status and wall time. Variants run in the given order while ``--budget``
seconds remain, each bounded by ``--variant-timeout``: a long list degrades to fewer
variants, never to no result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["Variant", "main", "parse_variant", "summarize"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")

#: one variant: its name and the environment it adds
Variant = tuple[str, dict[str, str]]


def parse_variant(text: str) -> Variant:
    """``name=K=V,K2=V2`` (or ``name=`` for none) → ``(name, {K: V, K2: V2})``."""
    name, sep, rest = text.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(f"a variant is NAME=[VAR=VALUE,...] with a plain NAME, got {text!r}")
    env: dict[str, str] = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not _ENV_NAME.fullmatch(key):
            raise ValueError(f"variant {name!r}: {pair!r} is not VAR=VALUE with an upper-case VAR")
        env[key] = value
    return name, env


def _run(bench: list[str], variant: Variant, out: Path, timeout_s: float) -> dict[str, Any]:
    name, env = variant
    cmd = [sys.executable, "-m", "omnirelay.cli.main", "bench", *bench, "--json", str(out / f"{name}.json")]
    start = time.monotonic()
    with (out / f"{name}.log").open("w", encoding="utf-8") as log:
        log.write(f"# {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}\n")
        log.flush()
        try:
            rc: int | None = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"name": name, "env": env, "rc": rc, "wall_s": round(time.monotonic() - start, 1)}


def _rows_tts_talker(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "shape": f"{batch} rows",
            "step_ms": fig.get("step_ms"),
            "part_ms": fig.get("frame_ms"),
            "kernels": fig.get("kernels_per_step"),
        }
        for batch, fig in report.get("batches", {}).items()
    ]


def _rows_runner(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for stage, figures in report.items():
        if not isinstance(figures, dict):
            continue
        for shape, fig in figures.items():
            if isinstance(fig, dict) and "graph_ms" in fig:
                rows.append(
                    {
                        "shape": f"{stage} {shape}",
                        "step_ms": fig["graph_ms"],
                        "part_ms": fig.get("floor_ms"),
                        "kernels": fig.get("kernels_per_step"),
                    }
                )
    return rows


def _rows_playable(levels: list[dict[str, Any]], shape: str, tail: str) -> list[dict[str, Any]]:
    """First playable audio's p50 and ``tail`` percentile (ms) and the gap-free share of
    each of ``levels``, named by ``shape`` (a format of the level's fields)."""
    rows = []
    for level in levels:
        playable = level.get("first_playable_s", {})
        rows.append(
            {
                "shape": shape.format_map(defaultdict(lambda: None, level)),
                "step_ms": None if "p50" not in playable else round(1000 * playable["p50"], 1),
                "part_ms": None if tail not in playable else round(1000 * playable[tail], 1),
                "kernels": level.get("gap_free_share"),
            }
        )
    return rows


def _rows_speech(report: dict[str, Any]) -> list[dict[str, Any]]:
    return _rows_playable(report.get("rates", []), "{rate_per_s}/s", "p95")


def _rows_pipeline(report: dict[str, Any]) -> list[dict[str, Any]]:
    return _rows_playable(report.get("levels", []), "c={concurrency}", "p99")


#: how each bench's JSON becomes rows, and what the table's three columns then mean
_READERS = {
    "tts-talker": (_rows_tts_talker, ("step ms", "frame ms", "kernels")),
    "runner": (_rows_runner, ("graph step ms", "floor ms", "kernels")),
    "speech": (_rows_speech, ("first playable p50 ms", "p95 ms", "gap-free share")),
    "pipeline": (_rows_pipeline, ("first playable p50 ms", "p99 ms", "gap-free share")),
}


def summarize(bench: str, runs: list[dict[str, Any]], out: Path) -> tuple[tuple[str, ...], list[list[Any]]]:
    """The table: one row per variant and shape (the bench's JSON read back from ``out``);
    a variant without JSON gets one row saying how it ended."""
    reader, columns = _READERS.get(bench, (lambda report: [], ("a", "b", "c")))
    table: list[list[Any]] = []
    for run in runs:
        path = out / f"{run['name']}.json"
        rows = reader(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else []
        if not rows:
            ended = "timed out" if run["rc"] is None else f"exit status {run['rc']}"
            table.append([run["name"], f"no figures ({ended}; see {run['name']}.log)", None, None, None])
        for row in rows:
            table.append([run["name"], row["shape"], row["step_ms"], row["part_ms"], row["kernels"]])
    return ("variant", "shape", *columns), table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.switches",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Everything after -- is the omnirelay bench command and its arguments (not --json).",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for each variant's JSON and log")
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        required=True,
        help="NAME=VAR=VALUE[,VAR=VALUE...]; NAME= for the environment as it is (repeat, in order)",
    )
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all variants (default 540)")
    p.add_argument("--variant-timeout", type=float, default=300.0, help="seconds for one (default 300)")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCH [ARGS...]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench or "--json" in bench:
        print("switches: give the bench command after -- (without --json)", file=sys.stderr)
        return 2
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        print(f"switches: variant names must differ: {names}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    runs = []
    for variant in args.variant:
        left = deadline - time.monotonic()
        if left < 30:
            print(
                f"switches: {variant[0]} and later left out, {left:.0f} s of the budget remain",
                file=sys.stderr,
            )
            break
        print(f"switches: {variant[0]} ...", file=sys.stderr, flush=True)
        runs.append(_run(bench, variant, args.out, min(args.variant_timeout, left)))
    columns, table = summarize(bench[0], runs, args.out)
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in table:
        print("| " + " | ".join(_cell(v) for v in row) + " |")
    summary = {
        "commit": os.environ.get("OMNIRELAY_BENCH_COMMIT"),
        "bench": bench,
        "runs": runs,
        "columns": columns,
        "table": table,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 0 if runs and all(run["rc"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
