"""Soak the real multi-process pipeline and print a summary table (``python -m benchmarks.soak_pipeline``).

1. **Load**: ``--requests`` concurrent requests (text + audio) through ``toy-3stage``
   (one spawned worker per stage, shm chunks), ``--abort-fraction`` of them aborted by
   the client at seeded random points. Every other request must come back with exactly
   the toy executors' outputs. Then the leak audit: every stage's request books (through
   the control plane), the namespace's transfer objects, and after shutdown: objects,
   processes.
2. **Idle**: ``--parked`` requests held by a stage 0 that never produces, so stages 1
   and 2 hold them all waiting for chunks; the CPU time of each stage worker over
   ``--idle-seconds`` (target: under 2% of a core).

Usage, from a checkout's root: ``python -m benchmarks.soak_pipeline [--requests 200]
[--abort-fraction 0.2] [--seed 0] [--parked 500] [--idle-seconds 10] [--json PATH]``.
Exit status 0 when every check passed. The suite runs a reduced load of the same kind
(``tests/orchestrator_load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from omnirelay.api import Pipeline, RuntimeHooks
from omnirelay.connectors.shm import sweep
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.testing.toy import expected_counting_tokens, expected_relay_tokens, expected_waveform
from omnirelay.worker import leak_paths

PIPELINE = "toy-3stage"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read().decode()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def child_pids() -> list[int]:
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z" and "resource_tracker" not in cmdline:
            out.append(int(entry))
    return out


def audit(pipe: Pipeline) -> dict[str, Any]:
    states = pipe.leak_state()
    leaks = {sid: leak_paths(state) for sid, state in states.items()}
    objects = [o for o in sweep(pipe.namespace).objects if o.kind != "slot"]
    return {
        "stages_with_state": sorted(sid for sid, paths in leaks.items() if paths),
        "state_paths": {sid: paths[:5] for sid, paths in leaks.items() if paths},
        "transfer_objects": len(objects),
    }


def after_shutdown(pipe: Pipeline) -> dict[str, Any]:
    report = pipe.shutdown()
    return {
        "objects_left": len(sweep(pipe.namespace).objects),
        "reclaimed_by_sweep": report.num_reclaimed,
        "workers_killed": report.num_killed,
        "exit_codes": report.exitcodes,
        "stray_processes": len(child_pids()),
    }


# ------------------------------------------------------------------------------ load


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    plan = []
    for i in range(args.requests):
        n = rng.randint(args.min_tokens, args.max_tokens)
        abort_after = rng.randint(0, 2 * n) if rng.random() < args.abort_fraction else None
        plan.append((f"soak{i}", [rng.randint(0, 999)], n, abort_after))

    t_start = time.monotonic()
    pipe = Pipeline.start(PIPELINE)
    startup_s = time.monotonic() - t_start
    latencies: list[float] = []
    outcome = {"completed": 0, "aborted": 0, "failed": 0, "wrong_output": 0}

    async def one(rid: str, prompt: list[int], n: int, abort_after: int | None) -> None:
        t0 = time.monotonic()
        handle = pipe.submit(
            prompt, modalities=["text", "audio"], sampling=SamplingParams(max_tokens=n), request_id=rid
        )
        outs = []
        if abort_after == 0:
            handle.abort()
        try:
            async for o in handle:
                outs.append(o)
                if abort_after is not None and len(outs) == abort_after:
                    handle.abort()
        except Exception as exc:
            outcome["failed"] += 1
            print(f"  {rid}: failed: {exc}", file=sys.stderr)
            return
        if outs[-1].finish_reason == "abort":
            outcome["aborted"] += 1
            return
        text = expected_counting_tokens(prompt, n)
        wave = expected_waveform(expected_relay_tokens(text))
        got_text = [t for o in outs if o.modality == "text" for t in o.token_ids]
        pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
        if got_text != text or not pieces or not torch.equal(torch.cat(pieces), wave):
            outcome["wrong_output"] += 1
            print(f"  {rid}: wrong output", file=sys.stderr)
            return
        outcome["completed"] += 1
        latencies.append(time.monotonic() - t0)

    async def main() -> None:
        await asyncio.gather(*(one(*p) for p in plan))

    try:
        t0 = time.monotonic()
        asyncio.run(main())
        wall_s = time.monotonic() - t0
        leaks = audit(pipe)
    finally:
        stopped = after_shutdown(pipe)
    lat = sorted(latencies)
    return {
        "requests": args.requests,
        "abort_planned": sum(1 for p in plan if p[3] is not None),
        **outcome,
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(args.requests / wall_s, 1),
        "latency_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "latency_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
        **leaks,
        **stopped,
    }


# ------------------------------------------------------------------------------ idle


def run_idle(args: argparse.Namespace) -> dict[str, Any]:
    pipe = Pipeline.start(
        PIPELINE, runtime=RuntimeHooks(engine_factory="benchmarks.parking_engine:build_parked_stage0_engine")
    )
    try:
        handles = [
            pipe.submit([i % 1000], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=8))
            for i in range(args.parked)
        ]
        deadline = time.monotonic() + 60
        while True:  # until both downstream stages hold every request, parked
            health = pipe.health()
            parked = [(st.engine or {}).get("scheduler", {}).get("num_parked", 0) for st in health.stages[1:]]
            if all(n == args.parked for n in parked) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        pids = pipe.pids()
        time.sleep(1.0)  # let the last wakeups pass
        before = {sid: cpu_seconds(pid) for sid, pid in pids.items() if pid}
        time.sleep(args.idle_seconds)
        after = {sid: cpu_seconds(pid) for sid, pid in pids.items() if pid}
        cpu = {sid: round(100 * (after[sid] - before[sid]) / args.idle_seconds, 2) for sid in before}
        for h in handles:
            h.abort()
        for h in handles:
            h.result(30)
        leaks = audit(pipe)
    finally:
        stopped = after_shutdown(pipe)
    return {
        "parked": args.parked,
        "parked_in_stage_1_2": parked,
        "idle_seconds": args.idle_seconds,
        "cpu_percent_of_a_core": cpu,
        **leaks,
        **stopped,
    }


# ------------------------------------------------------------------------------ main


def table(title: str, rows: dict[str, Any]) -> str:
    width = max(len(k) for k in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak_pipeline", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--abort-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parked", type=int, default=500, help="0 skips the idle measurement")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    load = run_load(args)
    print(table(f"load: {args.requests} concurrent requests, {PIPELINE}, seed {args.seed}", load))
    ok = (
        load["failed"] == 0
        and load["wrong_output"] == 0
        and load["completed"] + load["aborted"] == args.requests
        and not load["stages_with_state"]
        and load["transfer_objects"] == 0
        and load["objects_left"] == 0
        and load["stray_processes"] == 0
        and load["workers_killed"] == 0
    )
    result: dict[str, Any] = {"load": load}
    if args.parked:
        idle = run_idle(args)
        print()
        print(table(f"idle: {args.parked} requests waiting for chunks", idle))
        result["idle"] = idle
        ok = ok and all(v < 2.0 for sid, v in idle["cpu_percent_of_a_core"].items() if sid > 0)
        ok = (
            ok
            and not idle["stages_with_state"]
            and idle["objects_left"] == 0
            and idle["stray_processes"] == 0
        )
    print()
    print("PASS" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
