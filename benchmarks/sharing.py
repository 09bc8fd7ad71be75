"""How the three Qwen3-Omni stages should share one GPU: ``bench pipeline`` per variant.

``python -m benchmarks.sharing --out DIR`` runs the full-size pipeline (dummy weights,
every stage on ``--device``) once per variant, each in its own ``omnirelay bench
pipeline`` process, and prints one table of them all. A variant is a set of per-stage
process settings (``gpu_share``, ``gpu_priority``: what the shipped file would say) and
whether the run is under MPS (``bench pipeline --mps``):

* ``eager`` — the eager transformers path at concurrency 1 (the baseline of the runner);
* ``graphs`` — the runner, the stages taking turns on the GPU in time slices;
* ``mps`` — the same under MPS (kernels of the three processes run at once);
* ``mps-low`` — under MPS, the Thinker's kernels at low priority (the Talker's frame,
  on the first audio's critical path, goes first);
* ``mps-share`` — under MPS, the Thinker capped at ``--thinker-share`` % of the SMs;
* ``mps-share-low`` — both.

Each variant writes ``DIR/<variant>.json`` (``bench pipeline --json``), its log and
its pipeline file; variants run in the given order while ``--budget`` seconds remain
(each is bounded by ``--variant-timeout``), so a long list degrades to fewer variants,
never to no result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from omnirelay.pipeline import load_pipeline

__all__ = ["VARIANTS", "main", "variant_pipeline"]

#: variant → (under MPS, per-stage settings by stage name, bench pipeline arguments)
VARIANTS: dict[str, tuple[bool, dict[str, dict[str, Any]], list[str]]] = {
    "eager": (False, {}, ["--runner", "dynamic", "--concurrency", "1", "--requests", "2", "--warmup", "1"]),
    "graphs": (False, {}, []),
    "mps": (True, {}, []),
    "mps-low": (True, {"thinker": {"gpu_priority": "low"}}, []),
    "mps-share": (True, {"thinker": {"gpu_share": "THINKER_SHARE"}}, []),
    "mps-share-low": (True, {"thinker": {"gpu_share": "THINKER_SHARE", "gpu_priority": "low"}}, []),
}


def variant_pipeline(base: str, settings: dict[str, dict[str, Any]], thinker_share: int) -> dict[str, Any]:
    """The pipeline file ``base`` (a shipped name or a path) with ``settings`` merged
    into its stages (a stage's own process settings are replaced, not added to)."""
    path = Path(load_pipeline(base).source)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    for stage in data["stages"]:
        for key in ("gpu_share", "gpu_priority"):
            stage.pop(key, None)
        for key, value in settings.get(stage["name"], {}).items():
            stage[key] = thinker_share if value == "THINKER_SHARE" else value
    return data


def _run_variant(name: str, args: argparse.Namespace, out: Path, timeout_s: float) -> dict[str, Any] | None:
    mps, settings, extra = VARIANTS[name]
    pipeline = out / f"{name}.yaml"
    pipeline.write_text(yaml.safe_dump(variant_pipeline(args.pipeline, settings, args.thinker_share)))
    cmd = [sys.executable, "-m", "benchmarks", "pipeline", "--pipeline", str(pipeline)]
    cmd += ["--device", args.device, "--load-format", "dummy", "--json", str(out / f"{name}.json")]
    cmd += extra or ["--concurrency", args.concurrency]
    cmd += ["--mps"] if mps else []
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"{name}: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _rows(name: str, report: dict[str, Any]) -> list[str]:
    rows = []
    for level in report["levels"]:
        steps = " / ".join(f"{1000 * s['p50']:.1f}" for s in level["step_s"].values())
        rows.append(
            f"| {name} | {level['concurrency']} | {1000 * level['ttfa_s']['p50']:.0f} / "
            f"{1000 * level['ttfa_s']['p99']:.0f} | {1000 * level['ttft_s']['p50']:.0f} | "
            f"{level['requests_per_s']:.2f} | {level['rtf']['p50']:.2f} / {level['rtf']['max']:.2f} | {steps} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="folder for each variant's JSON, log and pipeline file")
    parser.add_argument("--variants", default="graphs,mps-share-low,mps-low,mps-share,eager,mps")
    parser.add_argument("--pipeline", default="qwen3-omni")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--thinker-share", type=int, default=50, help="the Thinker's gpu_share (%% of SMs)")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds for all variants together")
    parser.add_argument("--variant-timeout", type=float, default=150.0, help="seconds for one variant")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    table = [
        "| variant | concurrency | first audio p50 / p99 ms | first text p50 ms | requests/s "
        "| RTF p50 / max | step p50 ms per stage |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        left = deadline - time.monotonic()
        needed = 60.0 if name == "eager" else 90.0
        if left < needed:
            print(f"{name}: skipped, {left:.0f} s left of the budget", flush=True)
            continue
        report = _run_variant(name, args, out, min(args.variant_timeout, left))
        if report is not None:
            table += _rows(name, report)
    text = "\n".join(table)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
