"""Compare two interpreters, or two checkouts, on ``omnirelay bench adapter``, run by run.

A shared machine's speed drifts from minute to minute: two series run one after the
other compare the minutes as much as the code. This tool alternates instead: pair i runs
the benchmark under side A, then under side B, each in a fresh process. It prints every
pair's figures, the medians of each side, and the paired difference of the adapter p50
(B - A), with the number of pairs that B won. Use it for before/after comparisons of a
change (the adapter's figures move by less than a machine's drift).

A side is an interpreter (``--a`` / ``--b``, default: this one) and, optionally, a
checkout to run (``--a-path`` / ``--b-path``: the run starts in that directory with it
first on PYTHONPATH, so it imports that checkout's omnirelay whichever directory this
tool runs from; a checkout needs its C extensions built in place). From a checkout's
root::

    python -m benchmarks.pair_adapter_runs --a python3 --b ~/.venvs/omnirelay/bin/python
    python -m benchmarks.pair_adapter_runs --a-path ../before --b-path . --pairs 12

Each run is ``PY -m omnirelay.cli.main bench adapter --chunks N --json ...`` (a command
every checkout has, whether its benchmarks live in ``benchmarks/`` or in the package);
its report is read the way ``bench adapter --runs`` reads its own
(``summarize_adapter_runs`` of this checkout). ``--json`` writes every report and the
summary. Exit status 0 when every pair completed with a clean leak audit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.adapter_latency import summarize_adapter_runs


def run_once(python: str, path: str | None, chunks: int, out: str, timeout_s: float) -> dict[str, Any]:
    """One ``bench adapter`` run: its report (the JSON it wrote), or ``{"error": ...}``."""
    env = dict(os.environ)
    cwd = None
    if path is not None:
        # ``-m`` puts the working directory first on sys.path: it must be the checkout too.
        cwd = os.path.abspath(path)
        env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [python, "-m", "omnirelay.cli.main", "bench", "adapter", "--chunks", str(chunks), "--json", out]
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:g} s"}
    try:
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}, no report: {' | '.join(tail)}"}
    if "latency" not in report:
        return {"error": report.get("error") or "the benchmark failed"}
    return report


def summarize(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Each side's medians (``summarize_adapter_runs``, as ``bench adapter --runs`` makes
    them) over the pairs where both runs gave figures, and the paired difference of the
    adapter p50."""
    good = [(a, b) for a, b in pairs if "latency" in a and "latency" in b]
    out: dict[str, Any] = {"num_pairs": len(pairs), "num_complete": len(good)}
    if not good:
        return out
    sides = [summarize_adapter_runs([p[idx] for p in good]) for idx in (0, 1)]
    for name, side in zip(("a", "b"), sides):
        out[name] = {**side["medians"], "all_ok": side["ok"]}
    diffs = [b["adapter_p50_us"] - a["adapter_p50_us"] for a, b in zip(sides[0]["runs"], sides[1]["runs"])]
    out["adapter_diff_us"] = {"median": statistics.median(diffs), "mean": statistics.fmean(diffs)}
    out["b_faster_in"] = sum(1 for d in diffs if d < 0)
    return out


def _line(label: str, r: dict[str, Any]) -> str:
    if "latency" not in r:
        return f"  {label}: FAILED - {r.get('error')}"
    (row,) = summarize_adapter_runs([r])["runs"]
    clean = "clean" if row["ok"] else "LEAK AUDIT FAILED"
    return (
        f"  {label}: floor {row['floor_p50_us']:5.0f}  raw {row['raw_p50_us']:5.0f}  adapter "
        f"{row['adapter_p50_us']:5.0f}  overhead {row['overhead_p50_us']:4.0f} µs  HOL p99 "
        f"{row['hol_added_p99_us'] / 1e3:5.2f} ms  {clean}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pair_adapter_runs", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--a", default=sys.executable, metavar="PYTHON", help="side A's interpreter (default: this one)"
    )
    parser.add_argument(
        "--b", default=sys.executable, metavar="PYTHON", help="side B's interpreter (default: this one)"
    )
    parser.add_argument("--a-path", metavar="DIR", help="side A runs this checkout")
    parser.add_argument("--b-path", metavar="DIR", help="side B runs this checkout")
    parser.add_argument("--pairs", type=int, default=8, help="pairs of runs (default 8)")
    parser.add_argument(
        "--chunks", type=int, default=600, help="measured chunks per series and run (default 600)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="bound on each run in seconds (default 300)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every pair and the summary as JSON to PATH")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.chunks < 1:
        parser.error(f"--chunks must be >= 1, got {args.chunks}")
    sides = []
    for name, python, path in (("A", args.a, args.a_path), ("B", args.b, args.b_path)):
        exe = shutil.which(python)
        if exe is None:
            parser.error(f"side {name}: no interpreter {python!r} (give a path or a name on PATH)")
        if path is not None and not os.path.isdir(os.path.join(path, "omnirelay")):
            parser.error(f"side {name}: {path!r} holds no omnirelay package")
        sides.append((exe, path))
        print(f"side {name}: {exe}" + (f", omnirelay from {os.path.abspath(path)}" if path else ""))

    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="omnirelay-pair-") as tmp:
        for i in range(args.pairs):
            got = [
                run_once(exe, path, args.chunks, os.path.join(tmp, f"{i}-{n}.json"), args.timeout)
                for n, (exe, path) in enumerate(sides)
            ]
            a, b = got
            pairs.append((a, b))
            print(f"pair {i + 1} of {args.pairs}")
            print(_line("A", a))
            print(_line("B", b))
    summary = summarize(pairs)
    print(f"\n{summary['num_complete']} of {summary['num_pairs']} pairs complete")
    if summary["num_complete"]:
        for side in ("a", "b"):
            m = summary[side]
            print(
                f"  median {side.upper()}: floor {m['floor_p50_us']:.0f}  raw {m['raw_p50_us']:.0f}  adapter "
                f"{m['adapter_p50_us']:.0f}  overhead {m['overhead_p50_us']:.0f} µs  HOL p99 "
                f"{m['hol_added_p99_us'] / 1e3:.2f} ms"
            )
        d = summary["adapter_diff_us"]
        print(
            f"  adapter p50, B - A: median {d['median']:+.1f} µs, mean {d['mean']:+.1f} µs; "
            f"B faster in {summary['b_faster_in']} of {summary['num_complete']} pairs"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"sides": [{"python": e, "path": p} for e, p in sides], "pairs": pairs, "summary": summary},
                f,
                indent=1,
            )
    ok = summary["num_complete"] == summary["num_pairs"] and all(
        summary[s]["all_ok"] for s in ("a", "b") if s in summary
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
