#!/usr/bin/env python
"""Where one codec chunk's time goes in ``omnirelay bench adapter``, step by step.

Runs the adapter benchmark's latency series with both processes instrumented: each step
of the send and receive paths (``save_async``, the lane submit, the send worker picking
the task up, the put and its parts, the receiver's arrival drain, dispatch, get, claim,
``prepare_chunk``, commit) appends ``(step, perf_counter_ns)`` to a per-process list.
``perf_counter_ns`` is CLOCK_MONOTONIC, so the two processes' marks share one time axis.
Trials are then cut at each ``save_async`` (one chunk is in flight at a time) and every
step's median offset from it is printed, sender and receiver interleaved in time order:
the critical path reads top to bottom.

The marks come from thin wrappers installed in the two benchmark processes before they
start (diagnostics only; the library is not changed). Each wrapper adds about 1 µs, so
offsets grow down the table; compare steps within one run, not with ``bench adapter``.

Usage: ``python scripts/trace_adapter_path.py [--chunks 1000] [--raw] [--json PATH]``.
``--raw`` traces the raw connector's trials instead (put → get, no adapter).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

_MARKS: list[tuple[str, int]] = []
_pc = time.perf_counter_ns


def _around(owner: Any, name: str, step: str, when: Callable[[tuple[Any, ...]], bool] | None = None) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when is not None and not when(args):
            return inner(*args, **kwargs)
        _MARKS.append((step + "<", _pc()))
        try:
            return inner(*args, **kwargs)
        finally:
            _MARKS.append((step + ">", _pc()))

    setattr(owner, name, wrapper)


def _instrument(role: str) -> None:
    from omnirelay.bench import adapter_latency_roles as roles
    from omnirelay.connectors.shm import connector, notices, producer, reader
    from omnirelay.transfer import adapter, lanes, receiver, sender

    if role == "sender":
        _around(adapter.TransferAdapter, "save_async", "save_async")
        _around(lanes.LaneExecutor, "submit", "lane_submit")
        _around(lanes.LaneExecutor, "_run_task", "worker_task")
        _around(sender.SendSide, "_send", "send_task")
        _around(connector.ShmConnector, "put", "put", lambda a: a[0].stage_id == roles.SEND_STAGE)
        _around(connector.ShmConnector, "put", "raw_put", lambda a: a[0].stage_id == roles.RAW_SEND)
        _around(notices.Outbox, "_send", "notice_send")
        _around(producer.codec, "plan_encode", "plan_encode")
        _around(producer.slot, "write_publish_header", "write_header")
    else:
        _around(notices.Inbox, "_drain", "drain_notices")
        _around(connector.ShmConnector, "get", "get", lambda a: a[0].stage_id == roles.RECV_STAGE)
        _around(connector.ShmConnector, "get", "raw_get", lambda a: a[0].stage_id == roles.RAW_RECV)
        _around(reader.Reader, "_claim", "claim_decode")
        _around(receiver.ReceiveSide, "entries_to_poll", "entries_to_poll")
        _around(receiver.ReceiveSide, "take_announced", "take_announced")
        _around(receiver.ReceiveSide, "poll", "poll")
        _around(receiver, "prepare_chunk", "prepare_chunk")
        _around(receiver.ReceiveSide, "_commit_locked", "commit")


def _role_main(role: str, out_path: str, target: Callable[..., None], *args: Any) -> None:
    _instrument(role)
    try:
        target(*args)
    finally:
        with open(out_path, "w") as f:
            json.dump(_MARKS, f)


def traced_sender(*args: Any) -> None:
    from omnirelay.bench import adapter_latency_roles as roles

    _role_main("sender", os.environ["OMNIRELAY_TRACE_DIR"] + "/sender.json", roles.sender_main, *args)


def traced_receiver(*args: Any) -> None:
    from omnirelay.bench import adapter_latency_roles as roles

    _role_main("receiver", os.environ["OMNIRELAY_TRACE_DIR"] + "/receiver.json", roles.receiver_main, *args)


def timeline(
    sender: list[list[Any]], receiver: list[list[Any]], *, raw: bool, skip: int, count: int
) -> dict[str, Any]:
    """Median offset of each step's first mark after each trial's start (``save_async``
    entry, or the raw put's entry with ``raw``), over trials ``skip .. skip+count`` of the
    kind (the latency series; the head-of-line series that follows is left out); steps
    seen in under half the trials are left out."""
    first = "raw_put<" if raw else "save_async<"
    last = "raw_get>" if raw else "commit>"
    starts = [t for step, t in sender if step == first][skip : skip + count]
    marks = sorted(
        [("S " + s, t) for s, t in sender] + [("R " + s, t) for s, t in receiver], key=lambda m: m[1]
    )
    times = [t for _, t in marks]
    offsets: dict[str, list[float]] = {}
    for t0 in starts:
        seen: set[str] = set()
        for step, t in marks[bisect.bisect_left(times, t0) :]:
            if t != t0 and step in ("S save_async<", "S raw_put<"):
                break  # the next trial began
            if step not in seen:
                seen.add(step)
                offsets.setdefault(step, []).append((t - t0) / 1e3)
            if step == "R " + last:
                break
    rows = [
        {"step": step, "n": len(xs), "median_us": statistics.median(xs)}
        for step, xs in offsets.items()
        if len(xs) >= len(starts) / 2
    ]
    rows.sort(key=lambda r: r["median_us"])
    return {"trials": len(starts), "steps": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1000, help="measured trials per kind (default 1000)")
    parser.add_argument("--raw", action="store_true", help="trace the raw connector's trials instead")
    parser.add_argument("--json", metavar="PATH", help="write the timeline as JSON to PATH")
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error(f"--chunks must be >= 1, got {args.chunks}")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_adapter_path as this  # the spawned processes import the wrappers by this name

    from omnirelay.bench import adapter_latency

    warmup = 100
    with tempfile.TemporaryDirectory(prefix="omnirelay-trace-") as tmp:
        os.environ["OMNIRELAY_TRACE_DIR"] = tmp
        adapter_latency.sender_main = this.traced_sender  # type: ignore[assignment]
        adapter_latency.receiver_main = this.traced_receiver  # type: ignore[assignment]
        result = adapter_latency.run_adapter_latency(args.chunks, 10, warmup=warmup)
        if "latency" not in result:
            print(f"trace_adapter_path: the benchmark failed: {result['error']}", file=sys.stderr)
            return 1
        with open(os.path.join(tmp, "sender.json")) as f:
            sender = json.load(f)
        with open(os.path.join(tmp, "receiver.json")) as f:
            receiver = json.load(f)
    report = timeline(sender, receiver, raw=args.raw, skip=warmup, count=args.chunks)
    lat = result["latency"]
    report["adapter_p50_us"] = lat["adapter_published"]["p50_us"]
    report["raw_p50_us"] = lat["raw_connector"]["p50_us"]
    report["cpu_probe_s"] = result["env"]["cpu_probe_s"]
    kind = "raw connector put → get" if args.raw else "adapter save_async → commit"
    print(
        f"{kind}: median offset of each step from the trial's start over {report['trials']} trials "
        f"(S sender, R receiver; '<' entry, '>' exit). Instrumented run: adapter p50 "
        f"{report['adapter_p50_us']:.0f} µs, raw p50 {report['raw_p50_us']:.0f} µs, cpu probe "
        f"{report['cpu_probe_s']:.2f} s"
    )
    for row in report["steps"]:
        print(f"  {row['median_us']:8.1f} µs  {row['step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
